//! Any candle function on a region value, with its PyTorch op class stated by the caller: the
//! input is cast where that class runs under the policy (no hard-coded dtype).
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};

#[autocast(fp16)]
fn mixed(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    let h = x.lower_op(|t| t.matmul(&w.to_dtype(t.dtype())?))?; // f16
    assert_eq!(h.dtype(), DType::F16);
    let s = h.fp32_op(|t| candle_nn::ops::softmax_last_dim(t))?; // f32
    assert_eq!(s.dtype(), DType::F32);
    let a = h.preserve_op(candle_nn::ops::sigmoid)?; // stays f16
    assert_eq!(a.dtype(), DType::F16);
    Ok((s + a)?)
}

fn main() -> Result<()> {
    let x = Tensor::<F32>::ones((2, 3), &Device::Cpu)?;
    let w = Tensor::<F32>::ones((3, 3), &Device::Cpu)?;
    assert_eq!(mixed(&x, &w)?.dims(), &[2, 3]);
    Ok(())
}
