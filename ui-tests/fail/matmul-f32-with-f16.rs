use candle_amp::{Tensor, F16, F32};

fn project(x: &Tensor<F32>, w: &Tensor<F16>) -> candle_core::Result<()> {
    let _ = x.matmul(w)?;
    Ok(())
}

fn main() {}
