use candle_amp::nn::loss;
use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
fn train_step(x: &Tensor<F32>, w: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let y = x.matmul(&w)?;
    let l = loss::mse(&y, &x)?;
    l.as_candle().backward()?;
    Ok(l.cast::<F32>()?)
}

fn main() {}
