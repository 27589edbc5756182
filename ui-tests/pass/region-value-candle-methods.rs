//! A region value answers candle's tensor methods with candle's names and arguments: shape
//! accessors, indexing, views, joins, broadcasting ops and comparisons, activations, scalars on
//! either side of `+ - * /` and results chained as candle chains them, `to_dtype`; typed tensors outside a region the same where the op's
//! class allows.
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, IndexOp, Result, D};

#[autocast(bf16)]
fn attention_like(x: &Tensor<F32>, mask: &candle_core::Tensor) -> Result<Tensor<F32>> {
    let (b, t, c) = x.dims3()?;
    assert_eq!((x.dim(D::Minus1)?, x.rank(), x.elem_count()), (c, 3, b * t * c));
    assert_eq!(x.shape().dims(), &[b, t, c]);
    let _ = x.device();
    let q = x.matmul(&x.transpose(1, 2)?)?; // (b, t, t), bf16
    let (_, _, _, _) = q.unsqueeze(1)?.dims4()?;
    let (_, _, _, _, _) = q.unsqueeze(1)?.unsqueeze(1)?.dims5()?;
    let _ = q.i((.., 0))?.dims2()?;
    let _ = q.flatten_all()?.dims1()?;
    let q = ((q / 8.0)? - 1.0)?;
    let q = (2.0 * ((1.0 + q)? * 0.5)?)?;
    let hidden = (q.ones_like()? * -1e4)?;
    let q = mask.broadcast_as(q.shape())?.where_cond(&q, &hidden)?;
    let keep = q.broadcast_gt(&q.zeros_like()?)?;
    let q = keep.where_cond(&q, &q.zeros_like()?)?;
    let q = q.broadcast_maximum(&q.narrow(2, 0, 1)?)?.clamp(-10.0, 10.0)?;
    let parts = q.chunk(t, 2)?;
    let joined = Tensor::cat(&parts, 2)?;
    let stacked = Tensor::stack(&[&joined, &joined], 0)?.narrow(0, 0, 1)?.squeeze(0)?;
    let acts = (stacked.gelu()? + stacked.gelu_erf()? + stacked.silu()? + stacked.relu()?)?;
    let acts = (acts.tanh()? + acts.sqr()?.sqrt()? + acts.exp()?.powf(0.5)?)?;
    let acts = acts.permute((0, 2, 1))?.contiguous()?.reshape((b, t, t))?.t()?;
    let out = acts.broadcast_matmul(&x)?.broadcast_sub(&x.mean_keepdim(2)?)?;
    assert_eq!(out.to_dtype(DType::F32)?.dtype(), DType::F32);
    Ok(out)
}

fn main() -> Result<()> {
    let x = Tensor::<F32>::ones((2, 3, 4), &Device::Cpu)?;
    let mask = candle_core::Tensor::ones((3, 3), DType::U8, &Device::Cpu)?;
    assert_eq!(attention_like(&x, &mask)?.dims(), &[2, 3, 4]);
    // Outside a region, typed tensors where the class allows it.
    let y = (((&x / 8.0)? - 1.0)? * 2.0)?;
    let m = y.broadcast_maximum(&y.narrow(2, 0, 1)?)?.broadcast_lt(&x)?;
    assert_eq!(m.dtype(), DType::U8);
    let _ = y.gelu()?.clamp(0.0, 1.0)?.unsqueeze(0)?.squeeze(0)?.dims3()?;
    Ok(())
}
