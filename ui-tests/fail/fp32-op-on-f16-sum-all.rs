use candle_amp::{Tensor, F16};

fn total(x: &Tensor<F16>) -> candle_core::Result<()> {
    let _ = x.sum_all()?;
    Ok(())
}

fn main() {}
