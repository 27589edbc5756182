use candle_amp::{Tensor, BF16};

fn activations(x: &Tensor<BF16>) -> candle_core::Result<()> {
    let _ = x.exp()?;
    Ok(())
}

fn main() {}
