// A region's tensors leave through a `Result`: `-> Option<Tensor<F32>>` has no way out.
use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
fn forward(x: Option<&Tensor<F32>>, w: &Tensor<F32>) -> Option<Tensor<F32>> {
    let x = x?;
    x.matmul(w).ok()
}

fn main() {}
