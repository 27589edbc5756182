//! Op markers and op classes: which precision each op runs in under autocast.
//!
//! Every op the typed API offers has a zero-sized marker type here, named exactly like the
//! method or function (`op::sum_keepdim`, `op::softmax`), so that compile errors can name the op
//! and an autocast policy can route it by its [`OpClass`]. The classes mirror PyTorch's CUDA
//! autocast lists:
//!
//! | class | under autocast | examples |
//! |---|---|---|
//! | [`OpClass::LowerPrecision`] | inputs cast down to the policy's half dtype | `matmul`, `conv2d`, `linear` |
//! | [`OpClass::Fp32`] | inputs cast up to f32, f32 output | `sum`, `exp`, `softmax`, norms, losses |
//! | [`OpClass::Promote`] | inputs cast to the widest input's precision | `add`, `mul`, `cat`, `stack` |
//! | [`OpClass::Preserve`] | run in the input's precision | `relu`, `reshape`, `max_pool2d`, `max` |
//!
//! Outside autocast the same classes decide what compiles: an fp32-class op needs `Tensor<F32>`
//! ([`Fp32Input`]) and a binary op needs operands of one precision ([`SamePrecision`]).

use crate::precision::{Precision, F32};

/// Where an op runs under an autocast policy.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum OpClass {
    /// Tensor-core ops: run in the policy's lower dtype (PyTorch's "lower_precision_fp" list).
    LowerPrecision,
    /// Ops whose half-precision result overflows or loses accuracy: run in f32, f32 output.
    Fp32,
    /// Multi-input ops that run in the widest input's precision.
    Promote,
    /// Ops that are exact or safe in any precision: run in the input's precision.
    Preserve,
}

/// An op marker: a zero-sized type standing for one op of the typed API.
pub trait Op: Copy + Default + std::fmt::Debug + 'static {
    /// The op's name as the user writes it (`"sum_keepdim"`).
    const NAME: &'static str;
    /// The class that decides its precision under autocast.
    const CLASS: OpClass;
}

macro_rules! op_markers {
    ($($class:ident $name:ident;)*) => {$(
        #[doc = concat!("Marker of the `", stringify!($name), "` op (class `", stringify!($class), "`).")]
        #[allow(non_camel_case_types)]
        #[derive(Clone, Copy, Debug, Default)]
        pub struct $name;
        impl Op for $name {
            const NAME: &'static str = stringify!($name);
            const CLASS: OpClass = OpClass::$class;
        }
    )*};
}

// One marker per op of the op table (`amp-macros/src/optable.rs`), which is the one place an
// op's name and class are written.
amp_macros::__op_table!(markers => op_markers);

/// Outside autocast, an fp32-class op `O` accepts only `Tensor<F32>`.
///
/// Implemented for [`F32`] alone; for `F16`/`BF16` rustc reports the message below.
#[diagnostic::on_unimplemented(
    message = "`{O}` is an fp32-class op: it cannot run on `Tensor<{Self}>` outside an autocast region",
    label = "`{O}` needs a `Tensor<F32>` here, found `Tensor<{Self}>`",
    note = "PyTorch's autocast runs `{O}` in f32: in half precision it overflows or loses \
            accuracy (an f16 sum of 100000 ones is 2048)",
    note = "fix: run it inside an `#[autocast(...)]` region, which upcasts for you, \
            or cast explicitly first with `.cast::<F32>()?`"
)]
pub trait Fp32Input<O: Op>: Precision {}
impl<O: Op> Fp32Input<O> for F32 {}

/// Outside autocast, a binary op `O` needs both operands in one precision.
///
/// `Self` is the right operand's precision and `Lhs` the left's. The bound is written on the
/// right operand on purpose: rustc never picks an impl for a not-yet-inferred `Self`, so it reads
/// the right operand's type from the argument and then reports this rule, rather than inferring
/// `Self = Lhs` from the single impl and reporting a bare type mismatch.
#[diagnostic::on_unimplemented(
    message = "`{O}` mixes `Tensor<{Lhs}>` and `Tensor<{Self}>`: operands of different precisions",
    label = "this operand is `Tensor<{Self}>`, the other is `Tensor<{Lhs}>`",
    note = "outside an autocast region both operands need one precision (candle fails at run \
            time, PyTorch silently promotes); F16 and BF16 never mix implicitly",
    note = "fix: run it inside an `#[autocast(...)]` region, which promotes to the widest \
            input as PyTorch does, or cast one operand first, e.g. `.cast::<{Lhs}>()?`"
)]
pub trait SamePrecision<Lhs: Precision, O: Op>: Precision {}
impl<P: Precision, O: Op> SamePrecision<P, O> for P {}
