//! The runtime of candle-amp: typed tensors, op classes, AMP-aware layers and kernels.
//!
//! Users normally depend on the `candle-amp` facade, which re-exports this crate next to the
//! macros. See the workspace README for the tour.

pub mod autocast;
mod composite;
pub mod fp32;
pub mod kernels;
pub mod nn;
pub mod op;
pub mod ops;
mod precision;
pub mod scaler;
mod tensor;

pub use autocast::{cast_count, AmpTensor, Bf16Policy, Fp16Policy, Fp32Policy, Policy};
pub use op::{Fp32Input, Op, OpClass, SamePrecision};
pub use precision::{Half, Precision, Promote, BF16, F16, F32};
pub use scaler::{
    GradScaler, GradScalerBuilder, ScaledGrads, ScaledLoss, ScalerError, ScalerState, StepOutcome,
    UnscaledGrads,
};
pub use tensor::Tensor;
