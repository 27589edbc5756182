//! Maxima, minima, the argmax, `clamp` and `abs` with PyTorch's values and gradients over
//! candle's ops.
//!
//! candle's reductions and elementwise extrema compare with `>`/`<`, which a NaN never wins:
//! `max_all([1, NaN, 0])` is 1 and `maximum([1], [NaN])` is 1, where PyTorch's answer is NaN
//! (and `argmax` the NaN's index). A NaN that vanishes in a maximum is a NaN the gradient
//! scaler or the user never sees, so every maximum and minimum of the typed API and of
//! regions goes through these: candle's result, with NaN where the reduced slice (or either
//! operand) held one. Integer tensors hold no NaN and take candle's op alone.
//!
//! Their gradients are PyTorch's too. candle's backward of a reduced maximum gives the whole
//! gradient to every element equal to it, so a tie of `k` elements passed `k` times the
//! gradient, and a slice holding a NaN passed none. Here a reduced extremum shares its gradient
//! evenly among the elements that attain it, as `torch.amax` and `torch.amin` do
//! (`torch.max(x, dim)`, which also returns indices, gives it all to one of them: another
//! subgradient of the same function). A slice holding a NaN has no derivative and gets NaN
//! gradients throughout, as with `torch.amax`, so that the gradient scaler skips the step
//! (`torch.max()` without a dim shares a finite gradient among the NaNs instead, which a
//! scaler steps on). An elementwise maximum splits a tie in halves (candle's rule and
//! PyTorch's) and, where either operand is NaN, passes the gradient to both, as PyTorch does.
//! `clamp` (a maximum and a minimum with constants) passes no gradient at its bounds and `abs`
//! none at 0, as PyTorch's; candle's halve it there and give ±1.

use candle_core::{DType, Result, Tensor};

use crate::kernels::custom_grad::with_gradient;

/// Which extremum a reduction takes.
#[derive(Clone, Copy)]
enum Extremum {
    Max,
    Min,
}

impl Extremum {
    fn name(self) -> &'static str {
        match self {
            Self::Max => "max",
            Self::Min => "min",
        }
    }

    /// candle's extremum of `x` over `dim`, kept as a size-1 dimension.
    fn candle(self, x: &Tensor, dim: usize) -> Result<Tensor> {
        match self {
            Self::Max => x.max_keepdim(dim),
            Self::Min => x.min_keepdim(dim),
        }
    }
}

/// The extremum of `x` over `dim`, kept as a size-1 dimension: candle's value with NaN where
/// the slice holds one, and the gradient shared among the elements that attain it (NaN
/// throughout a slice whose extremum is NaN).
fn reduce(x: &Tensor, dim: usize, which: Extremum) -> Result<Tensor> {
    if empty_elsewhere(x, dim, which.name())? {
        // No slice to reduce: the keepdim result is as empty, and its view of `x` keeps the
        // graph (`x` gets its zero gradient, as in PyTorch).
        return x.narrow(dim, 0, 1);
    }
    let value = which.candle(x, dim)?;
    if !x.dtype().is_float() {
        return Ok(value);
    }
    let any_nan = x.ne(x)?.max_keepdim(dim)?;
    let value = any_nan
        .where_cond(&value.affine(0.0, f64::NAN)?, &value)?
        .detach();
    let kept = value.clone();
    with_gradient(x, value, move |x, grad| {
        let nan = kept.ne(&kept)?;
        let attains = x.broadcast_eq(&kept)?.broadcast_maximum(&nan)?;
        let count = attains.to_dtype(DType::F32)?.sum_keepdim(dim)?;
        let share = grad.to_dtype(DType::F32)?.div(&count)?;
        let share = nan
            .where_cond(&share.affine(0.0, f64::NAN)?, &share)?
            .broadcast_as(x.shape())?;
        attains.where_cond(&share, &share.zeros_like()?)
    })
}

/// Whether `x` holds no element though its dimension `dim` does (an empty batch: the result
/// is as empty, where candle refuses any empty tensor); an error, as PyTorch's, when `dim`
/// itself is empty: there is no extremum of no value.
fn empty_elsewhere(x: &Tensor, dim: usize, op: &str) -> Result<bool> {
    if x.dim(dim)? == 0 {
        candle_core::bail!(
            "{op}: the reduced dimension {dim} of {:?} is empty (an extremum of no value)",
            x.dims()
        )
    }
    Ok(x.elem_count() == 0)
}

/// `|x|`, its gradient PyTorch's `sign(x) * grad`: 0 at 0, -0.0 and NaN, where candle's is 1
/// or -1 (`x >= 0`).
pub(crate) fn abs(x: &Tensor) -> Result<Tensor> {
    let value = x.detach().abs()?;
    if !x.dtype().is_float() {
        return Ok(value);
    }
    with_gradient(x, value, |x, grad| {
        let side = |m: Tensor| m.to_dtype(grad.dtype());
        grad.mul(&(side(x.gt(0.0)?)? - side(x.lt(0.0)?)?)?)
    })
}

/// `x` clamped to `[min, max]` (every value `max` where `min > max`, and NaN for a NaN bound, as
/// PyTorch's), NaN kept;
/// the gradient passes where `min < x < max` only, as PyTorch's `clamp` with scalar bounds
/// (candle's `maximum(min).minimum(max)` halves it at a bound, a tie with the constant).
pub(crate) fn clamp(x: &Tensor, min: f64, max: f64) -> Result<Tensor> {
    let plain = x.detach();
    if !x.dtype().is_float() {
        if min.is_nan() || max.is_nan() {
            candle_core::bail!(
                "clamp: a NaN bound ([{min}, {max}]) for {:?} values",
                x.dtype()
            )
        }
        return plain.clamp(min, max);
    }
    // A NaN bound makes every value NaN, as PyTorch's (candle's comparisons skip it).
    let value = if min.is_nan() || max.is_nan() {
        plain.affine(0.0, f64::NAN)?
    } else {
        let value = plain.clamp(min, max)?;
        plain.ne(&plain)?.where_cond(&plain, &value)?
    };
    with_gradient(x, value, move |x, grad| {
        let inside = x.gt(min)?.minimum(&x.lt(max)?)?;
        inside.where_cond(grad, &grad.zeros_like()?)
    })
}

/// The maximum over `dim`, kept as a size-1 dimension with `keepdim`.
pub(crate) fn max<D: candle_core::shape::Dim>(x: &Tensor, dim: D, keepdim: bool) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "max")?;
    kept(reduce(x, dim, Extremum::Max)?, dim, keepdim)
}

/// The minimum over `dim`, kept as a size-1 dimension with `keepdim`.
pub(crate) fn min<D: candle_core::shape::Dim>(x: &Tensor, dim: D, keepdim: bool) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "min")?;
    kept(reduce(x, dim, Extremum::Min)?, dim, keepdim)
}

fn kept(reduced: Tensor, dim: usize, keepdim: bool) -> Result<Tensor> {
    if keepdim {
        Ok(reduced)
    } else {
        reduced.squeeze(dim)
    }
}

/// The maximum of every element (rank 0).
pub(crate) fn max_all(x: &Tensor) -> Result<Tensor> {
    reduce(&x.flatten_all()?, 0, Extremum::Max)?.reshape(())
}

/// The minimum of every element (rank 0).
pub(crate) fn min_all(x: &Tensor) -> Result<Tensor> {
    reduce(&x.flatten_all()?, 0, Extremum::Min)?.reshape(())
}

/// The index of the maximum over `dim` (u32), the first NaN's where the slice holds one.
pub(crate) fn argmax<D: candle_core::shape::Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "argmax")?;
    if empty_elsewhere(x, dim, "argmax")? {
        let mut dims = x.dims().to_vec();
        dims.remove(dim);
        return Tensor::zeros(dims, DType::U32, x.device());
    }
    let index = x.argmax(dim)?;
    if !x.dtype().is_float() {
        return Ok(index);
    }
    let nan = x.ne(x)?;
    // candle's argmax takes the first of equal maxima: the first NaN of a slice holding one.
    nan.max(dim)?.where_cond(&nan.argmax(dim)?, &index)
}

/// The elementwise maximum (same shapes), NaN where either operand is.
pub(crate) fn maximum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    either_nan(a, b, a.maximum(b)?)
}

/// The elementwise minimum (same shapes), NaN where either operand is.
pub(crate) fn minimum(a: &Tensor, b: &Tensor) -> Result<Tensor> {
    either_nan(a, b, a.minimum(b)?)
}

/// `r` (candle's extremum of `a` and `b`) with `a + b` where either is NaN: a NaN whose
/// gradient reaches both operands.
fn either_nan(a: &Tensor, b: &Tensor, r: Tensor) -> Result<Tensor> {
    if !r.dtype().is_float() {
        return Ok(r);
    }
    let nan = a.ne(a)?.maximum(&b.ne(b)?)?;
    nan.where_cond(&(a + b)?, &r)
}
