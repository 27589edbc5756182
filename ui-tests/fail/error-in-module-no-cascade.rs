// One error in a module's #[autocast] impl is reported once: the module keeps a stand-in
// `RegionCall` impl, so `Model`, which calls it from its own region, adds no error of its own.
use candle_amp::{autocast, Tensor, F32};

struct Block;

#[autocast]
impl Block {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        let y = x.relu()?;
        y.as_candle().backward()?;
        Ok(y)
    }
}

struct Model {
    block: Block,
}

#[autocast(fp16)]
impl Model {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        Ok(self.block.forward(&x)?)
    }
}

fn main() {}
