use candle_amp::{custom_fwd, Tensor, F32};

#[custom_fwd]
fn gelu_gate(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    x.gelu()?.mul(x)
}

fn main() {}
