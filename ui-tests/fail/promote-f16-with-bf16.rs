use candle_amp::{Tensor, BF16, F16};

fn merge(x: &Tensor<F16>, y: &Tensor<BF16>) -> candle_core::Result<()> {
    let _ = x.promote_with(y)?;
    Ok(())
}

fn main() {}
