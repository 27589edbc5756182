use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16, output = f16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    Ok(x.matmul(&w)?)
}

fn main() {}
