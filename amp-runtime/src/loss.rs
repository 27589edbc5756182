//! Losses, typed: same names and argument order as `candle_nn::loss`.
//!
//! Every loss is an fp32-class op (PyTorch's autocast runs all losses in f32): outside an
//! autocast region the prediction is `Tensor<F32>`; the half-input forms are in [`crate::fp32`].
//! Targets of classification losses are integer class ids, passed as plain candle tensors.
//!
//! Binary cross-entropy on probabilities is absent on purpose: PyTorch bans it under fp16
//! autocast as unsafe; use [`binary_cross_entropy_with_logits`].

use candle_core::Result;

use crate::fp32;
use crate::op::{self, Fp32Input};
use crate::precision::F32;
use crate::region::free::{self, typed_or_followed};
use crate::tensor::Tensor;

/// Mean squared error.
pub fn mse<P: Fp32Input<op::mse>>(inp: &Tensor<P>, target: &Tensor<F32>) -> Result<Tensor<F32>> {
    typed_or_followed(|| free::mse(inp, target), || fp32::mse(inp, target))
}

/// Mean absolute error (PyTorch's `l1_loss`).
pub fn l1<P: Fp32Input<op::l1>>(inp: &Tensor<P>, target: &Tensor<F32>) -> Result<Tensor<F32>> {
    typed_or_followed(|| free::l1(inp, target), || fp32::l1(inp, target))
}

/// Smooth L1 loss with threshold `beta` (PyTorch's `smooth_l1_loss`, default `beta = 1.0`).
pub fn smooth_l1<P: Fp32Input<op::smooth_l1>>(
    inp: &Tensor<P>,
    target: &Tensor<F32>,
    beta: f64,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::smooth_l1(inp, target, beta),
        || fp32::smooth_l1(inp, target, beta),
    )
}

/// Huber loss with threshold `delta` (PyTorch's `huber_loss`, candle-nn's `loss::huber`);
/// `delta` must be > 0.
pub fn huber<P: Fp32Input<op::huber>>(
    inp: &Tensor<P>,
    target: &Tensor<F32>,
    delta: f64,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::huber(inp, target, delta),
        || fp32::huber(inp, target, delta),
    )
}

/// Negative log likelihood of log-probabilities `(batch, classes)` at class ids `(batch)`.
pub fn nll<P: Fp32Input<op::nll>>(
    inp: &Tensor<P>,
    target: &candle_core::Tensor,
) -> Result<Tensor<F32>> {
    typed_or_followed(|| free::nll(inp, target), || fp32::nll(inp, target))
}

/// Cross-entropy of logits `(batch, classes)` against class ids `(batch)`.
pub fn cross_entropy<P: Fp32Input<op::cross_entropy>>(
    inp: &Tensor<P>,
    target: &candle_core::Tensor,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::cross_entropy(inp, target),
        || fp32::cross_entropy(inp, target),
    )
}

/// Cross-entropy with PyTorch's options (class weights, `ignore_index`, label smoothing; see
/// [`CrossEntropy`]), mean reduction, in f32. A batch with no row to average (every target
/// `ignore_index`, or the kept rows' class weights adding up to 0) and non-finite class weights
/// are errors, where PyTorch returns NaN. A term whose coefficient is 0 (a class weighted 0) is
/// 0 even where its log-probability is `-inf`; PyTorch's `0 * -inf` makes the loss NaN there.
pub fn cross_entropy_with<P: Fp32Input<op::cross_entropy>>(
    inp: &Tensor<P>,
    target: &candle_core::Tensor,
    options: &CrossEntropy,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::cross_entropy_with(inp, target, options),
        || {
            let y = crate::composite::cross_entropy_with_f32(inp.as_candle(), target, options)?;
            Tensor::from_candle(y)
        },
    )
}

pub use crate::composite::CrossEntropy;

/// Binary cross-entropy on logits, computed stably (PyTorch's `binary_cross_entropy_with_logits`).
pub fn binary_cross_entropy_with_logits<P: Fp32Input<op::binary_cross_entropy_with_logits>>(
    inp: &Tensor<P>,
    target: &Tensor<F32>,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::binary_cross_entropy_with_logits(inp, target),
        || fp32::binary_cross_entropy_with_logits(inp, target),
    )
}

/// candle-nn's spelling of [`binary_cross_entropy_with_logits`].
pub fn binary_cross_entropy_with_logit<P: Fp32Input<op::binary_cross_entropy_with_logits>>(
    inp: &Tensor<P>,
    target: &Tensor<F32>,
) -> Result<Tensor<F32>> {
    binary_cross_entropy_with_logits(inp, target)
}

/// The same losses routed through an autocast policy (see `ops::__amp_routed`).
#[doc(hidden)]
pub use crate::region::foreign::routed_arg as __amp_arg;

#[doc(hidden)]
pub mod __amp_routed {
    pub use crate::region::free::{
        binary_cross_entropy_with_logit, binary_cross_entropy_with_logits, cross_entropy,
        cross_entropy_with, huber, l1, mse, nll, smooth_l1,
    };
}
