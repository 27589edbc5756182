//! A `mut` tensor parameter reassigned in the region, by value and by reference.
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};

#[autocast(fp16)]
fn layers(mut x: Tensor<F32>, mut w: &Tensor<F32>, w2: &Tensor<F32>) -> Result<Tensor<F32>> {
    for _ in 0..2 {
        x = x.matmul(w)?.relu()?;
        w = w2;
    }
    assert_eq!(x.dtype(), DType::F16);
    Ok(x)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::<F32>::ones((2, 2), &dev)?;
    let y = layers(Tensor::<F32>::ones((1, 2), &dev)?, &w, &w)?;
    assert_eq!(y.to_vec2::<f32>()?, [[4.0, 4.0]]);
    Ok(())
}
