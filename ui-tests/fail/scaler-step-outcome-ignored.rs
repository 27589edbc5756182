//! A skipped step must not go unnoticed: `StepOutcome` is `#[must_use]`.
#![deny(unused_must_use)]
use candle_amp::{GradScaler, Tensor, F32};
use candle_nn::SGD;

fn iteration(scaler: &mut GradScaler, opt: &mut SGD, loss: &Tensor<F32>) -> candle_core::Result<()> {
    let grads = scaler.scale(loss)?.backward()?;
    scaler.step(opt, grads)?;
    scaler.update()?;
    Ok(())
}

fn main() {}
