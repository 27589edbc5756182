//! Maxima, minima and the argmax with PyTorch's NaN semantics over candle's ops.
//!
//! candle's reductions and elementwise extrema compare with `>`/`<`, which a NaN never wins:
//! `max_all([1, NaN, 0])` is 1 and `maximum([1], [NaN])` is 1, where PyTorch's answer is NaN
//! (and `argmax` the NaN's index). A NaN that vanishes in a maximum is a NaN the gradient
//! scaler or the user never sees, so every maximum and minimum of the typed API and of
//! regions goes through these: candle's result, with NaN where the reduced slice (or either
//! operand) held one. Integer tensors hold no NaN and take candle's op alone.

use candle_core::{Result, Tensor};

/// `reduced` (candle's extremum of `x`) with NaN wherever `nan_in`, the same reduction of
/// `x`'s NaN mask, is set.
fn with_nan(
    x: &Tensor,
    reduced: Tensor,
    nan_in: impl FnOnce(&Tensor) -> Result<Tensor>,
) -> Result<Tensor> {
    if !x.dtype().is_float() {
        return Ok(reduced);
    }
    let any = nan_in(&x.ne(x)?)?;
    any.where_cond(&reduced.affine(0.0, f64::NAN)?, &reduced)
}

/// The maximum over `dim`, kept as a size-1 dimension with `keepdim`.
pub(crate) fn max<D: candle_core::shape::Dim>(x: &Tensor, dim: D, keepdim: bool) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "max")?;
    if keepdim {
        with_nan(x, x.max_keepdim(dim)?, |m| m.max_keepdim(dim))
    } else {
        with_nan(x, x.max(dim)?, |m| m.max(dim))
    }
}

/// The minimum over `dim`, kept as a size-1 dimension with `keepdim`.
pub(crate) fn min<D: candle_core::shape::Dim>(x: &Tensor, dim: D, keepdim: bool) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "min")?;
    if keepdim {
        with_nan(x, x.min_keepdim(dim)?, |m| m.max_keepdim(dim))
    } else {
        with_nan(x, x.min(dim)?, |m| m.max(dim))
    }
}

/// The maximum of every element (rank 0).
pub(crate) fn max_all(x: &Tensor) -> Result<Tensor> {
    with_nan(x, x.max_all()?, Tensor::max_all)
}

/// The minimum of every element (rank 0).
pub(crate) fn min_all(x: &Tensor) -> Result<Tensor> {
    with_nan(x, x.min_all()?, Tensor::max_all)
}

/// The index of the maximum over `dim` (u32), the first NaN's where the slice holds one.
pub(crate) fn argmax<D: candle_core::shape::Dim>(x: &Tensor, dim: D) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "argmax")?;
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

fn either_nan(a: &Tensor, b: &Tensor, r: Tensor) -> Result<Tensor> {
    if !r.dtype().is_float() {
        return Ok(r);
    }
    let nan = a.ne(a)?.maximum(&b.ne(b)?)?;
    nan.where_cond(&r.affine(0.0, f64::NAN)?, &r)
}
