use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16, enabled)]
fn forward(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    Ok(x.relu()?)
}

fn main() {}
