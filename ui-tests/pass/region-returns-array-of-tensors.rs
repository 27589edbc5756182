// Region values convert to the declared tensors inside tuples, `Option`s, `Vec`s, arrays and
// `Box`es.
use candle_amp::{autocast, Tensor, F32};
use candle_core::Result;

#[autocast(fp16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<[Tensor<F32>; 2]> {
    let h = x.matmul(w)?;
    Ok([h.clone(), h])
}

fn main() -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let ones = candle_core::Tensor::ones((2, 2), candle_core::DType::F32, &dev)?;
    let x = Tensor::<F32>::from_candle(ones)?;
    let [a, b] = forward(&x, &x)?;
    assert_eq!(a.to_flat_vec::<f32>()?, b.to_flat_vec::<f32>()?);
    Ok(())
}
