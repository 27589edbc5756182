//! candle-nn's own layers called from a region run in their PyTorch op class (Linear in the
//! lower precision, LayerNorm in f32, Embedding as it is), and candle-amp's layers are
//! `candle_nn::Module`s for plain candle code.
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Module, Result};
use candle_nn::{VarBuilder, VarMap};

struct Plainish {
    emb: candle_nn::Embedding,
    fc: candle_nn::Linear,
    ln: candle_nn::LayerNorm,
}

#[autocast(fp16)]
impl Plainish {
    fn forward(&self, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
        let e = self.emb.forward(ids)?;
        let h = self.fc.forward(&e)?;
        assert_eq!((e.dtype(), h.dtype()), (DType::F32, DType::F16));
        let n = self.ln.forward(&h)?;
        assert_eq!(n.dtype(), DType::F32);
        Ok(n)
    }
}

fn main() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let m = Plainish {
        emb: candle_nn::embedding(5, 4, vb.pp("emb"))?,
        fc: candle_nn::linear(4, 4, vb.pp("fc"))?,
        ln: candle_nn::layer_norm(4, 1e-5, vb.pp("ln"))?,
    };
    let ids = candle_core::Tensor::new(&[[0u32, 3]], &Device::Cpu)?;
    assert_eq!(m.forward(&ids)?.dims(), &[1, 2, 4]);
    // A candle-amp layer in plain candle code, f32 outside any region.
    let layer = candle_amp::nn::linear(4, 2, vb.pp("out"))?;
    let y = candle_core::Tensor::ones((3, 4), DType::F32, &Device::Cpu)?.apply(&layer)?;
    assert_eq!((y.dims(), y.dtype()), (&[3, 2][..], DType::F32));
    Ok(())
}
