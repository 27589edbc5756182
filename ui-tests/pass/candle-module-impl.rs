//! `#[autocast(..)] impl candle_nn::Module`: candle tensors in and out, so the model drops into
//! f32 candle code (`xs.apply(&m)`); the result leaves in the input's dtype, or the one `output`
//! names.
use candle_amp::nn::{self, Linear};
use candle_amp::autocast;
use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{VarBuilder, VarMap};

struct Mlp {
    fc1: Linear,
    fc2: Linear,
}

#[autocast(fp16)]
impl Module for Mlp {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let h = self.fc1.forward(xs)?.gelu()?;
        self.fc2.forward(&h)
    }
}

struct Logits(Linear);

#[autocast(bf16, output = f32)]
impl Module for Logits {
    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        self.0.forward(xs)
    }
}

fn main() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let mlp = Mlp { fc1: nn::linear(4, 8, vb.pp("a"))?, fc2: nn::linear(8, 4, vb.pp("b"))? };
    let head = Logits(nn::linear(4, 2, vb.pp("c"))?);
    let xs = Tensor::ones((3, 4), DType::F32, &Device::Cpu)?;
    let ys = xs.apply(&mlp)?;
    assert_eq!(ys.dtype(), DType::F32);
    let logits = ys.to_dtype(DType::BF16)?.apply(&head)?;
    assert_eq!(logits.dtype(), DType::F32);
    Ok(())
}
