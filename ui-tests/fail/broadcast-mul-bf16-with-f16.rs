use candle_amp::{Tensor, BF16, F16};

fn gate(x: &Tensor<BF16>, g: &Tensor<F16>) -> candle_core::Result<()> {
    let _ = x.broadcast_mul(g)?;
    Ok(())
}

fn main() {}
