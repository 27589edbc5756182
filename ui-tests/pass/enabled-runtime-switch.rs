//! `enabled = expr` switches between the policy and plain f32 at run time, without if/else in
//! the body, like `torch.autocast(enabled=use_amp)`; `output = input` asserts that the result
//! leaves in the input's precision, as the signature says.
use candle_amp::{autocast, Tensor, F32};
use candle_core::Device;

#[autocast(fp16, enabled = use_amp, output = input)]
fn forward(x: &Tensor<F32>, use_amp: bool) -> candle_core::Result<Tensor<F32>> {
    Ok(x.matmul(&x.t()?)?)
}

fn main() -> candle_core::Result<()> {
    let x = Tensor::<F32>::new(&[[1.0f32, 1e-4]], &Device::Cpu)?;
    let exact = forward(&x, false)?.to_vec2::<f32>()?[0][0];
    let rounded = forward(&x, true)?.to_vec2::<f32>()?[0][0];
    assert_eq!(exact, 1.0 + 1e-8);
    assert_eq!(rounded, 1.0); // 1e-8 is below f16's resolution at 1.0
    Ok(())
}
