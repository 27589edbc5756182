use candle_amp::custom_bwd;

#[custom_bwd]
fn bwd(grad: &candle_core::Tensor) -> candle_core::Result<Option<candle_core::Tensor>> {
    Ok(Some(grad.clone()))
}

fn main() {}
