//! A return type behind an alias: `output = ..` says what the alias hides.
use candle_amp::{autocast, Tensor, F16, F32};
use candle_core::{DType, Device, Result};

type Out = Result<Tensor<F32>>;
type Half = Result<Tensor<F16>>;

#[autocast(fp16, output = f32)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Out {
    Ok(x.matmul(w)?)
}

#[autocast(fp16, output = f16)]
fn half(x: &Tensor<F32>, w: &Tensor<F32>) -> Half {
    Ok(x.matmul(w)?)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let (x, w) = (Tensor::<F32>::ones((1, 2), &dev)?, Tensor::<F32>::ones((2, 2), &dev)?);
    assert_eq!(forward(&x, &w)?.dtype(), DType::F32);
    assert_eq!(half(&x, &w)?.dtype(), DType::F16);
    Ok(())
}
