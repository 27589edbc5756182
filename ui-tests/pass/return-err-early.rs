//! `return Err(..)` from a region: the error leaves as written, a value through the exit.
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};

#[autocast(fp16)]
fn checked(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Tensor<F32>> {
    if x.dim(1)? != w.dim(0)? {
        return Err(candle_core::Error::Msg("shapes do not chain".into()));
    }
    if x.dim(0)? == 1 {
        return Ok(x.matmul(w)?);
    }
    let h = x.matmul(w)?;
    assert_eq!(h.dtype(), DType::F16);
    Ok(h)
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let w = Tensor::<F32>::ones((3, 2), &dev)?;
    assert!(checked(&Tensor::<F32>::ones((2, 4), &dev)?, &w).is_err());
    assert_eq!(checked(&Tensor::<F32>::ones((1, 3), &dev)?, &w)?.dims(), &[1, 2]);
    assert_eq!(checked(&Tensor::<F32>::ones((2, 3), &dev)?, &w)?.dims(), &[2, 2]);
    Ok(())
}
