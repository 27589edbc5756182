use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
fn later(x: &Tensor<F32>, w: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let _pending = async move { x.matmul(w) };
    Ok(x.clone())
}

fn main() {}
