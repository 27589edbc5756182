//! A region runs at run time: `const fn` is rejected on its `const`.
use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
const fn forward(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    Ok(x.relu()?)
}

fn main() {}
