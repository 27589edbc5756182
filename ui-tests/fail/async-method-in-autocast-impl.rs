use candle_amp::{autocast, Tensor, F32};

struct Model {
    w: Tensor<F32>,
}

#[autocast(bf16)]
impl Model {
    pub async fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        x.matmul(&self.w)
    }
}

fn main() {}
