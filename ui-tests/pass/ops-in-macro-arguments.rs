//! Ops inside the arguments of expression macros (`vec!`, `assert!`, `format!`) and inside the
//! expression `matches!` tests run under the region's policy, as they would outside a macro;
//! `matches!`'s pattern is left as written.
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};

#[autocast(fp16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<Vec<bool>> {
    let product_is_half = matches!(x.matmul(w)?.dtype(), DType::F16);
    let shaped = matches!(x.matmul(w)?.dims(), [1, n] if *n == 2);
    let dtypes = vec![x.matmul(w)?.dtype(), x.exp()?.dtype()];
    assert!(x.matmul(w)?.dtype() == DType::F16, "{:?}", x.matmul(w)?.dtype());
    let described = format!("{:?}", x.matmul(w)?.dtype());
    Ok(vec![
        product_is_half,
        shaped,
        dtypes == [DType::F16, DType::F32],
        described == "F16",
    ])
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let (x, w) = (Tensor::<F32>::ones((1, 2), &dev)?, Tensor::<F32>::ones((2, 2), &dev)?);
    assert_eq!(forward(&x, &w)?, [true, true, true, true]);
    Ok(())
}
