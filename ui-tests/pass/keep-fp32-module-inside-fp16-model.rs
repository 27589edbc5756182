//! A per-layer f32 override: `#[keep_fp32]` on a module's impl, called from an fp16 region.
use candle_amp::nn::{self, loss};
use candle_amp::{autocast, keep_fp32, Tensor, F32};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};

struct Head {
    fc: nn::Linear,
}

#[keep_fp32]
impl Head {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        let y = self.fc.forward(&x)?;
        assert_eq!(y.dtype(), DType::F32);
        Ok(y)
    }
}

struct Model {
    body: nn::Linear,
    head: Head,
}

#[autocast(fp16)]
impl Model {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        let h = self.body.forward(&x)?.relu()?;
        assert_eq!(h.dtype(), DType::F16);
        Ok(self.head.forward(&h)?)
    }
}

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let model = Model {
        body: nn::linear(4, 8, vb.pp("body"))?,
        head: Head { fc: nn::linear(8, 1, vb.pp("head"))? },
    };
    let x = Tensor::<F32>::ones((2, 4), &dev)?;
    let l = loss::mse(&model.forward(&x)?, &Tensor::zeros((2, 1), &dev)?)?;
    l.as_candle().backward()?;
    Ok(())
}
