//! Policies: which precision each op class runs in. A policy is a type parameter of the routed
//! calls, so an op's target precision is a compile-time constant.

use crate::op::{Op, OpClass};
use crate::precision::{Precision, BF16, F16, F32};

/// An autocast policy: the lower dtype and the class each op runs in.
///
/// The built-in policies follow PyTorch's CUDA autocast lists (the classes of [`crate::op`]).
/// `policy!` declares others at compile time.
pub trait Policy: Copy + Default + std::fmt::Debug + Send + Sync + 'static {
    /// The precision lower-precision ops run in.
    type Lower: Precision;
    /// The policy's name, for messages.
    const NAME: &'static str;
    /// The class op `O` runs in under this policy. Custom policies move ops between classes by
    /// overriding this.
    fn class<O: Op>() -> OpClass {
        O::CLASS
    }
}

/// `#[autocast(fp16)]`: PyTorch's CUDA autocast, lower dtype f16.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp16Policy;
impl Policy for Fp16Policy {
    type Lower = F16;
    const NAME: &'static str = "fp16";
}

/// `#[autocast(bf16)]`: PyTorch's autocast lists, lower dtype bf16 (PyTorch's CPU default).
#[derive(Clone, Copy, Debug, Default)]
pub struct Bf16Policy;
impl Policy for Bf16Policy {
    type Lower = BF16;
    const NAME: &'static str = "bf16";
}

/// Everything in f32: every op's inputs are upcast and it runs in f32. The policy of
/// `enabled = false` (on f32 inputs: exactly the plain f32 program, every cast elided) and of
/// `#[keep_fp32]` parts (PyTorch's `autocast(enabled=False)` plus the `.float()` calls it needs).
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp32Policy;
impl Policy for Fp32Policy {
    type Lower = F32;
    const NAME: &'static str = "fp32";
    fn class<O: Op>() -> OpClass {
        OpClass::Fp32
    }
}
