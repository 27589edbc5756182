use candle_amp::nn::LayerNorm;
use candle_amp::{Tensor, BF16};

fn block(norm: &LayerNorm, x: &Tensor<BF16>) -> candle_core::Result<()> {
    let _ = norm.forward(x)?;
    Ok(())
}

fn main() {}
