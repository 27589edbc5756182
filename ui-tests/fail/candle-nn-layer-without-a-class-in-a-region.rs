//! A candle-nn layer candle-amp has no counterpart of, called on a region value: rejected, and
//! the message says how to run it with its class stated (never run in whatever dtype arrives).
use candle_amp::{autocast, Tensor, F32};
use candle_nn::Sequential;

#[autocast(fp16)]
fn block(up: &Sequential, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let h = x.relu()?;
    Ok(up.forward(&h)?)
}

fn main() {}
