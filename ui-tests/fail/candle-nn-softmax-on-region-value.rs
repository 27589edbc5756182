//! candle-nn's functional ops take `&candle_core::Tensor`: on a region value they do not
//! compile (never a softmax silently run in f16). `candle_amp::ops::softmax` is routed in f32.
use candle_amp::{autocast, Tensor, F32};
use candle_core::D;

#[autocast(fp16)]
fn attention(q: &Tensor<F32>, k: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let scores = q.matmul(&k.t()?)?;
    Ok(candle_nn::ops::softmax(&scores, D::Minus1)?)
}

fn main() {}
