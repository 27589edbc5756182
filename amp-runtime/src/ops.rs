//! candle-nn's free-function ops, typed: same names and argument order as `candle_nn::ops`.
//!
//! Softmax, log-softmax and the norms are fp32-class ops: outside an autocast region they take
//! `Tensor<F32>` (a half input is a compile error naming the op); their half-input forms are in
//! [`crate::fp32`]. In code an autocast region calls (a plain helper given typed tensors) they
//! run under the region's policy, as every typed op does. All of them are differentiable,
//! unlike candle-nn's fused `softmax_last_dim`, `layer_norm` and `rms_norm` (no backward,
//! candle #3011 / #3752).

use candle_core::shape::Dim;
use candle_core::Result;

use crate::fp32;
use crate::op::{self, Fp32Input};
use crate::precision::{Precision, F32};
use crate::region::free::{self, typed_or_followed};
use crate::tensor::Tensor;

/// Softmax along `dim`.
pub fn softmax<P: Fp32Input<op::softmax>, D: Dim + Copy + 'static>(
    xs: &Tensor<P>,
    dim: D,
) -> Result<Tensor<F32>> {
    typed_or_followed(|| free::softmax(xs, dim), || fp32::softmax(xs, dim))
}

/// Softmax over the last dimension, candle-nn's `softmax_last_dim` with a backward.
pub fn softmax_last_dim<P: Fp32Input<op::softmax>>(xs: &Tensor<P>) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::softmax_last_dim(xs),
        || fp32::softmax(xs, candle_core::D::Minus1),
    )
}

/// The additive causal mask of a decoder: `(t, past + t)`, 0 where query `i` (at position
/// `past + i`) may attend to key `j` (`j <= past + i`), `-inf` elsewhere. An f32 candle tensor,
/// as candle-transformers passes masks (`Option<&Tensor>`): added to the attention scores with
/// `broadcast_add` before the softmax, it takes part in the add's promotion and is never cast on
/// entering a region. `past` is the length of a KV cache (0 without one).
pub fn causal_mask(
    t: usize,
    past: usize,
    device: &candle_core::Device,
) -> Result<candle_core::Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..past + t).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
        })
        .collect();
    candle_core::Tensor::from_vec(mask, (t, past + t), device)
}

/// Log-softmax along `d`.
pub fn log_softmax<P: Fp32Input<op::log_softmax>, D: Dim + Copy + 'static>(
    xs: &Tensor<P>,
    d: D,
) -> Result<Tensor<F32>> {
    typed_or_followed(|| free::log_softmax(xs, d), || fp32::log_softmax(xs, d))
}

/// Layer norm over the last dimension with scale `alpha` and shift `beta`.
pub fn layer_norm<P: Fp32Input<op::layer_norm>>(
    xs: &Tensor<P>,
    alpha: &Tensor<F32>,
    beta: &Tensor<F32>,
    eps: f32,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::layer_norm(xs, alpha, beta, eps),
        || fp32::layer_norm(xs, alpha, Some(beta), f64::from(eps)),
    )
}

/// RMS norm over the last dimension with scale `alpha`.
pub fn rms_norm<P: Fp32Input<op::rms_norm>>(
    xs: &Tensor<P>,
    alpha: &Tensor<F32>,
    eps: f32,
) -> Result<Tensor<F32>> {
    typed_or_followed(
        || free::rms_norm(xs, alpha, eps),
        || fp32::rms_norm(xs, alpha, f64::from(eps)),
    )
}

/// Logistic sigmoid, precision-preserving.
pub fn sigmoid<P: Precision>(xs: &Tensor<P>) -> Result<Tensor<P>> {
    xs.sigmoid()
}

/// The same ops routed through an autocast policy. In a region, `#[autocast]` calls
/// `__amp_routed::softmax(..)` where this module is glob-imported, so the routed form is found
/// exactly when the user's `ops` is this module (see `region/free.rs`).
#[doc(hidden)]
pub use crate::region::foreign::routed_arg as __amp_arg;

#[doc(hidden)]
pub mod __amp_routed {
    pub use crate::region::free::{
        layer_norm, log_softmax, rms_norm, sigmoid, softmax, softmax_last_dim,
    };
}
