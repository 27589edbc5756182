//! The free-function ops of `candle_amp::ops`, `candle_amp::loss` and `Tensor::cat`/`stack`,
//! routed: what `#[autocast]` calls for `ops::softmax(..)`, `loss::mse(..)`, `Tensor::cat(..)`
//! in a region.
//!
//! The macro cannot see what a path like `ops::softmax` names, so the routed form is picked by
//! name resolution: `ops` (candle-amp's) and `loss` carry a hidden `__amp_routed` module with
//! these functions, and `candle_amp::Tensor` the hidden `__amp_routed_cat`/`__amp_routed_stack`;
//! another crate's `ops` has neither, and its function is called as written. The generated call
//! passes its arguments exactly as the user wrote them (coercions included), so a routed op
//! cannot take the policy as an argument: it returns a `Deferred` call, and the region applies
//! its policy with `.__amp_policy::<Pol>()`, which on any other value is the identity
//! ([`Unrouted`]).

use std::marker::PhantomData;

use candle_core::shape::Dim;
use candle_core::{Result, Tensor as Candle};

use super::policy::Policy;
use super::route::{at, routed};
use super::value::{AmpTensor, AsAmp, RegionValue};
use crate::composite;
use crate::kernels::attention::Attention;
use crate::kernels::rope;
use crate::op::{self, Op};
use crate::precision::F32;
use crate::tensor::Tensor;

/// A routed free op's call, its inputs taken as region values, waiting for the policy of the
/// region that runs it.
#[must_use = "a routed op runs when the region's policy is applied with `.__amp_policy::<Pol>()`"]
pub struct Deferred<O, F> {
    /// The inputs the op's class casts (others, like class ids or a norm's scale, live in `run`).
    inputs: Vec<AmpTensor>,
    run: F,
    /// For an f32 target, a fused kernel that reads the inputs in any float dtype and computes
    /// in f32: it gets them uncast, and no f32 copy is made (`run` serves the other targets).
    widening: Option<Widening>,
    op: PhantomData<O>,
}

impl<O: Op, F> std::fmt::Debug for Deferred<O, F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Deferred")
            .field("op", &O::NAME)
            .field("inputs", &self.inputs)
            .field("widening", &self.widening.is_some())
            .finish_non_exhaustive()
    }
}

impl<O: Op, F: FnOnce(&[Candle]) -> Result<Candle>> Deferred<O, F> {
    /// Runs the op under `Pol`: its inputs cast to the op's target, as every routed op (or, for
    /// a widening kernel with an f32 target, as they are).
    #[doc(hidden)]
    pub fn __amp_policy<Pol: Policy>(self) -> Result<AmpTensor> {
        let inputs: Vec<&AmpTensor> = self.inputs.iter().collect();
        let out = routed::<Pol, O>(&inputs, |t| {
            // Not for f64 inputs, which autocast never casts: the op runs on them in f64.
            let f64_input = inputs.iter().any(|v| v.dtype() == candle_core::DType::F64);
            if let (Some(candle_core::DType::F32), Some(widening), false) =
                (t, self.widening, f64_input)
            {
                let uncast: Vec<Candle> = inputs.iter().map(|v| (*v).clone()).collect();
                return widening(&uncast);
            }
            let cast = inputs
                .iter()
                .map(|v| at(v, t))
                .collect::<Result<Vec<_>>>()?;
            (self.run)(&cast)
        })?;
        Ok(out)
    }
}

/// A typed free op (`ops::softmax`, `loss::mse`): in code a region calls, given typed tensors
/// (autocast is per thread), the routed form `routed` under the region's policy, its result cast
/// to f32 as the typed signature says; elsewhere the typed body `typed`.
pub(crate) fn typed_or_followed<O: Op, F: FnOnce(&[Candle]) -> Result<Candle>>(
    routed: impl FnOnce() -> Deferred<O, F>,
    typed: impl FnOnce() -> Result<Tensor<F32>>,
) -> Result<Tensor<F32>> {
    if crate::autocast_state::followed().is_some() {
        routed()
            .__amp_policy::<super::CallerPolicy>()?
            .cast::<F32>()
    } else {
        typed()
    }
}

/// The identity `.__amp_policy::<Pol>()` of every value that is not a `Deferred` call: the
/// result of another crate's function, called as written.
pub trait Unrouted: Sized {
    /// Returns `self`.
    #[doc(hidden)]
    fn __amp_policy<Pol>(self) -> Self {
        self
    }
}
impl<T> Unrouted for T {}

/// `candle_core::Tensor::cat`/`stack` in a region: routed as candle-amp's (the inherent
/// `candle_amp::Tensor::__amp_routed_*` take precedence for candle-amp's `Tensor`).
pub trait ForeignJoin {
    /// Routed `candle_core::Tensor::cat`.
    #[doc(hidden)]
    fn __amp_routed_cat<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::cat>;
    /// Routed `candle_core::Tensor::stack`.
    #[doc(hidden)]
    fn __amp_routed_stack<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::stack>;
}

impl ForeignJoin for Candle {
    fn __amp_routed_cat<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::cat> {
        cat(tensors, dim)
    }
    fn __amp_routed_stack<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::stack> {
        stack(tensors, dim)
    }
}

/// A fused kernel reading f32, f16 or bf16 inputs, computing in f32.
type Widening = Box<dyn FnOnce(&[Candle]) -> Result<Candle>>;

/// The type of a routed call of op `O`.
pub(crate) type Call<O> = Deferred<O, Box<dyn FnOnce(&[Candle]) -> Result<Candle>>>;

/// A call of `O` on `inputs`, running `run` on them once cast.
fn call<O: Op>(
    inputs: Vec<AmpTensor>,
    run: impl FnOnce(&[Candle]) -> Result<Candle> + 'static,
) -> Call<O> {
    Deferred {
        inputs,
        run: Box::new(run),
        widening: None,
        op: PhantomData,
    }
}

/// A call of `O` that runs `widening` on its uncast inputs under an f32 target (the op's class
/// under every built-in policy) and `run` on cast inputs under another.
fn widening_call<O: Op>(
    inputs: Vec<AmpTensor>,
    widening: impl FnOnce(&[Candle]) -> Result<Candle> + 'static,
    run: impl FnOnce(&[Candle]) -> Result<Candle> + 'static,
) -> Call<O> {
    Deferred {
        widening: Some(Box::new(widening)),
        ..call(inputs, run)
    }
}

/// Routed `ops::softmax`.
pub fn softmax<X: AsAmp, D: Dim + Copy + 'static>(xs: X, dim: D) -> Call<op::softmax> {
    widening_call(
        vec![xs.to_amp()],
        move |x| composite::softmax_f32(&x[0], dim),
        move |x| candle_nn::ops::softmax(&x[0], dim),
    )
}

/// Routed `ops::softmax_last_dim`: softmax over the last dimension, in f32 and differentiable
/// (candle-nn's fused kernel has no backward).
pub fn softmax_last_dim<X: AsAmp>(xs: X) -> Call<op::softmax> {
    softmax(xs, candle_core::D::Minus1)
}

/// Routed `ops::log_softmax`.
pub fn log_softmax<X: AsAmp, D: Dim + Copy + 'static>(xs: X, d: D) -> Call<op::log_softmax> {
    widening_call(
        vec![xs.to_amp()],
        move |x| composite::log_softmax_f32(&x[0], d),
        move |x| candle_nn::ops::log_softmax(&x[0], d),
    )
}

/// Routed `ops::sigmoid`.
pub fn sigmoid<X: AsAmp>(xs: X) -> Call<op::sigmoid> {
    call(vec![xs.to_amp()], |x| {
        crate::kernels::in_f32(&x[0], candle_nn::ops::sigmoid)
    })
}

/// Routed `ops::silu`.
pub fn silu<X: AsAmp>(xs: X) -> Call<op::silu> {
    call(vec![xs.to_amp()], |x| crate::kernels::silu(&x[0]))
}

/// Routed `ops::layer_norm`: the input is cast by the op's class, the scale and shift follow it.
pub fn layer_norm<X: AsAmp>(
    xs: X,
    alpha: impl AsAmp,
    beta: impl AsAmp,
    eps: f32,
) -> Call<op::layer_norm> {
    let (alpha, beta) = (alpha.to_amp(), beta.to_amp());
    let (a, b) = (alpha.clone(), beta.clone());
    widening_call(
        vec![xs.to_amp()],
        move |x| composite::layer_norm_f32(&x[0], &a, Some(&b), f64::from(eps)),
        move |x| composite::layer_norm(&x[0], &alpha, Some(&beta), f64::from(eps)),
    )
}

/// Routed `ops::rms_norm`.
pub fn rms_norm<X: AsAmp>(xs: X, alpha: impl AsAmp, eps: f32) -> Call<op::rms_norm> {
    let alpha = alpha.to_amp();
    let a = alpha.clone();
    widening_call(
        vec![xs.to_amp()],
        move |x| composite::rms_norm_f32(&x[0], &a, f64::from(eps)),
        move |x| composite::rms_norm(&x[0], &alpha, f64::from(eps)),
    )
}

/// Routed `ops::rope` (precision-preserving; the tables read in f32, never cast by the class).
pub fn rope<X: AsAmp>(xs: X, cos: impl AsAmp, sin: impl AsAmp) -> Call<op::rope> {
    rotary(xs, cos, sin, rope::Form::Halves)
}

/// Routed `ops::rope_i`.
pub fn rope_i<X: AsAmp>(xs: X, cos: impl AsAmp, sin: impl AsAmp) -> Call<op::rope> {
    rotary(xs, cos, sin, rope::Form::Interleaved)
}

/// Routed `ops::rope_thd`.
pub fn rope_thd<X: AsAmp>(xs: X, cos: impl AsAmp, sin: impl AsAmp) -> Call<op::rope> {
    rotary(xs, cos, sin, rope::Form::Thd)
}

fn rotary<X: AsAmp>(xs: X, cos: impl AsAmp, sin: impl AsAmp, form: rope::Form) -> Call<op::rope> {
    let (cos, sin) = (cos.to_amp(), sin.to_amp());
    call(vec![xs.to_amp()], move |x| {
        rope::rope(&x[0], &cos, &sin, form)
    })
}

/// Routed `ops::scaled_dot_product_attention`: query, key and value cast by the op's class
/// (lower precision), the mask read as it is.
pub fn scaled_dot_product_attention<Q: AsAmp, K: AsAmp, V: AsAmp>(
    q: Q,
    k: K,
    v: V,
    mask: Option<&Candle>,
    scale: Option<f64>,
    causal: bool,
) -> Call<op::scaled_dot_product_attention> {
    let options = Attention {
        mask,
        scale,
        causal,
        dropout: 0.0,
    };
    scaled_dot_product_attention_with(q, k, v, &options)
}

/// Routed `ops::scaled_dot_product_attention_with`.
pub fn scaled_dot_product_attention_with<Q: AsAmp, K: AsAmp, V: AsAmp>(
    q: Q,
    k: K,
    v: V,
    options: &Attention,
) -> Call<op::scaled_dot_product_attention> {
    let options = OwnedAttention::of(options);
    call(vec![q.to_amp(), k.to_amp(), v.to_amp()], move |x| {
        crate::kernels::scaled_dot_product_attention(&x[0], &x[1], &x[2], &options.get())
    })
}

/// Routed `ops::scaled_dot_product_attention_packed`: `qkv` cast by the op's class.
pub fn scaled_dot_product_attention_packed<X: AsAmp>(
    qkv: X,
    options: &Attention,
) -> Call<op::scaled_dot_product_attention> {
    let options = OwnedAttention::of(options);
    call(vec![qkv.to_amp()], move |x| {
        crate::kernels::attention::packed_attention(&x[0], &options.get())
    })
}

/// An attention call's options owned by the call (it runs later, under the region's policy),
/// the mask read as it is.
struct OwnedAttention {
    mask: Option<Candle>,
    scale: Option<f64>,
    causal: bool,
    dropout: f32,
}

impl OwnedAttention {
    fn of(options: &Attention) -> Self {
        Self {
            mask: options.mask.cloned(),
            scale: options.scale,
            causal: options.causal,
            dropout: options.dropout,
        }
    }

    fn get(&self) -> Attention<'_> {
        Attention {
            mask: self.mask.as_ref(),
            scale: self.scale,
            causal: self.causal,
            dropout: self.dropout,
        }
    }
}

/// A loss of a prediction and a target, both cast by the loss's class.
fn pair<O: Op, X: AsAmp>(
    inp: X,
    target: impl AsAmp,
    run: impl FnOnce(&Candle, &Candle) -> Result<Candle> + 'static,
) -> Call<O> {
    call(vec![inp.to_amp(), target.to_amp()], |x| run(&x[0], &x[1]))
}

/// Routed `loss::mse`.
pub fn mse<X: AsAmp>(inp: X, target: impl AsAmp) -> Call<op::mse> {
    widening_call(
        vec![inp.to_amp(), target.to_amp()],
        |x| composite::mse_f32(&x[0], &x[1]),
        |x| composite::mse(&x[0], &x[1]),
    )
}

/// Routed `loss::l1`.
pub fn l1<X: AsAmp>(inp: X, target: impl AsAmp) -> Call<op::l1> {
    pair(inp, target, composite::l1)
}

/// Routed `loss::binary_cross_entropy_with_logits`.
pub fn binary_cross_entropy_with_logits<X: AsAmp>(
    inp: X,
    target: impl AsAmp,
) -> Call<op::binary_cross_entropy_with_logits> {
    pair(inp, target, composite::binary_cross_entropy_with_logits)
}

/// candle-nn's spelling of [`binary_cross_entropy_with_logits`].
pub fn binary_cross_entropy_with_logit<X: AsAmp>(
    inp: X,
    target: impl AsAmp,
) -> Call<op::binary_cross_entropy_with_logits> {
    binary_cross_entropy_with_logits(inp, target)
}

/// Routed `loss::smooth_l1`.
pub fn smooth_l1<X: AsAmp>(inp: X, target: impl AsAmp, beta: f64) -> Call<op::smooth_l1> {
    pair(inp, target, move |a, b| composite::smooth_l1(a, b, beta))
}

/// Routed `loss::huber` (candle-nn's too).
pub fn huber<X: AsAmp>(inp: X, target: impl AsAmp, delta: f64) -> Call<op::huber> {
    pair(inp, target, move |a, b| composite::huber(a, b, delta))
}

/// Routed `loss::nll` (class ids: integers, never cast).
pub fn nll<X: AsAmp>(inp: X, target: impl AsAmp) -> Call<op::nll> {
    let target = target.to_amp();
    call(vec![inp.to_amp()], move |x| composite::nll(&x[0], &target))
}

/// Routed `loss::cross_entropy` (class ids: integers, never cast).
pub fn cross_entropy<X: AsAmp>(inp: X, target: impl AsAmp) -> Call<op::cross_entropy> {
    let target = target.to_amp();
    let same = target.clone();
    widening_call(
        vec![inp.to_amp()],
        move |x| composite::cross_entropy_f32(&x[0], &target),
        move |x| {
            let ids = composite::class_ids("cross_entropy", &x[0], &same)?;
            candle_nn::loss::cross_entropy(&x[0], &ids)
        },
    )
}

/// Routed `loss::cross_entropy_with` (class ids and weights: never cast; the logits by the
/// loss's class).
pub fn cross_entropy_with<X: AsAmp>(
    inp: X,
    target: impl AsAmp,
    options: &composite::CrossEntropy,
) -> Call<op::cross_entropy> {
    let (target, options) = (target.to_amp(), options.clone());
    call(vec![inp.to_amp()], move |x| {
        composite::cross_entropy_with_f32(&x[0], &target, &options)
    })
}

/// Routed `Tensor::cat`: promote-class, the widest input wins.
pub fn cat<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::cat> {
    let inputs = tensors.iter().map(AsAmp::to_amp).collect();
    call(inputs, move |x| Candle::cat(x, dim))
}

/// Routed `Tensor::stack`: promote-class, the widest input wins.
pub fn stack<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::stack> {
    let inputs = tensors.iter().map(AsAmp::to_amp).collect();
    call(inputs, move |x| Candle::stack(x, dim))
}

/// `Tensor::cat`/`Tensor::stack` in a region, reached through the user's own `Tensor` path.
impl Tensor<F32> {
    #[doc(hidden)]
    pub fn __amp_routed_cat<A: AsAmp, D: Dim + 'static>(tensors: &[A], dim: D) -> Call<op::cat> {
        cat(tensors, dim)
    }

    #[doc(hidden)]
    pub fn __amp_routed_stack<A: AsAmp, D: Dim + 'static>(
        tensors: &[A],
        dim: D,
    ) -> Call<op::stack> {
        stack(tensors, dim)
    }
}
