use candle_amp::{autocast, Tensor, F32};

// No #[autocast] on this impl: it cannot take region values.
struct Plain;

impl Plain {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        x.relu()
    }
}

struct Model {
    plain: Plain,
}

#[autocast(fp16)]
impl Model {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        Ok(self.plain.forward(&x)?)
    }
}

fn main() {}
