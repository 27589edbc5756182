//! candle-amp: automatic mixed precision for candle, checked at compile time.
//!
//! Precision is part of a tensor's type: [`Tensor<F16>`](Tensor), [`Tensor<F32>`](Tensor),
//! [`Tensor<BF16>`](Tensor). Code that PyTorch would run in the wrong precision, or that candle
//! would reject at run time deep in training, does not compile here:
//!
//! ```compile_fail
//! use candle_amp::{Tensor, F16};
//! # fn f(x: Tensor<F16>) -> candle_core::Result<()> {
//! let total = x.sum_all()?; // error: `sum_all` is an fp32-class op ... `Tensor<F16>`
//! # Ok(()) }
//! ```
//!
//! ```
//! use candle_amp::{Tensor, F16, F32};
//! # fn f(x: Tensor<F16>) -> candle_core::Result<()> {
//! let total: Tensor<F32> = x.cast::<F32>()?.sum_all()?; // explicit, accumulates in f32
//! # Ok(()) }
//! ```
//!
//! See the README for the tour, and [`nn`] for the AMP-aware layers.

pub use amp_macros::{autocast, custom_bwd, custom_fwd, keep_fp32, policy};
pub use amp_runtime::*;

/// The names most programs use: typed tensors, precision markers, layers, ops and losses.
pub mod prelude {
    pub use amp_macros::{autocast, custom_bwd, custom_fwd, keep_fp32, policy};
    pub use amp_runtime::nn::{self, loss, AmpLayer};
    pub use amp_runtime::{
        fp32, ops, AmpModule, AmpTensor, Precision, RegionValue, Tensor, BF16, F16, F32,
    };
    pub use amp_runtime::{GradScaler, StepOutcome};
}

/// Paths used by code the macros generate. Not a public API.
#[doc(hidden)]
pub use amp_runtime::__private;

// The README's examples compile and run as doctests.
#[doc = include_str!("../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;

// docs/guide.md's examples compile and run as doctests too.
#[doc = include_str!("../docs/guide.md")]
#[cfg(doctest)]
pub struct GuideDoctests;
