use candle_amp::{keep_fp32, Tensor, F32};

struct Head;

#[keep_fp32(strict)]
impl Head {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        Ok(x.relu()?)
    }
}

fn main() {}
