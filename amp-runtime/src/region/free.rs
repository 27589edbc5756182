//! The free-function ops of `candle_amp::ops`, `candle_amp::loss` and `Tensor::cat`/`stack`,
//! routed through a policy: what `#[autocast]` calls for `ops::softmax(..)`, `loss::mse(..)`,
//! `Tensor::cat(..)` in a region.

use candle_core::shape::Dim;
use candle_core::Result;

use super::policy::Policy;
use super::route::{at, binary, target, unary};
use super::value::{AmpTensor, AsAmp};
use crate::composite;
use crate::op;
use crate::precision::F32;
use crate::tensor::Tensor;

/// Routed `ops::softmax`.
pub fn softmax<Pol: Policy>(xs: impl AsAmp, dim: impl Dim) -> Result<AmpTensor> {
    unary::<Pol, op::softmax>(&xs.to_amp(), |x| candle_nn::ops::softmax(x, dim))
}

/// Routed `ops::log_softmax`.
pub fn log_softmax<Pol: Policy>(xs: impl AsAmp, d: impl Dim) -> Result<AmpTensor> {
    unary::<Pol, op::log_softmax>(&xs.to_amp(), |x| candle_nn::ops::log_softmax(x, d))
}

/// Routed `ops::sigmoid`.
pub fn sigmoid<Pol: Policy>(xs: impl AsAmp) -> Result<AmpTensor> {
    unary::<Pol, op::sigmoid>(&xs.to_amp(), candle_nn::ops::sigmoid)
}

/// Routed `ops::layer_norm`.
pub fn layer_norm<Pol: Policy>(
    xs: impl AsAmp,
    alpha: impl AsAmp,
    beta: impl AsAmp,
    eps: f32,
) -> Result<AmpTensor> {
    let (alpha, beta) = (alpha.to_amp(), beta.to_amp());
    unary::<Pol, op::layer_norm>(&xs.to_amp(), |x| {
        composite::layer_norm(x, alpha.as_candle(), Some(beta.as_candle()), f64::from(eps))
    })
}

/// Routed `ops::rms_norm`.
pub fn rms_norm<Pol: Policy>(xs: impl AsAmp, alpha: impl AsAmp, eps: f32) -> Result<AmpTensor> {
    let alpha = alpha.to_amp();
    unary::<Pol, op::rms_norm>(&xs.to_amp(), |x| {
        composite::rms_norm(x, alpha.as_candle(), f64::from(eps))
    })
}

/// Routed `loss::mse`.
pub fn mse<Pol: Policy>(inp: impl AsAmp, target: impl AsAmp) -> Result<AmpTensor> {
    binary::<Pol, op::mse>(&inp.to_amp(), &target.to_amp(), composite::mse)
}

/// Routed `loss::l1`.
pub fn l1<Pol: Policy>(inp: impl AsAmp, target: impl AsAmp) -> Result<AmpTensor> {
    binary::<Pol, op::l1>(&inp.to_amp(), &target.to_amp(), composite::l1)
}

/// Routed `loss::binary_cross_entropy_with_logits`.
pub fn binary_cross_entropy_with_logits<Pol: Policy>(
    inp: impl AsAmp,
    target: impl AsAmp,
) -> Result<AmpTensor> {
    binary::<Pol, op::binary_cross_entropy_with_logits>(
        &inp.to_amp(),
        &target.to_amp(),
        composite::binary_cross_entropy_with_logits,
    )
}

/// candle-nn's spelling of [`binary_cross_entropy_with_logits`].
pub fn binary_cross_entropy_with_logit<Pol: Policy>(
    inp: impl AsAmp,
    target: impl AsAmp,
) -> Result<AmpTensor> {
    binary_cross_entropy_with_logits::<Pol>(inp, target)
}

/// Routed `loss::smooth_l1`.
pub fn smooth_l1<Pol: Policy>(inp: impl AsAmp, target: impl AsAmp, beta: f64) -> Result<AmpTensor> {
    binary::<Pol, op::smooth_l1>(&inp.to_amp(), &target.to_amp(), |a, b| {
        composite::smooth_l1(a, b, beta)
    })
}

/// Routed `loss::nll` (class ids are a plain candle tensor).
pub fn nll<Pol: Policy>(inp: impl AsAmp, target: &candle_core::Tensor) -> Result<AmpTensor> {
    unary::<Pol, op::nll>(&inp.to_amp(), |x| candle_nn::loss::nll(x, target))
}

/// Routed `loss::cross_entropy` (class ids are a plain candle tensor).
pub fn cross_entropy<Pol: Policy>(
    inp: impl AsAmp,
    target: &candle_core::Tensor,
) -> Result<AmpTensor> {
    unary::<Pol, op::cross_entropy>(&inp.to_amp(), |x| candle_nn::loss::cross_entropy(x, target))
}

fn joined<Pol: Policy, O: op::Op, A: AsAmp, D: Dim>(
    tensors: &[A],
    dim: D,
    join: fn(&[candle_core::Tensor], D) -> Result<candle_core::Tensor>,
) -> Result<AmpTensor> {
    let values: Vec<AmpTensor> = tensors.iter().map(AsAmp::to_amp).collect();
    let dtypes: Vec<_> = values.iter().map(AmpTensor::dtype).collect();
    let t = target::<Pol, O>(&dtypes)?;
    let cast = values
        .iter()
        .map(|v| at(v, t))
        .collect::<Result<Vec<_>>>()?;
    AmpTensor::new(join(&cast, dim)?)
}

/// Routed `Tensor::cat`: promote-class, the widest input wins.
pub fn cat<Pol: Policy, A: AsAmp>(tensors: &[A], dim: impl Dim) -> Result<AmpTensor> {
    joined::<Pol, op::cat, A, _>(tensors, dim, candle_core::Tensor::cat)
}

/// Routed `Tensor::stack`: promote-class, the widest input wins.
pub fn stack<Pol: Policy, A: AsAmp>(tensors: &[A], dim: impl Dim) -> Result<AmpTensor> {
    joined::<Pol, op::stack, A, _>(tensors, dim, candle_core::Tensor::stack)
}

/// `Tensor::cat`/`Tensor::stack` in a region: `#[autocast]` rewrites them to these, through the
/// user's own `Tensor` path.
impl Tensor<F32> {
    #[doc(hidden)]
    pub fn __region_cat<Pol: Policy, A: AsAmp>(
        tensors: &[A],
        dim: impl candle_core::shape::Dim,
    ) -> Result<AmpTensor> {
        cat::<Pol, A>(tensors, dim)
    }

    #[doc(hidden)]
    pub fn __region_stack<Pol: Policy, A: AsAmp>(
        tensors: &[A],
        dim: impl candle_core::shape::Dim,
    ) -> Result<AmpTensor> {
        stack::<Pol, A>(tensors, dim)
    }
}
