// A `policy!` with an error still declares its policy (with the default classes), so a region
// that names it reports nothing more.
use candle_amp::{autocast, Tensor, F32};

candle_amp::policy! {
    pub struct Attention: fp16 {
        softmax: half,
    }
}

#[autocast(policy = Attention)]
fn scores(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    Ok(x.matmul(&x)?)
}

fn main() {}
