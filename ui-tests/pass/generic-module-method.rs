//! A generic `forward` in an `#[autocast]` impl, called directly and from a region.
use candle_amp::nn::{self, Linear};
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

struct Scaled {
    fc: Linear,
}

#[autocast]
impl Scaled {
    fn forward<'a, S: Into<f64>>(&self, x: &'a Tensor<F32>, s: S) -> Result<Tensor<F32>>
    where
        S: Copy,
    {
        let s: f64 = s.into();
        Ok((self.fc.forward(x)? * s)?)
    }
}

#[autocast(fp16)]
fn run(m: &Scaled, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    let h = m.forward(x, 2.0f32)?;
    assert_eq!(h.dtype(), DType::F16);
    Ok(h)
}

fn main() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let m = Scaled { fc: nn::linear(3, 2, vb)? };
    let x = Tensor::<F32>::ones((1, 3), &Device::Cpu)?;
    assert_eq!(run(&m, &x)?.dims(), &[1, 2]);
    assert_eq!(m.forward(&x, 3u8)?.dtype(), DType::F32);
    Ok(())
}
