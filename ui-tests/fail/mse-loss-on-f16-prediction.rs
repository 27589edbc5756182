use candle_amp::nn::loss;
use candle_amp::{Tensor, F16, F32};

fn objective(pred: &Tensor<F16>, target: &Tensor<F32>) -> candle_core::Result<()> {
    let _ = loss::mse(pred, target)?;
    Ok(())
}

fn main() {}
