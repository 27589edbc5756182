//! candle's own `Tensor::cat` joins candle tensors: region values there do not compile (candle
//! would join them in whatever dtypes they hold). candle-amp's `Tensor::cat` joins them in their
//! promoted dtype.
use candle_amp::{autocast, AmpTensor, Tensor, F32};

#[autocast(fp16)]
fn grow(cache: &AmpTensor, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let k = x.matmul(x)?;
    Ok(candle_core::Tensor::cat(&[cache, &k], 2)?)
}

fn main() {}
