//! fp32-class ops for inputs of any precision: f32 output, f32 accumulation.
//!
//! These are the entry points an autocast policy calls for an fp32-class op, and what a user
//! calls to get a numerically safe reduction of a half tensor without writing the cast:
//!
//! ```
//! use amp_runtime::{fp32, Tensor, F16};
//! # fn main() -> candle_core::Result<()> {
//! let ones = Tensor::<F16>::ones(100_000, &candle_core::Device::Cpu)?;
//! // candle's own f16 sum accumulates in f16 and stops at 2048; this one is exact.
//! assert_eq!(fp32::sum_all(&ones)?.to_scalar::<f32>()?, 100_000.0);
//! # Ok(()) }
//! ```
//!
//! Every function is differentiable: gradients flow back to the input in its own precision
//! (candle's `to_dtype` backward casts back). None uses candle-nn's fused `*_no_bwd` kernels,
//! whose gradients silently stop (candle #3011, #3752).

use candle_core::shape::{Dim, Dims};
use candle_core::{DType, Result};

use crate::cast::convert;
use crate::composite;
use crate::kernels::reduce;
use crate::op::{self, Fp32Input};
use crate::precision::{Precision, F32};
use crate::tensor::Tensor;

/// The input as an f32 candle tensor: a handle clone when it already is one.
fn up<P: Precision>(x: &Tensor<P>) -> Result<candle_core::Tensor> {
    convert(x.as_candle(), DType::F32)
}

fn out(t: candle_core::Tensor) -> Tensor<F32> {
    Tensor::wrap(t)
}

// The sums and means read half values as they are and accumulate in f64
// (`kernels::reduce`): candle's f32 sum of 2e7 values of 0.1 is 0.6% off.

/// Sum over `dims`, kept as size-1 dimensions.
pub fn sum_keepdim<P: Precision, D: Dims>(x: &Tensor<P>, dims: D) -> Result<Tensor<F32>> {
    reduce::sum_keepdim(x.as_candle(), dims).map(out)
}

/// Sum over `dims`.
pub fn sum<P: Precision, D: Dims>(x: &Tensor<P>, dims: D) -> Result<Tensor<F32>> {
    reduce::sum(x.as_candle(), dims).map(out)
}

/// Sum of all elements.
pub fn sum_all<P: Precision>(x: &Tensor<P>) -> Result<Tensor<F32>> {
    reduce::sum_all(x.as_candle()).map(out)
}

/// Mean over `dims`, kept as size-1 dimensions.
pub fn mean_keepdim<P: Precision, D: Dims>(x: &Tensor<P>, dims: D) -> Result<Tensor<F32>> {
    reduce::mean_keepdim(x.as_candle(), dims).map(out)
}

/// Mean over `dims`.
pub fn mean<P: Precision, D: Dims>(x: &Tensor<P>, dims: D) -> Result<Tensor<F32>> {
    reduce::mean(x.as_candle(), dims).map(out)
}

/// Mean of all elements.
pub fn mean_all<P: Precision>(x: &Tensor<P>) -> Result<Tensor<F32>> {
    reduce::mean_all(x.as_candle()).map(out)
}

/// `exp(x)`.
pub fn exp<P: Precision>(x: &Tensor<P>) -> Result<Tensor<F32>> {
    up(x)?.exp().map(out)
}

/// Natural logarithm.
pub fn log<P: Precision>(x: &Tensor<P>) -> Result<Tensor<F32>> {
    up(x)?.log().map(out)
}

/// `x ^ e`; at `e = 0` the gradient is 0 everywhere, as PyTorch's (candle's is NaN at 0).
pub fn powf<P: Precision>(x: &Tensor<P>, e: f64) -> Result<Tensor<F32>> {
    crate::kernels::powf(&up(x)?, e).map(out)
}

/// `x ^ rhs` elementwise.
pub fn pow<P: Precision, Q: Precision>(x: &Tensor<P>, rhs: &Tensor<Q>) -> Result<Tensor<F32>> {
    composite::pow(&up(x)?, &up(rhs)?).map(out)
}

/// `x ^ rhs` elementwise with broadcasting.
pub fn broadcast_pow<P: Precision, Q: Precision>(
    x: &Tensor<P>,
    rhs: &Tensor<Q>,
) -> Result<Tensor<F32>> {
    composite::broadcast_pow(&up(x)?, &up(rhs)?).map(out)
}

/// `x * x`: PyTorch's `square`, which is `pow(x, 2)` and so fp32-class under CUDA autocast (an
/// f16 square overflows from |x| = 256).
pub fn sqr<P: Precision>(x: &Tensor<P>) -> Result<Tensor<F32>> {
    up(x)?.sqr().map(out)
}

/// `1 / x`.
pub fn recip<P: Precision>(x: &Tensor<P>) -> Result<Tensor<F32>> {
    up(x)?.recip().map(out)
}

/// `log(sum(exp(x)))` over `dims`, shifted by the maximum for stability.
pub fn log_sum_exp<P: Precision, D: Dims>(x: &Tensor<P>, dims: D) -> Result<Tensor<F32>> {
    composite::log_sum_exp(&up(x)?, dims).map(out)
}

/// Cumulative sum along `dim`, accumulated in f64; an infinity or NaN reaches only the sums
/// from its place on (candle's, a product with a triangle of ones, made every sum NaN).
pub fn cumsum<P: Precision, D: Dim>(x: &Tensor<P>, dim: D) -> Result<Tensor<F32>> {
    crate::kernels::cumsum(&up(x)?, dim).map(out)
}

/// Softmax along `dim` (differentiable; over the last dimension one fused op that reads a half
/// input as it is).
pub fn softmax<P: Precision, D: Dim>(x: &Tensor<P>, dim: D) -> Result<Tensor<F32>> {
    crate::composite::softmax_f32(x.as_candle(), dim).map(out)
}

/// Log-softmax along `dim` (differentiable; over the last dimension one fused op that reads a
/// half input as it is).
pub fn log_softmax<P: Precision, D: Dim>(x: &Tensor<P>, dim: D) -> Result<Tensor<F32>> {
    crate::composite::log_softmax_f32(x.as_candle(), dim).map(out)
}

/// Layer norm over the last dimension: `(x - mean) / sqrt(var + eps) * alpha + beta`, with the
/// biased variance as PyTorch. Differentiable in `x`, `alpha` and `beta`.
pub fn layer_norm<P: Precision>(
    x: &Tensor<P>,
    alpha: &Tensor<F32>,
    beta: Option<&Tensor<F32>>,
    eps: f64,
) -> Result<Tensor<F32>> {
    let beta = beta.map(Tensor::as_candle);
    composite::layer_norm(&up(x)?, alpha.as_candle(), beta, eps).map(out)
}

/// RMS norm over the last dimension: `x / sqrt(mean(x^2) + eps) * alpha`. Differentiable.
pub fn rms_norm<P: Precision>(x: &Tensor<P>, alpha: &Tensor<F32>, eps: f64) -> Result<Tensor<F32>> {
    composite::rms_norm(&up(x)?, alpha.as_candle(), eps).map(out)
}

/// Mean squared error.
pub fn mse<P: Precision, Q: Precision>(inp: &Tensor<P>, target: &Tensor<Q>) -> Result<Tensor<F32>> {
    composite::mse_f32(inp.as_candle(), target.as_candle()).map(out)
}

/// Mean absolute error (PyTorch's `l1_loss`).
pub fn l1<P: Precision, Q: Precision>(inp: &Tensor<P>, target: &Tensor<Q>) -> Result<Tensor<F32>> {
    composite::l1(&up(inp)?, target.as_candle()).map(out)
}

/// Smooth L1 (PyTorch's `smooth_l1_loss` with `beta`): `0.5 d^2 / beta` where `|d| < beta`,
/// `|d| - 0.5 beta` elsewhere, averaged. `beta = 0` is the L1 loss, as in PyTorch; a negative
/// or non-finite `beta` is an error.
pub fn smooth_l1<P: Precision, Q: Precision>(
    inp: &Tensor<P>,
    target: &Tensor<Q>,
    beta: f64,
) -> Result<Tensor<F32>> {
    composite::smooth_l1(&up(inp)?, target.as_candle(), beta).map(out)
}

/// Huber loss (PyTorch's `huber_loss` with `delta`, candle-nn's `loss::huber`): `0.5 d^2`
/// where `|d| < delta`, `delta (|d| - 0.5 delta)` elsewhere, averaged; `delta` must be > 0.
pub fn huber<P: Precision, Q: Precision>(
    inp: &Tensor<P>,
    target: &Tensor<Q>,
    delta: f64,
) -> Result<Tensor<F32>> {
    composite::huber(&up(inp)?, target.as_candle(), delta).map(out)
}

/// Negative log likelihood of log-probabilities `(batch, classes)` at integer `target` `(batch)`.
pub fn nll<P: Precision>(inp: &Tensor<P>, target: &candle_core::Tensor) -> Result<Tensor<F32>> {
    composite::nll(&up(inp)?, target).map(out)
}

/// Cross-entropy of logits `(batch, classes)` against integer class ids `(batch)`.
pub fn cross_entropy<P: Precision>(
    inp: &Tensor<P>,
    target: &candle_core::Tensor,
) -> Result<Tensor<F32>> {
    crate::composite::cross_entropy_f32(inp.as_candle(), target).map(out)
}

/// Binary cross-entropy on logits, in the stable form PyTorch uses:
/// `max(x, 0) - x * t + log(1 + exp(-|x|))`, averaged.
pub fn binary_cross_entropy_with_logits<P: Precision, Q: Precision>(
    inp: &Tensor<P>,
    target: &Tensor<Q>,
) -> Result<Tensor<F32>> {
    composite::binary_cross_entropy_with_logits(&up(inp)?, target.as_candle()).map(out)
}

// ---------------------------------------------------------------------------------------------
// The same ops as methods of `Tensor<P>`: `Tensor<F32>` only outside autocast (the bound names
// the op in the error). They live here, not in `tensor`, so that the typed tensor does not
// depend on the ops built on it. On an f32 input candle's own op is the fp32-class op; in code
// a region calls, it runs where the region's policy puts it (`tensor::follow`).

/// The fp32-class methods of `Tensor<P>`, each `f32` out: `method:` rows run candle's method
/// of the same name, `reduce:` rows `kernels::reduce`'s function (the sums and means).
macro_rules! fp32_methods {
    (@call method $name:ident $x:ident ($($arg:ident),*)) => { $x.$name($($arg),*) };
    (@call reduce $name:ident $x:ident ($($arg:ident),*)) => { reduce::$name($x, $($arg),*) };
    ($via:ident: $($(#[$doc:meta])* $name:ident $(<$g:ident: $bound:path>)? ($($arg:ident: $ty:ty),*);)*) => {$(
        $(#[$doc])*
        pub fn $name$(<$g: $bound>)?(&self, $($arg: $ty),*) -> Result<Tensor<F32>>
        where
            P: Fp32Input<op::$name>,
        {
            self.unary_op::<op::$name, F32>(|x| fp32_methods!(@call $via $name x ($($arg),*)))
        }
    )*};
}

impl<P: Precision> Tensor<P> {
    /// Any candle function on the data as an fp32-class op: `Tensor<F32>` in, f32 out (a half
    /// tensor: cast it first, or run it in a region, which upcasts). `f` must return the dtype
    /// it is given.
    pub fn fp32_op(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<Tensor<F32>>
    where
        P: Fp32Input<op::fp32_op>,
    {
        self.closure_op::<op::fp32_op, F32>(f)
    }

    /// `x ^ rhs` elementwise.
    pub fn pow(&self, rhs: &Tensor<F32>) -> Result<Tensor<F32>>
    where
        P: Fp32Input<op::pow>,
    {
        self.cast::<F32>()?
            .binary_op::<op::pow, F32>(rhs, composite::pow)
    }

    /// `x ^ rhs` elementwise with broadcasting.
    pub fn broadcast_pow(&self, rhs: &Tensor<F32>) -> Result<Tensor<F32>>
    where
        P: Fp32Input<op::broadcast_pow>,
    {
        self.cast::<F32>()?
            .binary_op::<op::broadcast_pow, F32>(rhs, composite::broadcast_pow)
    }

    /// `log(sum(exp(x)))` over `dims`, computed stably (`-inf` for a slice of `-inf`, `inf` for
    /// one holding `inf`, as PyTorch; see [`crate::fp32::log_sum_exp`]).
    pub fn log_sum_exp<D: candle_core::shape::Dims>(&self, dims: D) -> Result<Tensor<F32>>
    where
        P: Fp32Input<op::log_sum_exp>,
    {
        self.unary_op::<op::log_sum_exp, F32>(|x| composite::log_sum_exp(x, dims))
    }

    /// `x ^ e` for a scalar exponent (see [`crate::fp32::powf`]).
    pub fn powf(&self, e: f64) -> Result<Tensor<F32>>
    where
        P: Fp32Input<op::powf>,
    {
        self.unary_op::<op::powf, F32>(|x| crate::kernels::powf(x, e))
    }

    /// Cumulative sum along `dim` (see [`crate::fp32::cumsum`]).
    pub fn cumsum<D: candle_core::shape::Dim>(&self, dim: D) -> Result<Tensor<F32>>
    where
        P: Fp32Input<op::cumsum>,
    {
        self.unary_op::<op::cumsum, F32>(|x| crate::kernels::cumsum(x, dim))
    }

    fp32_methods! {
        reduce:
        /// Sum over `dims`, kept as size-1 dimensions.
        sum_keepdim<D: candle_core::shape::Dims>(dims: D);
        /// Sum over `dims`.
        sum<D: candle_core::shape::Dims>(dims: D);
        /// Sum of all elements (rank 0).
        sum_all();
        /// Mean over `dims`, kept as size-1 dimensions.
        mean_keepdim<D: candle_core::shape::Dims>(dims: D);
        /// Mean over `dims`.
        mean<D: candle_core::shape::Dims>(dims: D);
        /// Mean of all elements (rank 0).
        mean_all();
    }

    fp32_methods! {
        method:
        /// `exp(x)`.
        exp();
        /// Natural logarithm.
        log();
        /// `x * x` (PyTorch's `square`, `pow(x, 2)`).
        sqr();
        /// `1 / x`.
        recip();
    }
}

/// `s / x`, PyTorch's fp32-class `rdiv`: on `Tensor<F32>` (outside a region a half tensor is cast
/// first, as every fp32-class op's input).
impl std::ops::Div<&Tensor<F32>> for f64 {
    type Output = Result<Tensor<F32>>;
    fn div(self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        x.unary_op::<op::recip, F32>(|t| crate::kernels::rdiv_scalar(self, t))
    }
}
