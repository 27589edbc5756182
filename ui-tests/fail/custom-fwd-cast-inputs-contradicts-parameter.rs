use candle_amp::{custom_fwd, Tensor, F16};

#[custom_fwd(cast_inputs = f32)]
fn scale(x: &Tensor<F16>) -> candle_core::Result<Tensor<F16>> {
    x.affine(2.0, 0.0)
}

fn main() {}
