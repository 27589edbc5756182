//! A `&mut self` module (a KV cache) called from a `&self` method: Rust's own borrow error,
//! as without the macro, with its fix-it (`&mut self` in the caller).
use candle_amp::{autocast, Tensor, F32};
use candle_core::Result;

struct Cached {
    steps: usize,
}

#[autocast]
impl Cached {
    fn forward(&mut self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.steps += 1;
        Ok(x.relu()?)
    }
}

struct Model {
    cached: Cached,
}

#[autocast(fp16)]
impl Model {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok(self.cached.forward(x)?)
    }
}

fn main() {}
