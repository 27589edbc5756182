use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
async fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    x.matmul(w)
}

fn main() {}
