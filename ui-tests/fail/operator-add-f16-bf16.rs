use candle_amp::{Tensor, BF16, F16};

fn mix(x: &Tensor<F16>, y: &Tensor<BF16>) -> candle_core::Result<()> {
    let _ = (x + y)?;
    Ok(())
}

fn main() {}
