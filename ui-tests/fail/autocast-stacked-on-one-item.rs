//! Two region attributes on one item: the second is an error, never a silent winner.
use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
#[autocast(bf16)]
fn forward(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    Ok(x.relu()?)
}

fn main() {}
