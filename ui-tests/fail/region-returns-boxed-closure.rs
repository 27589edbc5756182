// A boxed closure leaves a region as `Box<dyn Fn ..>` only once coerced where it is built: the
// note names the `as Box<dyn Fn(..)>` that does it.
use candle_amp::autocast;
use candle_core::{Result, Tensor};

type Projection = Box<dyn Fn(&Tensor) -> Result<Tensor>>;

#[autocast(bf16)]
fn projection(w: &candle_core::Tensor) -> Result<Projection> {
    let w = w.clone();
    Ok(Box::new(move |t: &candle_core::Tensor| t.matmul(&w)))
}

fn main() {}
