// Region values convert to the declared tensors inside tuples, `Option`s and `Vec`s, not arrays.
use candle_amp::{autocast, Tensor, F32};
use candle_core::Result;

#[autocast(fp16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<[Tensor<F32>; 2]> {
    let h = x.matmul(w)?;
    Ok([h.clone(), h])
}

fn main() {}
