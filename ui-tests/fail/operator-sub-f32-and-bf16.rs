use candle_amp::{Tensor, BF16, F32};

fn delta(x: &Tensor<F32>, y: &Tensor<BF16>) -> candle_core::Result<()> {
    let _ = (x - y)?;
    Ok(())
}

fn main() {}
