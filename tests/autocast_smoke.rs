use candle_amp::nn::{self, loss};
use candle_amp::{autocast, cast_count, ops, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

struct Mlp {
    layers: Vec<nn::Linear>,
    norm: nn::LayerNorm,
}

#[autocast(fp16)]
impl Mlp {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for layer in &self.layers {
            h = layer.forward(&h)?.relu()?;
        }
        println!("hidden dtype {:?}", h.dtype());
        let h = self.norm.forward(&h)?;
        Ok(ops::softmax(&h, 1)?)
    }
}

#[test]
fn smoke() -> Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let m = Mlp {
        layers: vec![nn::linear(4, 8, vb.pp("a"))?, nn::linear(8, 8, vb.pp("b"))?],
        norm: nn::layer_norm(8, 1e-5, vb.pp("n"))?,
    };
    let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev)?;
    let before = cast_count();
    let y = m.forward(&x)?;
    println!("casts {}", cast_count() - before);
    let l = loss::mse(&y, &Tensor::zeros((2, 8), &dev)?)?;
    let _ = l.as_candle().backward()?;
    let _: Option<AmpTensor> = None;
    Ok(())
}
