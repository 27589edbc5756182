use candle_amp::{keep_fp32, Tensor, F32};

#[keep_fp32]
fn softmax_in_f32(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    candle_amp::ops::softmax(x, 1)
}

fn main() {}
