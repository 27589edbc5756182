//! The runtime of candle-amp: typed tensors, op classes, AMP-aware layers and kernels.
//!
//! Users normally depend on the `candle-amp` facade, which re-exports this crate next to the
//! macros. See the workspace README for the tour, and ARCHITECTURE.md for the layer order of
//! the modules below: each uses only modules of lower layers (`tests/layering.rs` checks it).

mod autocast_state;
pub mod backends;
mod cast;
pub mod checkpoint;
mod composite;
pub mod distributed;
mod env;
pub mod fp32;
pub mod kernels;
pub mod loss;
pub mod nn;
pub mod op;
pub mod ops;
pub mod optim;
mod precision;
pub mod region;
pub mod report;
pub mod scaler;
mod tensor;

pub use cast::{clear_autocast_cache, is_autocast_cache_enabled};
pub use op::{Fp32Input, Op, OpClass, SamePrecision};
pub use precision::{Half, Precision, Promote, BF16, F16, F32};
pub use region::{
    autocast_dtype, cast_count, current_policy, is_autocast_enabled, AmpModule, AmpTensor, AsAmp,
    Bf16Policy, CallerPolicy, Fp16Policy, Fp32Policy, Operand, Policy, RegionCall, RegionCallMut,
    RegionValue, TensorArg,
};
pub use scaler::{
    GradScaler, GradScalerBuilder, ScaledGrads, ScaledLoss, ScalerError, ScalerState, StepOutcome,
    UnscaledGrads,
};
pub use tensor::Tensor;

/// What generated code names, re-exported by the facade as `candle_amp::__private`. At this
/// crate's root too, so that its own doctests can use the macros as
/// `extern crate amp_runtime as candle_amp`.
#[doc(hidden)]
pub use region::__private;
