//! The fixes the compile errors suggest: cast explicitly, then every op type-checks.
use candle_amp::nn::loss;
use candle_amp::{ops, Tensor, BF16, F16, F32};
use candle_core::Device;

fn main() -> candle_core::Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::<F16>::ones((2, 3), &dev)?;
    let y = Tensor::<F32>::ones((2, 3), &dev)?;
    let b = Tensor::<BF16>::ones((2, 3), &dev)?;
    let total: Tensor<F32> = x.cast::<F32>()?.sum_all()?;
    let mixed: Tensor<F32> = (&x.cast::<F32>()? + &y)?;
    let (p, q) = x.promote_with(&y)?;
    let probs: Tensor<F32> = ops::softmax(&(&p + &q)?, 1)?;
    let l = loss::mse(&probs, &mixed)?;
    let halves: Tensor<F16> = (&x + &b.cast::<F16>()?)?;
    assert_eq!(total.to_scalar::<f32>()?, 6.0);
    assert!(l.to_scalar::<f32>()?.is_finite());
    assert_eq!(halves.dtype(), candle_core::DType::F16);
    Ok(())
}
