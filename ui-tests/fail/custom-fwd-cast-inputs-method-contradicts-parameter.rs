use candle_amp::{custom_fwd, Tensor, F16, F32};

struct Scale;

#[custom_fwd(cast_inputs = f32)]
impl Scale {
    fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        x.affine(2.0, 0.0)
    }

    fn half(&self, x: &Tensor<F16>) -> candle_core::Result<Tensor<F16>> {
        x.affine(0.5, 0.0)
    }
}

fn main() {}
