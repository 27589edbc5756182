use candle_amp::{Tensor, F16};

fn softplus(x: &Tensor<F16>) -> candle_core::Result<()> {
    let _ = x.fp32_op(|t| (t.exp()? + 1.0)?.log())?;
    Ok(())
}

fn main() {}
