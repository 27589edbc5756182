//! PyTorch: "step() has already been called since the last update()".
use candle_amp::{GradScaler, Tensor, F32};
use candle_nn::SGD;

fn iteration(scaler: &mut GradScaler, opt: &mut SGD, loss: &Tensor<F32>) -> candle_core::Result<()> {
    let grads = scaler.unscale(scaler.scale(loss)?.backward()?)?;
    let _ = scaler.step(opt, grads)?;
    let _ = scaler.step(opt, grads)?;
    scaler.update()?;
    Ok(())
}

fn main() {}
