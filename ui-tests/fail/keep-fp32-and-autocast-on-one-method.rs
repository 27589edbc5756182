use candle_amp::{autocast, Tensor, F32};

struct Head;

#[autocast(fp16)]
impl Head {
    #[keep_fp32]
    #[autocast(bf16)]
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        Ok(x.relu()?)
    }
}

fn main() {}
