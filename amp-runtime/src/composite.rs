//! Ops composed of candle ops, in the dtype of their first input (other inputs are converted
//! to it). `fp32::*` calls them on f32 inputs; an autocast region calls them in whatever dtype
//! its policy assigns (f32 unless a policy moves the op). All are differentiable.

use candle_core::{DType, Result, Tensor, D};

use crate::cast::convert;
use crate::kernels::custom_grad::with_gradient;
use crate::kernels::reduce;

/// Softmax along `dim`, in f32 from an f32, f16 or bf16 input: over the last dimension one
/// fused op (`kernels::softmax_last_dim`, which reads half inputs as they are), otherwise
/// candle-nn's max-shifted composition on an f32 copy.
pub(crate) fn softmax_f32<Di: candle_core::shape::Dim>(x: &Tensor, dim: Di) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "softmax")?;
    if x.elem_count() == 0 {
        // Nothing to normalise: an empty f32 result, as PyTorch's (candle's reduce fails).
        return convert(x, DType::F32);
    }
    if dim + 1 == x.rank() {
        crate::kernels::softmax_last_dim(x)
    } else {
        candle_nn::ops::softmax(&convert(x, DType::F32)?, dim)
    }
}

/// Log-softmax along `dim` in f32, as [`softmax_f32`] (`kernels::log_softmax_last_dim` over the
/// last dimension).
pub(crate) fn log_softmax_f32<Di: candle_core::shape::Dim>(x: &Tensor, dim: Di) -> Result<Tensor> {
    let dim = dim.to_index(x.shape(), "log_softmax")?;
    if x.elem_count() == 0 {
        return convert(x, DType::F32);
    }
    if dim + 1 == x.rank() {
        crate::kernels::log_softmax_last_dim(x)
    } else {
        candle_nn::ops::log_softmax(&convert(x, DType::F32)?, dim)
    }
}

/// Cross-entropy of logits `(batch, classes)` at class ids `(batch)` in f32, candle-nn's
/// `nll(log_softmax(x, 1))` with the fused log-softmax (reading half logits as they are).
pub(crate) fn cross_entropy_f32(x: &Tensor, target: &Tensor) -> Result<Tensor> {
    let target = class_ids("cross_entropy", x, target)?;
    mean_picked(&log_softmax_f32(x, 1)?, &target)
}

/// candle-nn's `nll` of checked ids: minus the mean of each row's value at its id, the sum
/// accumulated in f64 across runs (candle's f32 sum made the cross-entropy of 2^20 rows of
/// `ln 4` 1.38663).
fn mean_picked(logp: &Tensor, ids: &Tensor) -> Result<Tensor> {
    let picked = logp.gather(&ids.unsqueeze(1)?, 1)?;
    // No row: `-1 / 0` times a sum of nothing, NaN as candle-nn's and PyTorch's.
    #[allow(clippy::cast_precision_loss)] // a row count
    let scale = -1.0 / logp.dim(0)? as f64;
    crate::kernels::affine(&reduce::sum_all(&picked)?, scale, 0.0)
}

/// candle-nn's `nll` of log-probabilities `(batch, classes)` at class ids `(batch)`, the ids
/// checked and widened first ([`class_ids`]); the log-probabilities contiguous for candle's
/// gather, which refuses a view (a transposed or broadcast one) with an error naming an op the
/// user did not call.
pub(crate) fn nll(logp: &Tensor, target: &Tensor) -> Result<Tensor> {
    let target = class_ids("nll", logp, target)?;
    mean_picked(&logp.contiguous()?, &target)
}

/// Class ids as PyTorch checks them, ready for candle's gather: `x` is `(batch, classes)`, the
/// target one integer id per row, each in `0..classes` (candle's gather reported a negative id
/// as index 18446744073709551615, and f32 ids as a dtype its gather lacks), the range read on
/// the CPU only ([`crate::kernels::id_outside`]); returned contiguous, `u8` ids as `u32`
/// (candle's gather gives 0 for a `u8` 255, a valid class: [`crate::kernels::candle_ids`]).
pub(crate) fn class_ids(op: &str, x: &Tensor, target: &Tensor) -> Result<Tensor> {
    let (_, classes) = class_id_shapes(op, x, target)?;
    if let Some(bad) = crate::kernels::id_outside(target, classes)? {
        candle_core::bail!(
            "{op}: class ids must be in 0..{classes}, got {bad}{}",
            ignored_hint(bad)
        )
    }
    crate::kernels::candle_ids(&target.contiguous()?)
}

/// What to add to a class-id error on `bad`: PyTorch's `cross_entropy` and `nll_loss` skip
/// targets of -100 by default (`ignore_index`), the padding of PyTorch and Hugging Face data;
/// here that is an option to ask for.
fn ignored_hint(bad: i64) -> &'static str {
    if bad == -100 {
        " (-100 is PyTorch's default `ignore_index`: to skip those rows, call \
         `loss::cross_entropy_with(logits, target, &CrossEntropy { ignore_index: Some(-100), \
         ..Default::default() })`)"
    } else {
        ""
    }
}

/// `x` is `(batch, classes)` and the target one integer id per row: `(batch, classes)`.
fn class_id_shapes(op: &str, x: &Tensor, target: &Tensor) -> Result<(usize, usize)> {
    let (n, classes) = x.dims2().map_err(|_| {
        candle_core::Error::Msg(format!("{op} expects (batch, classes), got {:?}", x.dims()))
    })?;
    if target.dims() != [n] || target.dtype().is_float() {
        candle_core::bail!(
            "{op}: the target is {n} integer class ids, got {:?} {:?}",
            target.dtype(),
            target.dims()
        )
    }
    Ok((n, classes))
}

/// `x ^ y` elementwise (same shapes) with the values of PyTorch's (IEEE) `pow` where candle's
/// `exp(y * ln x)` gives NaN (off the CPU; on it `kernels::pow`, exact and with PyTorch's
/// gradients): a negative base with an integer exponent (`(-2)^3 = -8`), `x^0 = 1`
/// for every `x` (0, inf and NaN included) and `1^y = 1`. A negative base with a non-integer
/// exponent stays NaN. The magnitude is candle's composition on `|x|`, so the gradients are
/// its, signed by the base for odd exponents.
pub(crate) fn pow(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    if x.dims() != y.dims() {
        candle_core::bail!(
            "pow: the base {:?} and the exponent {:?} must have one shape (broadcast_pow \
             broadcasts)",
            x.dims(),
            y.dims()
        )
    }
    if !(x.dtype().is_float() && y.dtype().is_float()) {
        // candle's `log` of an integer tensor is a `todo!` (a panic).
        candle_core::bail!(
            "pow: float tensors only, got {:?} and {:?} (cast them first)",
            x.dtype(),
            y.dtype()
        )
    }
    // On CPU one op with PyTorch's values and gradients (`kernels::pow`); elsewhere the
    // composition below, with PyTorch's gradient formulas attached (the composition's own is
    // NaN at a zero base: `0 * inf`).
    match crate::kernels::pow(x, y)? {
        Some(z) => Ok(z),
        None => pow_with_gradients(x, y),
    }
}

/// [`pow_composed`]'s values with PyTorch's gradients of `pow` attached.
fn pow_with_gradients(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let (base, exponent) = (x.detach(), y.detach());
    let value = pow_composed(&base, &exponent)?;
    let y_value = value.clone();
    // d/dx = y * x^(y - 1), 0 where y is 0.
    let exponent_x = exponent.clone();
    let z = with_gradient(x, value, move |x, grad| {
        let x = x.detach();
        let slope = (&exponent_x * pow_composed(&x, &(&exponent_x - 1.0)?)?)?;
        let slope = exponent_x
            .eq(0.0)?
            .where_cond(&slope.zeros_like()?, &slope)?;
        grad.mul(&slope)
    })?;
    // d/dy = x^y * ln x, 0 where x is 0 and y >= 0.
    with_gradient(y, z, move |y, grad| {
        let slope = (&y_value * base.log()?)?;
        let flat = base.eq(0.0)?.minimum(&y.detach().ge(0.0)?)?;
        grad.mul(&flat.where_cond(&slope.zeros_like()?, &slope)?)
    })
}

/// The values of [`pow`] composed of candle's ops (any device), `x` and `y` of one float shape.
pub(crate) fn pow_composed(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let magnitude = (y * x.abs()?.log()?)?.exp()?;
    let negative = x.lt(0.0)?;
    let integer = y.eq(&y.round()?)?;
    let half = (y * 0.5)?;
    let odd = (half.ne(&half.floor()?)? * &integer)?;
    let signed = (&negative * odd)?.where_cond(&magnitude.neg()?, &magnitude)?;
    let undefined = (&negative * integer.eq(0u8)?)?;
    let value = undefined.where_cond(&magnitude.affine(0.0, f64::NAN)?, &signed)?;
    let one = y.eq(0.0)?.maximum(&x.eq(1.0)?)?;
    one.where_cond(&value.ones_like()?, &value)
}

/// [`pow`] with the operands broadcast to a common shape first.
pub(crate) fn broadcast_pow(x: &Tensor, y: &Tensor) -> Result<Tensor> {
    let shape = x
        .shape()
        .broadcast_shape_binary_op(y.shape(), "broadcast_pow")?;
    pow(&x.broadcast_as(&shape)?, &y.broadcast_as(&shape)?)
}

/// `log(sum(exp(x)))` over `dims`, stably: candle's (shifted by the maximum) but, as PyTorch,
/// shifted by 0 where the maximum is infinite, so that a slice of `-inf` gives `-inf` and one
/// holding `+inf` gives `+inf` (candle's `-inf - -inf` and `inf - inf` made both NaN).
pub(crate) fn log_sum_exp<D: candle_core::shape::Dims>(x: &Tensor, dims: D) -> Result<Tensor> {
    let dims = dims.to_indexes(x.shape(), "log_sum_exp")?;
    let Some((&first, rest)) = dims.split_first() else {
        return Ok(x.clone());
    };
    if x.elem_count() == 0 {
        // The log of an empty sum, -inf, as PyTorch (candle's maximum fails on nothing).
        let kept: Vec<usize> = (0..x.rank())
            .filter(|d| !dims.contains(d))
            .map(|d| x.dims()[d])
            .collect();
        return Tensor::full(f32::NEG_INFINITY, kept, x.device())?.to_dtype(x.dtype());
    }
    // The shift cancels from the value and its gradient: no graph through it.
    let max = rest
        .iter()
        .try_fold(x.max_keepdim(first)?, |max, &dim| max.max_keepdim(dim))?
        .detach();
    let shift = max
        .abs()?
        .eq(f64::INFINITY)?
        .where_cond(&max.zeros_like()?, &max)?;
    let sum = x.broadcast_sub(&shift)?.exp()?.sum(dims.as_slice())?;
    sum.log()? + shift.reshape(sum.shape())?
}

/// PyTorch's `F.cross_entropy` options: class weights `(classes)`, a class id whose rows are
/// ignored (PyTorch's default is -100; `None` ignores none), and label smoothing in `[0, 1]`.
#[derive(Clone, Debug, Default)]
pub struct CrossEntropy {
    /// A weight per class (f32 or any float dtype, read in f32).
    pub weight: Option<Tensor>,
    /// Rows whose class id is this one take no part (nor in the mean's denominator).
    pub ignore_index: Option<i64>,
    /// Mixes the one-hot target with the uniform distribution: `(1 - s) * one_hot + s / C`.
    pub label_smoothing: f64,
}

/// Cross-entropy of logits `(batch, classes)` at class ids `(batch)` with PyTorch's options,
/// mean reduction, in f32: `((1 - s) * sum_i w[y_i] * -log p_i[y_i] + s / C * sum_i sum_c
/// w[c] * -log p_i[c]) / sum_i w[y_i]` over the rows not ignored (`w` = 1 without weights),
/// PyTorch's loss: both terms over the same rows (PyTorch 2.15 agrees with and without
/// ignored rows).
pub(crate) fn cross_entropy_with_f32(
    x: &Tensor,
    target: &Tensor,
    o: &CrossEntropy,
) -> Result<Tensor> {
    let (n, classes) = class_id_shapes("cross_entropy", x, target)?;
    if n == 0 {
        candle_core::bail!(
            "cross_entropy: an empty batch has no row to average: its mean is undefined, where \
             PyTorch returns NaN"
        );
    }
    if !(0.0..=1.0).contains(&o.label_smoothing) {
        candle_core::bail!(
            "cross_entropy: label_smoothing must be in [0, 1], got {}",
            o.label_smoothing
        )
    }
    let ids = target.to_dtype(DType::I64)?;
    let kept = match o.ignore_index {
        Some(ignored) => ids.ne(ignored)?,
        None => Tensor::ones(n, DType::U8, x.device())?,
    };
    let valid = kept.to_dtype(DType::F32)?;
    // Ignored rows read class 0 (their terms are zeroed by `valid`).
    let safe = kept.where_cond(&ids, &ids.zeros_like()?)?;
    let max_id = safe.max_all()?.to_scalar::<i64>()?;
    let min_id = safe.min_all()?.to_scalar::<i64>()?;
    if min_id < 0 || max_id >= classes as i64 {
        candle_core::bail!(
            "cross_entropy: class ids must be in 0..{classes}, got {min_id}..={max_id}{}",
            ignored_hint(min_id)
        )
    }
    // Ignored rows take no part, not even through the log-softmax's backward: a padded row of
    // `-inf` logits has NaN log-probabilities, whose backward is NaN even under a zero gradient.
    let logp = match o.ignore_index {
        Some(_) => {
            let rows = kept.unsqueeze(1)?.broadcast_as(x.shape())?;
            log_softmax_f32(&rows.where_cond(x, &x.zeros_like()?)?, 1)?
        }
        None => log_softmax_f32(x, 1)?,
    };
    let weight = match &o.weight {
        Some(w) if w.dims() == [classes] => {
            // `index_select` below reads it contiguous (a view of another tensor is fine).
            let w = convert(w, DType::F32)?.contiguous()?;
            if w.to_vec1::<f32>()?.iter().any(|v| !v.is_finite()) {
                candle_core::bail!("cross_entropy: the class weights must be finite, got {w}");
            }
            w
        }
        Some(w) => candle_core::bail!(
            "cross_entropy: weight must be ({classes}), got {:?}",
            w.dims()
        ),
        None => Tensor::ones(classes, DType::F32, x.device())?,
    };
    let safe = safe.to_dtype(DType::U32)?;
    let w_y = (weight.index_select(&safe, 0)? * &valid)?;
    let picked = logp.gather(&safe.unsqueeze(1)?, 1)?.squeeze(1)?;
    // A term whose weight is 0 (an ignored row, a class weighted 0) is 0, not `0 * -inf` = NaN
    // where its log-probability is `-inf`; and a part whose coefficient is 0 is left out.
    let weighted = |w: &Tensor, logp: &Tensor| -> Result<Tensor> {
        let w = w.broadcast_as(logp.shape())?;
        w.ne(0.0)?.where_cond(&(logp * &w)?, &w.zeros_like()?)
    };
    let nll = reduce::sum_all(&weighted(&w_y, &picked)?)?.neg()?;
    let s = o.label_smoothing;
    let smooth = || -> Result<Tensor> {
        let w = weight.unsqueeze(0)?.broadcast_mul(&valid.unsqueeze(1)?)?;
        reduce::sum_all(&weighted(&w, &logp)?)?.neg()
    };
    let loss = match s {
        0.0 => nll,
        1.0 => (smooth()? * (1.0 / classes as f64))?,
        s => ((nll * (1.0 - s))? + (smooth()? * (s / classes as f64))?)?,
    };
    let total = reduce::sum_all(&w_y)?;
    if total.to_scalar::<f32>()? == 0.0 {
        candle_core::bail!(
            "cross_entropy: the rows kept have a total class weight of 0 (every target is \
             ignore_index, or the weights of the classes present add up to 0): their mean is \
             undefined, where PyTorch returns NaN and training on it makes every weight NaN"
        );
    }
    loss.broadcast_div(&total)
}

/// `(x - mean) / sqrt(var + eps) * alpha + beta` over the last dimension (biased variance): in
/// f32 on CPU one fused op (`kernels::layer_norm`), otherwise composed.
pub(crate) fn layer_norm(
    x: &Tensor,
    alpha: &Tensor,
    beta: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    check_norm("layer_norm", x, alpha, beta, eps)?;
    if x.dtype() == DType::F32 {
        if let Some(y) = crate::kernels::layer_norm(x, alpha, beta, eps)? {
            return Ok(y);
        }
    }
    layer_norm_composed(x, alpha, beta, eps)
}

/// [`layer_norm`] in f32 from an f32, f16 or bf16 input: the fused op reads a half input as it
/// is (no f32 copy); elsewhere the composition on an f32 copy.
pub(crate) fn layer_norm_f32(
    x: &Tensor,
    alpha: &Tensor,
    beta: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    check_norm("layer_norm", x, alpha, beta, eps)?;
    match crate::kernels::layer_norm(x, alpha, beta, eps)? {
        Some(y) => Ok(y),
        None => layer_norm_composed(&convert(x, DType::F32)?, alpha, beta, eps),
    }
}

/// [`layer_norm`] from candle ops, in `x`'s dtype.
fn layer_norm_composed(
    x: &Tensor,
    alpha: &Tensor,
    beta: Option<&Tensor>,
    eps: f64,
) -> Result<Tensor> {
    let centered = x.broadcast_sub(&x.mean_keepdim(D::Minus1)?)?;
    let var = centered.sqr()?.mean_keepdim(D::Minus1)?;
    let y = centered
        .broadcast_div(&(var + eps)?.sqrt()?)?
        .broadcast_mul(&convert(alpha, x.dtype())?)?;
    match beta {
        Some(b) => y.broadcast_add(&convert(b, x.dtype())?),
        None => Ok(y),
    }
}

/// `x / sqrt(mean(x^2) + eps) * alpha` over the last dimension: in f32 on CPU and CUDA one
/// fused op (`kernels::layer_norm::rms_norm`), otherwise composed.
pub(crate) fn rms_norm(x: &Tensor, alpha: &Tensor, eps: f64) -> Result<Tensor> {
    check_norm("rms_norm", x, alpha, None, eps)?;
    if x.dtype() == DType::F32 {
        if let Some(y) = crate::kernels::layer_norm::rms_norm(x, alpha, eps)? {
            return Ok(y);
        }
    }
    let rms = (x.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?;
    x.broadcast_div(&rms)?
        .broadcast_mul(&convert(alpha, x.dtype())?)
}

/// [`rms_norm`] in f32 from an f32, f16 or bf16 input: the fused op reads a half input as it
/// is (no f32 copy); elsewhere the composition on an f32 copy.
pub(crate) fn rms_norm_f32(x: &Tensor, alpha: &Tensor, eps: f64) -> Result<Tensor> {
    check_norm("rms_norm", x, alpha, None, eps)?;
    match crate::kernels::layer_norm::rms_norm(x, alpha, eps)? {
        Some(y) => Ok(y),
        None => rms_norm(&convert(x, DType::F32)?, alpha, eps),
    }
}

/// Group normalisation of `x` `(batch, channels, ..)` in `x`'s dtype (f32 from the fp32
/// class): the mean and biased variance over each group of `channels / groups` channels and
/// all positions, then the per-channel scale and shift (PyTorch's `F.group_norm`).
pub(crate) fn group_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    groups: usize,
    eps: f64,
) -> Result<Tensor> {
    check_eps("group_norm", eps)?;
    check_float_input("group_norm", x)?;
    let dims = x.dims();
    if dims.len() < 2 || dims[1] != weight.elem_count() || !dims[1].is_multiple_of(groups) {
        candle_core::bail!(
            "group_norm: input {dims:?} needs (batch, {}, ..) channels in {groups} groups",
            weight.elem_count()
        )
    }
    if x.elem_count() == 0 {
        // An empty batch normalises to an empty output, as in PyTorch.
        return Ok(x.clone());
    }
    // PyTorch's check (`F.group_norm`): a batch of one sample whose groups hold one value each
    // has no variance to take; every output would be the shift.
    if x.elem_count() / groups == 1 {
        candle_core::bail!(
            "group_norm: input {dims:?} in {groups} groups holds one value per group (PyTorch: \
             \"Expected more than 1 value per channel\"): fewer groups, or a larger input"
        )
    }
    let grouped = x.reshape((dims[0], groups, ()))?;
    let mean = grouped.mean_keepdim(D::Minus1)?;
    let centred = grouped.broadcast_sub(&mean)?;
    let var = centred.sqr()?.mean_keepdim(D::Minus1)?;
    // A group of finite values whose variance overflows (deviations near 3e38, from bf16
    // activations) has an infinite `var`: `x / sqrt(inf)` would be 0, every output the shift,
    // finite, and unseen by the gradient scaler. `var * 0` is NaN there (0 otherwise, an exact
    // no-op), so the group comes out NaN, as PyTorch's does; a pass over the statistics only.
    let deviation = ((&var + eps)?.sqrt()? + (&var * 0.0)?)?;
    let normed = centred.broadcast_div(&deviation)?.reshape(dims)?;
    let mut shape = vec![1; dims.len()];
    shape[1] = dims[1];
    normed
        .broadcast_mul(&convert(weight, x.dtype())?.reshape(shape.as_slice())?)?
        .broadcast_add(&convert(bias, x.dtype())?.reshape(shape.as_slice())?)
}

/// A norm over the last dimension: `eps` as [`check_eps`], and a scale (and shift) of one value
/// per element of that dimension, named in the error (candle's would name `broadcast_mul`).
fn check_norm(op: &str, x: &Tensor, alpha: &Tensor, beta: Option<&Tensor>, eps: f64) -> Result<()> {
    check_eps(op, eps)?;
    check_float_input(op, x)?;
    let Some(&width) = x.dims().last() else {
        candle_core::bail!("{op}: normalises over the input's last dimension; a scalar has none")
    };
    for (name, t) in [("scale", Some(alpha)), ("shift", beta)] {
        if let Some(t) = t.filter(|t| t.elem_count() != width) {
            candle_core::bail!(
                "{op}: the input {:?} is normalised over its last dimension ({width} values), \
                 but the {name} has shape {:?}",
                x.dims(),
                t.dims()
            );
        }
    }
    Ok(())
}

/// A normalisation's input is a float tensor (an integer one made candle panic in group norm,
/// and layer norm return zeros).
fn check_float_input(op: &str, x: &Tensor) -> Result<()> {
    if x.dtype().is_float() {
        Ok(())
    } else {
        candle_core::bail!(
            "{op}: the input must be a float tensor, got {:?}",
            x.dtype()
        )
    }
}

/// A normalisation's `eps` must be finite and positive: a negative one makes the variance plus
/// `eps` negative (NaN outputs), zero divides a constant row by zero, NaN poisons every output.
/// Every norm (layer, RMS, batch), whichever way it is reached, checks it here.
pub(crate) fn check_eps(op: &str, eps: f64) -> Result<()> {
    if eps.is_finite() && eps > 0.0 {
        Ok(())
    } else {
        candle_core::bail!("{op}: eps must be finite and positive, got {eps}")
    }
}

/// A pointwise loss's prediction and target have one shape: PyTorch broadcasts other shapes
/// with a warning (a `(n, 1)` prediction against an `(n)` target becomes an `(n, n)` loss, a
/// common silent bug); here it is an error naming the loss, not candle's `sub`.
fn check_same_shape(op: &str, inp: &Tensor, target: &Tensor) -> Result<()> {
    if inp.dims() == target.dims() {
        Ok(())
    } else {
        candle_core::bail!(
            "{op}: the prediction {:?} and the target {:?} must have one shape",
            inp.dims(),
            target.dims()
        )
    }
}

fn diff(op: &str, inp: &Tensor, target: &Tensor) -> Result<Tensor> {
    check_same_shape(op, inp, target)?;
    inp - convert(target, inp.dtype())?
}

pub(crate) fn mse(inp: &Tensor, target: &Tensor) -> Result<Tensor> {
    reduce::mean_all(&diff("mse", inp, target)?.sqr()?)
}

/// [`mse`] in f32 from f32, f16 or bf16 operands: one fused op on CPU that reads them as they
/// are (`kernels::mse`), otherwise the composition on an f32 copy of the prediction.
pub(crate) fn mse_f32(inp: &Tensor, target: &Tensor) -> Result<Tensor> {
    check_same_shape("mse", inp, target)?;
    match crate::kernels::mse(inp, target)? {
        Some(loss) => Ok(loss),
        None => mse(&convert(inp, DType::F32)?, target),
    }
}

/// The mean absolute error, `|d|` as `relu(d) + relu(-d)`: the same values, and the gradient
/// 0 where a prediction equals its target (PyTorch's `sign(0) = 0`; candle's `abs` gives 1).
pub(crate) fn l1(inp: &Tensor, target: &Tensor) -> Result<Tensor> {
    let d = diff("l1", inp, target)?;
    reduce::mean_all(&(crate::kernels::relu(&d)? + crate::kernels::relu(&d.neg()?)?)?)
}

/// `0.5 d^2 / beta` where `|d| < beta`, `|d| - 0.5 beta` elsewhere, averaged; L1 at `beta = 0`.
pub(crate) fn smooth_l1(inp: &Tensor, target: &Tensor, beta: f64) -> Result<Tensor> {
    if beta < 0.0 || !beta.is_finite() {
        candle_core::bail!("smooth_l1: beta must be finite and >= 0, got {beta}")
    }
    // L1 at beta = 0, and wherever the quadratic part's `0.5 / beta` overflows f32 (beta below
    // about 2.9e-39: the part is then 0 for every |d| below beta, and its gradient 0 * inf).
    if !((0.5 / beta) as f32).is_finite() {
        return l1(inp, target);
    }
    let d = crate::kernels::extrema::abs(&diff("smooth_l1", inp, target)?)?;
    // The quadratic part reads |d| capped at beta: where it is not taken (an infinite |d|
    // among them) its zero gradient meets a finite slope, not `2 * inf * 0` = NaN.
    let quadratic = (d.minimum(beta)?.sqr()? * (0.5 / beta))?;
    let linear = (&d - 0.5 * beta)?;
    reduce::mean_all(&d.lt(beta)?.where_cond(&quadratic, &linear)?)
}

/// `0.5 d^2` where `|d| < delta`, `delta (|d| - 0.5 delta)` elsewhere, averaged: PyTorch's
/// `huber_loss` (candle-nn's `loss::huber`), which refuses a `delta` that is not positive.
pub(crate) fn huber(inp: &Tensor, target: &Tensor, delta: f64) -> Result<Tensor> {
    if !(delta > 0.0 && delta.is_finite()) {
        candle_core::bail!("huber: delta must be finite and > 0 (as PyTorch's), got {delta}")
    }
    let d = crate::kernels::extrema::abs(&diff("huber", inp, target)?)?;
    // As in `smooth_l1`: the quadratic part reads |d| capped at delta.
    let quadratic = (d.minimum(delta)?.sqr()? * 0.5)?;
    let linear = crate::kernels::affine(&d, delta, -0.5 * delta * delta)?;
    reduce::mean_all(&d.lt(delta)?.where_cond(&quadratic, &linear)?)
}

/// `t * max(-x, 0) + (1 - t) * max(x, 0) + log(1 + exp(-|x|))`, averaged: PyTorch's loss,
/// each part left out where its coefficient is 0, so that an infinite logit gives the loss's
/// limit (`x = inf, t = 0` is inf and `x = inf, t = 1` is 0, where `max(x, 0) - x * t` is NaN).
/// The gradients are PyTorch's formulas, `sigmoid(x) - t` for the logit and `-x` for the
/// target, not the composition's (whose parts meet at kinks, and `0 * inf` at infinities).
pub(crate) fn binary_cross_entropy_with_logits(inp: &Tensor, target: &Tensor) -> Result<Tensor> {
    check_same_shape("binary_cross_entropy_with_logits", inp, target)?;
    let target = convert(target, inp.dtype())?;
    let (x, t) = (inp.detach(), target.detach());
    // log(1 + e) with e = exp(-|x|) <= 1, as log1p: where e < 1e-4, `1 + e` would lose e's
    // digits (a loss of 0 at x = 30, PyTorch's 9.4e-14), and `e - e^2 / 2` is exact to f32.
    let e = x.abs()?.neg()?.exp()?;
    let series = (&e - (e.sqr()? * 0.5)?)?;
    let log = crate::kernels::affine(&e, 1.0, 1.0)?.log()?;
    let softplus_neg_abs = e.lt(1e-4)?.where_cond(&series, &log)?;
    let zeros = x.zeros_like()?;
    let part = |coefficient: &Tensor, hinge: &Tensor| -> Result<Tensor> {
        let term = (coefficient * crate::kernels::relu(hinge)?)?;
        coefficient.ne(0.0)?.where_cond(&term, &zeros)
    };
    let one_minus_t = crate::kernels::affine(&t, -1.0, 1.0)?;
    let value = ((part(&t, &x.neg()?)? + part(&one_minus_t, &x)?)? + softplus_neg_abs)?;
    let kept_t = t.clone();
    let loss = with_gradient(inp, value, move |x, grad| {
        let sigmoid = crate::kernels::affine(&x.neg()?.exp()?, 1.0, 1.0)?.recip()?;
        grad.mul(&(sigmoid - &kept_t)?)
    })?;
    let loss = with_gradient(&target, loss, move |_, grad| grad.mul(&x.neg()?))?;
    reduce::mean_all(&loss)
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    /// The composition off the CPU (run here on CPU) against the CPU op (`kernels::pow`,
    /// PyTorch's values and gradients): the same values and both gradients, at zero and
    /// negative bases, integer, fractional, zero and negative exponents.
    #[test]
    fn the_composed_pow_has_the_cpu_op_s_gradients() -> Result<()> {
        let bases = [0f32, -0.0, 2.0, -2.0, 0.5, 3.0, 0.0, -1.5, 1.0];
        let exponents = [2f32, 0.0, 3.0, 3.0, -1.0, 0.5, -2.0, 2.0, 7.5];
        let run = |composed: bool| -> Result<Vec<Vec<f32>>> {
            let x = Var::new(&bases, &Device::Cpu)?;
            let y = Var::new(&exponents, &Device::Cpu)?;
            let z = if composed {
                pow_with_gradients(x.as_tensor(), y.as_tensor())?
            } else {
                pow(x.as_tensor(), y.as_tensor())?
            };
            let grads = z.sum_all()?.backward()?;
            Ok(vec![
                z.to_vec1()?,
                grads.get(&x).expect("dx").to_vec1()?,
                grads.get(&y).expect("dy").to_vec1()?,
            ])
        };
        let (got, want) = (run(true)?, run(false)?);
        for (what, (g, w)) in ["value", "dx", "dy"].iter().zip(got.iter().zip(&want)) {
            let close = g.iter().zip(w).all(|(g, w)| {
                (g.is_nan() && w.is_nan())
                    || g.to_bits() == w.to_bits()
                    || (g - w).abs() <= 1e-5 * w.abs().max(1.0)
            });
            assert!(close, "{what}: {g:?} vs {w:?}");
        }
        Ok(())
    }
}
