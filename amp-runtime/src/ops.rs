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
use crate::kernels::rope;
use crate::op::{self, Fp32Input};
use crate::precision::{Precision, F32};
use crate::region::free::{self, typed_or_followed};
use crate::region::AsAmp;
use crate::tensor::{at, follow, Tensor};

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
    let keys = past.checked_add(t).ok_or_else(|| {
        candle_core::Error::Msg(format!("causal_mask: {past} + {t} keys overflow"))
    })?;
    crate::kernels::layout::check_allocatable("causal_mask", &[t, keys])?;
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| {
            (0..past + t).map(move |j| if j > past + i { f32::NEG_INFINITY } else { 0.0 })
        })
        .collect();
    candle_core::Tensor::from_vec(mask, (t, keys), device)
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

/// `x * sigmoid(x)`, precision-preserving, candle-nn's `ops::silu` (on CPU computed in f32 and
/// rounded once, with a one-pass backward).
pub fn silu<P: Precision>(xs: &Tensor<P>) -> Result<Tensor<P>> {
    xs.silu()
}

/// Rotary position embeddings, candle-nn's `rotary_emb::rope`: `xs` `(b, heads, t, d)` rotated
/// pairwise (element `j` with `j + d / 2`) by the angles whose cosines and sines are the tables
/// `cos`, `sin` (`(t', d / 2)` or `(b, t', d / 2)`, `t' >= t`, their first `t` rows used;
/// candle tensors as candle-nn takes them, or typed ones).
/// Precision-preserving: the tables are read in f32 whatever their dtype, each pair rotated in
/// f32 and rounded once to `xs`'s dtype. Differentiable in `xs`, where candle-nn's kernel has no
/// backward (a model trained through it gets no gradient into its query and key projections);
/// the tables get none. A view input is fine.
pub fn rope<P: Precision>(
    xs: &Tensor<P>,
    cos: &(impl AsAmp + ?Sized),
    sin: &(impl AsAmp + ?Sized),
) -> Result<Tensor<P>> {
    rotary(xs, cos, sin, rope::Form::Halves)
}

/// [`rope`] with adjacent elements as pairs (`2j` with `2j + 1`), candle-nn's `rope_i`.
pub fn rope_i<P: Precision>(
    xs: &Tensor<P>,
    cos: &(impl AsAmp + ?Sized),
    sin: &(impl AsAmp + ?Sized),
) -> Result<Tensor<P>> {
    rotary(xs, cos, sin, rope::Form::Interleaved)
}

/// [`rope`] on `(b, t, heads, d)` inputs, candle-nn's `rope_thd`.
pub fn rope_thd<P: Precision>(
    xs: &Tensor<P>,
    cos: &(impl AsAmp + ?Sized),
    sin: &(impl AsAmp + ?Sized),
) -> Result<Tensor<P>> {
    rotary(xs, cos, sin, rope::Form::Thd)
}

fn rotary<P: Precision>(
    xs: &Tensor<P>,
    cos: &(impl AsAmp + ?Sized),
    sin: &(impl AsAmp + ?Sized),
    form: rope::Form,
) -> Result<Tensor<P>> {
    let (cos, sin) = (cos.to_amp(), sin.to_amp());
    xs.unary_op::<op::rope, P>(|x| rope::rope(x, &cos, &sin, form))
}

/// Scaled dot-product attention, PyTorch's `scaled_dot_product_attention`:
/// `softmax(q k^T * scale + mask) v` over `(batch, heads, length, head_dim)` queries, keys and
/// values, as one op with its own backward. A lower-precision op under autocast (PyTorch's
/// CUDA autocast lists it so): in a half region the two products run in the half dtype with
/// f32 accumulation, the scale, the mask and the softmax in f32 between them.
///
/// - `mask` broadcasts to `(b, h, t_q, t_k)`: a float mask is added to the scores; a `u8` mask
///   is PyTorch's boolean one, **nonzero where a query may attend** a key (the opposite of the
///   `u8` masks candle-transformers passes to `masked_fill`). Never cast, and it gets no
///   gradient.
/// - `scale` defaults to `1 / sqrt(head_dim)`.
/// - `causal` hides key `j` from query `i` when `j > i + t_k - t_q`: PyTorch's `is_causal`
///   when `t_q == t_k`, aligned to the bottom right otherwise (flash attention's convention),
///   so that new queries see a KV cache's keys.
/// - Keys and values may have fewer heads than the queries, dividing them (grouped-query
///   attention, PyTorch's `enable_gqa=True`).
/// - A query that sees no key at all gets output 0 and sends no gradient, where PyTorch's math
///   kernel gives NaN.
///
/// Dropout on the probabilities is [`scaled_dot_product_attention_with`]'s. The head split can
/// stay a view: `x.reshape((b, t, h, d))?.transpose(1, 2)?` is read in place, without
/// `.contiguous()`. On CPU one block of 32 query rows' scores exists at a time per thread; off
/// the CPU the op runs as candle ops with the same semantics.
pub fn scaled_dot_product_attention<P: Precision>(
    q: &Tensor<P>,
    k: &Tensor<P>,
    v: &Tensor<P>,
    mask: Option<&candle_core::Tensor>,
    scale: Option<f64>,
    causal: bool,
) -> Result<Tensor<P>> {
    let options = Attention {
        mask,
        scale,
        causal,
        dropout: 0.0,
    };
    scaled_dot_product_attention_with(q, k, v, &options)
}

pub use crate::kernels::attention::Attention;

/// [`scaled_dot_product_attention`] with all of PyTorch's options, dropout on the probabilities
/// among them. Which probabilities are dropped is drawn once per call (candle's random source,
/// as `nn::Dropout`) and regenerated by the backward, not stored.
pub fn scaled_dot_product_attention_with<P: Precision>(
    q: &Tensor<P>,
    k: &Tensor<P>,
    v: &Tensor<P>,
    options: &Attention,
) -> Result<Tensor<P>> {
    let (q, k, v) = (q.as_candle(), k.as_candle(), v.as_candle());
    Tensor::typed(follow::<op::scaled_dot_product_attention>(
        &[q, k, v],
        |t| {
            crate::kernels::scaled_dot_product_attention(
                &at(q, t)?,
                &at(k, t)?,
                &at(v, t)?,
                options,
            )
        },
    )?)
}

/// [`scaled_dot_product_attention_with`] over a packed projection: `qkv` `(batch, length, 3,
/// heads, head_dim)` holds the queries, keys and values at index 0, 1 and 2 of dimension 2 (a
/// `(b, t, 3 * heads * head_dim)` projection reshaped, flash attention's `qkvpacked` layout);
/// the output is `(batch, length, heads, head_dim)`, which `reshape((b, t, ()))` makes the
/// output projection's input without a copy. Self-attention only (one length). On CPU it reads
/// `qkv` in place and its backward writes the gradient of `qkv` as one tensor: where the split
/// into heads and the merge back are views and copies in the graph (a narrow, a transpose and
/// their gradients' zero-filled accumulations each), here they are none.
pub fn scaled_dot_product_attention_packed<P: Precision>(
    qkv: &Tensor<P>,
    options: &Attention,
) -> Result<Tensor<P>> {
    let x = qkv.as_candle();
    Tensor::typed(follow::<op::scaled_dot_product_attention>(&[x], |t| {
        crate::kernels::attention::packed_attention(&at(x, t)?, options)
    })?)
}

/// The same ops routed through an autocast policy. In a region, `#[autocast]` calls
/// `__amp_routed::softmax(..)` where this module is glob-imported, so the routed form is found
/// exactly when the user's `ops` is this module (see `region/free.rs`).
#[doc(hidden)]
pub use crate::region::foreign::routed_arg as __amp_arg;

#[doc(hidden)]
pub mod __amp_routed {
    pub use crate::region::free::{
        layer_norm, log_softmax, rms_norm, rope, rope_i, rope_thd, scaled_dot_product_attention,
        scaled_dot_product_attention_packed, scaled_dot_product_attention_with, sigmoid, silu,
        softmax, softmax_last_dim,
    };
}
