use candle_amp::{Tensor, F16};

// PyTorch's `square` is `pow(x, 2)`, fp32-class under autocast: an f16 square overflows from
// |x| = 256, so outside a region it needs `Tensor<F32>` (or `fp32::sqr`).
fn energy(h: &Tensor<F16>) -> candle_core::Result<()> {
    let _ = h.sqr()?;
    Ok(())
}

fn main() {}
