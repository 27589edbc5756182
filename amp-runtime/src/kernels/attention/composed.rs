//! The attention as candle ops, for any device and float dtype: what runs off the CPU, and
//! the composed reference of the tests.

use candle_core::{DType, Result, Tensor, D};

use super::{check_mask, Geometry};

/// The same attention as candle ops, for any device and float dtype: the products in the
/// operands' dtype (f32 accumulation where the backend has it), the scores widened to f32 (f64
/// for f64 operands) for the scale, the mask, the causal mask and the softmax, a row that sees
/// no key set to 0, then with `keep` (a `(b, h, t_q, t_k)` `u8` mask and the drop probability)
/// the dropped probabilities 0 and the kept ones scaled by `1 / (1 - p)`. Differentiable by
/// candle's backward.
pub(crate) fn composed(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    (mask, scale, causal): (Option<&Tensor>, f64, bool),
    keep: Option<(&Tensor, f32)>,
) -> Result<Tensor> {
    let g = Geometry::check(q, k, v)?;
    let dtype = q.dtype();
    let wide = crate::kernels::elem::wide(dtype);
    // Grouped-query attention: each key/value head repeated for the query heads that share it.
    let repeat = |t: &Tensor| -> Result<Tensor> {
        if g.group() == 1 {
            return Ok(t.clone());
        }
        let (b, hk, tk, d) = t.dims4()?;
        t.unsqueeze(2)?
            .broadcast_as((b, hk, g.group(), tk, d))?
            .reshape((b, hk * g.group(), tk, d))
    };
    // Contiguous operands: candle's CUDA matmul takes no head split's strided views.
    let (q, k, v) = (
        q.contiguous()?,
        repeat(k)?.contiguous()?,
        repeat(v)?.contiguous()?,
    );
    let scores = crate::kernels::matmul::matmul(&q, &k.t()?)?;
    let mut s = (scores.to_dtype(wide)? * scale)?;
    if let Some(mask) = mask {
        check_mask(mask, g)?;
        let additive = if mask.dtype() == DType::U8 {
            let zeros = Tensor::zeros(mask.shape(), wide, mask.device())?;
            let hidden =
                Tensor::full(f32::NEG_INFINITY, mask.shape(), mask.device())?.to_dtype(wide)?;
            mask.where_cond(&zeros, &hidden)?
        } else {
            mask.to_dtype(wide)?
        };
        s = s.broadcast_add(&additive)?;
    }
    if causal {
        let hidden: Vec<u8> = (0..g.tq)
            .flat_map(|i| (0..g.tk).map(move |j| u8::from(j + g.tq > i + g.tk)))
            .collect();
        let hidden = Tensor::from_vec(hidden, (g.tq, g.tk), q.device())?.broadcast_as(s.shape())?;
        let minus_inf = Tensor::full(f32::NEG_INFINITY, s.shape(), q.device())?.to_dtype(wide)?;
        s = hidden.where_cond(&minus_inf, &s)?;
    }
    // Rows that see no key: scores set to 0 (a finite softmax) and probabilities to 0.
    let live = s
        .max_keepdim(D::Minus1)?
        .ne(f64::NEG_INFINITY)?
        .broadcast_as(s.shape())?;
    let s = live.where_cond(&s, &s.zeros_like()?)?;
    let p = candle_nn::ops::softmax(&s, D::Minus1)?.mul(&live.to_dtype(wide)?)?;
    let p = match keep {
        Some((keep, drop)) => {
            crate::kernels::affine::masked_scale(&p, keep, 1.0 / (1.0 - f64::from(drop)))?
        }
        None => p,
    };
    crate::kernels::matmul::matmul(&p.to_dtype(dtype)?, &v)
}
