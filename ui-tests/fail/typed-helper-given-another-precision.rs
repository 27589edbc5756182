use candle_amp::{autocast, Tensor, F16, F32};
use candle_core::Device;

/// Takes a `Tensor<F32>` or a value computed in a region, not a typed tensor of another
/// precision.
#[autocast]
fn helper(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    Ok(x.relu()?)
}

fn main() -> candle_core::Result<()> {
    let x = Tensor::<F16>::ones((2, 2), &Device::Cpu)?;
    helper(&x)?;
    Ok(())
}
