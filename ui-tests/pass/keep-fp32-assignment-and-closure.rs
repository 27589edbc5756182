//! `#[keep_fp32]` on an assignment statement and on a closure.
use candle_amp::{autocast, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, Result};

#[autocast(fp16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Vec<DType>> {
    let mut h = x.matmul(w)?;
    let half = h.dtype();
    #[keep_fp32]
    h = h.matmul(w)?;
    let kept = h.dtype();
    let f32_matmul = #[keep_fp32]
    |a: &AmpTensor| a.matmul(w);
    let lower_matmul = |a: &AmpTensor| a.matmul(w);
    Ok(vec![half, kept, f32_matmul(&h)?.dtype(), lower_matmul(&h)?.dtype()])
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let (x, w) = (Tensor::<F32>::ones((1, 2), &dev)?, Tensor::<F32>::ones((2, 2), &dev)?);
    assert_eq!(forward(&x, &w)?, [DType::F16, DType::F32, DType::F32, DType::F16]);
    Ok(())
}
