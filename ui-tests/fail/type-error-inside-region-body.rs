use candle_amp::{autocast, Tensor, F32};

#[autocast(fp16)]
fn forward(x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let h = x.relu()?;
    Ok(h.reshape("four by four")?)
}

fn main() {}
