// A map of tensors leaves a region as it is when each tensor is converted before it goes in.
use std::collections::HashMap;

use candle_amp::{autocast, RegionValue, Tensor, F32};
use candle_core::Result;

#[autocast(fp16)]
fn forward(x: &Tensor<F32>, w: &Tensor<F32>) -> Result<HashMap<String, Tensor<F32>>> {
    let h = x.matmul(w)?;
    let mut m = HashMap::new();
    m.insert("h".to_string(), h.cast::<F32>()?);
    Ok(m)
}

fn main() -> Result<()> {
    let dev = candle_core::Device::Cpu;
    let x = Tensor::<F32>::ones((2, 3), &dev)?;
    let w = Tensor::<F32>::ones((3, 4), &dev)?;
    let m = forward(&x, &w)?;
    assert_eq!(m["h"].to_vec2::<f32>()?, vec![vec![3f32; 4]; 2]);
    Ok(())
}
