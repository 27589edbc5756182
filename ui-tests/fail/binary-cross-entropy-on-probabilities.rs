use candle_amp::nn::loss;
use candle_amp::{Tensor, F32};

// PyTorch bans binary_cross_entropy on probabilities under fp16 autocast; here it is not offered
// at all, and the logits form is the one to use.
fn objective(probs: &Tensor<F32>, target: &Tensor<F32>) -> candle_core::Result<()> {
    let _ = loss::binary_cross_entropy(probs, target)?;
    Ok(())
}

fn main() {}
