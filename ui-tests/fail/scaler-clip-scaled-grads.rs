//! Clipping scaled gradients clips at `max_norm * scale`, a classic PyTorch AMP bug: clipping
//! exists only on `UnscaledGrads`.
use candle_amp::{GradScaler, Tensor, F32};

fn iteration(scaler: &mut GradScaler, loss: &Tensor<F32>) -> candle_core::Result<()> {
    let mut grads = scaler.scale(loss)?.backward()?;
    grads.clip_grad_norm(1.0)?;
    Ok(())
}

fn main() {}
