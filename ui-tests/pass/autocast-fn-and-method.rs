//! `#[autocast]` on a free fn and on a single method of a plain impl.
use candle_amp::{autocast, ops, Tensor, F32};
use candle_core::{DType, Device};

#[autocast(bf16)]
fn attention_scores(q: &Tensor<F32>, k: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
    let scores = q.matmul(&k.t()?)?; // bf16
    Ok(ops::softmax(&scores, 1)?) // f32
}

struct Scaler {
    factor: f64,
}

impl Scaler {
    #[autocast(fp16)]
    fn apply(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
        Ok(x.matmul(&x.t()?)?.affine(self.factor, 0.0)?)
    }
}

fn main() -> candle_core::Result<()> {
    let x = Tensor::<F32>::ones((2, 3), &Device::Cpu)?;
    let p = attention_scores(&x, &x)?;
    assert_eq!(p.dtype(), DType::F32);
    assert_eq!(p.to_vec2::<f32>()?[0], vec![0.5, 0.5]);
    let y = Scaler { factor: 0.5 }.apply(&x)?;
    assert_eq!(y.to_vec2::<f32>()?[1], vec![1.5, 1.5]);
    Ok(())
}
