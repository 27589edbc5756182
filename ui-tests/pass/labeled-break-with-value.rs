//! A labeled `break` carrying a routed value out of nested loops.
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};

#[autocast(bf16)]
fn first_wide(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    let h = 'outer: loop {
        for _ in 0..3 {
            let h = x.matmul(w)?;
            if h.dim(1)? > 1 {
                break 'outer h.relu()?;
            }
        }
        break x.clone().relu()?;
    };
    assert_eq!(h.dtype(), DType::BF16);
    Ok(h)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let y = first_wide(&Tensor::<F32>::ones((2, 3), &dev)?, &Tensor::<F32>::ones((3, 2), &dev)?)?;
    assert_eq!(y.to_vec2::<f32>()?, [[3.0, 3.0], [3.0, 3.0]]);
    Ok(())
}
