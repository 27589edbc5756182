//! PyTorch: "unscale_() has already been called on this optimizer since the last update()".
use candle_amp::{GradScaler, Tensor, F32};

fn iteration(scaler: &mut GradScaler, loss: &Tensor<F32>) -> candle_core::Result<()> {
    let grads = scaler.scale(loss)?.backward()?;
    let _first = scaler.unscale(grads)?;
    let _second = scaler.unscale(grads)?;
    Ok(())
}

fn main() {}
