use candle_amp::{autocast, Tensor, F16, F32};

fn helper(x: &Tensor<F16>) -> candle_core::Result<Tensor<F16>> {
    x.relu()
}

#[autocast(fp16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let h = x.matmul(&w)?;
    // A region value is not a typed tensor: cast it explicitly, e.g. `h.cast::<F16>()?`.
    Ok(helper(&h)?.cast::<F32>()?)
}

fn main() {}
