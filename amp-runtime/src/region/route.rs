//! Routing: an op's class under the policy fixes its target dtype; inputs are cast to it (no
//! cast when already there), the op runs, the result is a region value.
//!
//! Method calls in a region are rewritten to `Routed::<Pol, _>::new(&x).op(args)`; module calls
//! are `call.rs`'s.

use std::marker::PhantomData;

use candle_core::{DType, Result};

use super::policy::Policy;
use super::value::{floating, AmpTensor, AsAmp};
use crate::autocast_state;
use crate::cast::convert;
use crate::op::{Op, OpClass};

/// The dtype op `O` runs in under `Pol`, given its inputs' dtypes (`None`: no cast).
pub(crate) fn target<Pol: Policy, O: Op>(inputs: &[DType]) -> Result<Option<DType>> {
    autocast_state::target(Pol::class::<O>(), Pol::lower(), O::NAME, inputs)
}

/// `x` at the dtype `target` chose; an integer tensor (ids, a mask) as it is, as PyTorch's
/// autocast casts floating tensors only.
pub(crate) fn at(x: &AmpTensor, dtype: Option<DType>) -> Result<candle_core::Tensor> {
    match dtype {
        Some(d) if floating(x) => convert(x, d),
        _ => Ok(x.clone()),
    }
}

/// Routes one op: `run` gets the target `target` chose for the inputs' dtypes and returns the
/// op's output (having cast the inputs with [`at`]). While a precision report records or the
/// finite check is on, the op is reported with the casts it made ([`crate::report`]). Typed ops
/// inside `run` (a layer's typed forward) run as written: the op is routed as a whole.
pub(crate) fn routed<Pol: Policy, O: Op>(
    inputs: &[&AmpTensor],
    run: impl FnOnce(Option<DType>) -> Result<candle_core::Tensor>,
) -> Result<candle_core::Tensor> {
    // Integer inputs are rare (ids, masks): the dtype test first, the op's name and class only
    // then, so that the common call pays one pass over its inputs' dtypes.
    if let Some(x) = inputs.iter().find(|x| !x.dtype().is_float()) {
        if FLOATING_POINT_MATH.contains(&O::NAME) {
            candle_core::bail!(
                "`{}` of a {:?} tensor: it computes in floating point, and candle's integer \
                 kernels give 0s, wrapped values or a panic; cast it first \
                 (`.to_dtype(DType::F32)`), as PyTorch promotes an integer input to float \
                 (its `mean` of integers is an error)",
                O::NAME,
                x.dtype()
            )
        }
        let float = inputs.iter().find(|x| x.dtype().is_float());
        if let (OpClass::Promote, Some(float)) = (Pol::class::<O>(), float) {
            candle_core::bail!(
                "`{}` mixes a {:?} tensor with a {:?} one: candle does not promote an integer \
                 tensor; cast it first (`.to_dtype(DType::{:?})`), as PyTorch's promotion would",
                O::NAME,
                x.dtype(),
                float.dtype(),
                float.dtype()
            )
        }
    }
    let t = if inputs.len() <= 4 {
        let mut dtypes = [DType::F32; 4];
        let mut n = 0;
        for x in autocast_state::promoting(inputs) {
            dtypes[n] = x.dtype();
            n += 1;
        }
        target::<Pol, O>(&dtypes[..n])?
    } else {
        target::<Pol, O>(
            &autocast_state::promoting(inputs)
                .map(candle_core::Tensor::dtype)
                .collect::<Vec<_>>(),
        )?
    };
    autocast_state::run_op(O::NAME, Pol::class::<O>(), || inputs.to_vec(), t, run)
}

/// Ops whose value is a floating-point function of their input: an integer input is an error
/// ([`routed`]), never candle's integer kernel (`exp` of `u8` panics, `gelu` of 1 gives 0,
/// `0.5 * 3u8` gives 1, the `mean` of `[1u32, 2]` 0).
const FLOATING_POINT_MATH: &[&str] = &[
    "mean",
    "mean_keepdim",
    "mean_all",
    "exp",
    "log",
    "powf",
    "pow",
    "broadcast_pow",
    "recip",
    "log_sum_exp",
    "gelu",
    "gelu_erf",
    "silu",
    "tanh",
    "sigmoid",
    "sqrt",
    "affine",
    "softmax",
    "log_softmax",
    "layer_norm",
    "rms_norm",
    "group_norm",
    "dropout",
];

/// Sums, which PyTorch takes over integers in `i64` (300 `u8` ones sum to 300; candle's `u8`
/// sum wraps to 44, or panics in a debug build). Only `u8` sums are widened: a `u32` sum (a
/// mask's count of tokens) stays candle's `u32`, which ported candle code expects, and wraps
/// only past 4e9.
const SUMS: &[&str] = &["sum", "sum_keepdim", "sum_all", "cumsum"];

/// Routes a one-input op: its input cast to the op's target, the op run, the result wrapped.
/// A sum of `u8` values runs on them as `i64`, as PyTorch's ([`SUMS`]).
pub(crate) fn unary<Pol: Policy, O: Op>(
    x: &AmpTensor,
    f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
) -> Result<AmpTensor> {
    if SUMS.contains(&O::NAME) && x.dtype() == DType::U8 {
        let wide = x.to_dtype(DType::I64)?;
        return routed::<Pol, O>(&[&wide], |t| f(&at(&wide, t)?));
    }
    routed::<Pol, O>(&[x], |t| f(&at(x, t)?))
}

/// Routes a one-input fp32-class op with a fused kernel: under an f32 target (the op's class
/// under every built-in policy) `widening` reads the input as it is, with no f32 copy; under
/// another target (a `policy!` that moves the op), or on an f64 input (which autocast never
/// casts: the op runs in f64, as PyTorch's), `f` runs on the input [`at`] the target.
pub(crate) fn unary_widening<Pol: Policy, O: Op>(
    x: &AmpTensor,
    widening: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
) -> Result<AmpTensor> {
    routed::<Pol, O>(&[x], |t| match t {
        Some(DType::F32) if x.dtype() != DType::F64 => widening(x),
        _ => f(&at(x, t)?),
    })
}

/// Routes a two-input op. A zero-dimensional floating operand in another dtype than the op's
/// result (an f32 or f64 `Tensor::new(..)` beside an f16 value: it does not promote,
/// [`autocast_state::promoting`]) is not rounded to that dtype first: the op runs in f32 (f64
/// for an f64 result) and its result is rounded once, as PyTorch computes with such a scalar at
/// full precision. Rounded first, `0 * f32::MIN` was `0 * -inf` = NaN (a BERT mask built so was
/// NaN at every kept position) and `x * 1e-8` was 0; an f64 one was candle's dtype mismatch.
pub(crate) fn binary<Pol: Policy, O: Op>(
    a: &AmpTensor,
    b: &AmpTensor,
    f: impl FnOnce(&candle_core::Tensor, &candle_core::Tensor) -> Result<candle_core::Tensor>,
) -> Result<AmpTensor> {
    routed::<Pol, O>(&[a, b], |t| {
        let dimensioned = if a.rank() > 0 { a } else { b };
        let out = t.unwrap_or(dimensioned.dtype());
        let apart = |x: &AmpTensor| x.rank() == 0 && x.dtype().is_float() && x.dtype() != out;
        if out.is_float() && (apart(a) || apart(b)) {
            let wide = crate::kernels::elem::wide(out);
            let up = |x: &AmpTensor| {
                if x.dtype().is_float() {
                    convert(x, wide)
                } else {
                    Ok(x.clone())
                }
            };
            let (x, y) = (up(a)?, up(b)?);
            let wide_result = crate::kernels::custom_grad::keep_operands(f(&x, &y)?, &x, &y)?;
            return convert(&wide_result, out);
        }
        let (x, y) = (at(a, t)?, at(b, t)?);
        crate::kernels::custom_grad::keep_operands(f(&x, &y)?, &x, &y)
    })
}

/// Runs `body` with `$P` bound to the precision marker of `dtype`: how a region value, whose
/// dtype is a run-time value, reaches a typed forward (`Linear::forward::<P>`).
macro_rules! with_precision {
    ($dtype:expr, $P:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::F32 => {
                type $P = $crate::precision::F32;
                $body
            }
            candle_core::DType::F16 => {
                type $P = $crate::precision::F16;
                $body
            }
            candle_core::DType::BF16 => {
                type $P = $crate::precision::BF16;
                $body
            }
            other => candle_core::bail!(
                "the layers and ops run on f32, f16 or bf16 tensors, got {other:?} (cast it first)"
            ),
        }
    };
}
pub(crate) use with_precision;

/// A method receiver inside a region, carrying the policy. For tensor receivers it offers every
/// op of the typed API, routed through the policy (`region/methods.rs`); for any other receiver
/// it derefs to the receiver, so `f64::sqrt`, `Iterator::max` and the like resolve to their own
/// methods.
#[derive(Debug)]
pub struct Routed<'a, Pol, T: ?Sized> {
    receiver: &'a T,
    policy: PhantomData<Pol>,
}

impl<'a, Pol: Policy, T: ?Sized> Routed<'a, Pol, T> {
    /// Wraps a receiver.
    pub fn new(receiver: &'a T) -> Self {
        Self {
            receiver,
            policy: PhantomData,
        }
    }
}

impl<Pol: Policy, T: AsAmp + ?Sized> Routed<'_, Pol, T> {
    /// The tensor receiver as a region value.
    pub(crate) fn amp(&self) -> AmpTensor {
        self.receiver.to_amp()
    }

    /// Routes a one-input op on the receiver; the result of the receiver's kind (a candle
    /// tensor for a candle tensor).
    pub(crate) fn unary<O: Op>(
        &self,
        f: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<AmpTensor> {
        unary::<Pol, O>(&self.amp(), f)
    }

    /// Routes a two-input op with the receiver on the left; the result of the receiver's kind.
    pub(crate) fn binary<O: Op>(
        &self,
        rhs: &AmpTensor,
        f: impl FnOnce(&candle_core::Tensor, &candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<AmpTensor> {
        binary::<Pol, O>(&self.amp(), rhs, f)
    }
}

impl<Pol, T: ?Sized> std::ops::Deref for Routed<'_, Pol, T> {
    type Target = T;
    fn deref(&self) -> &T {
        self.receiver
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op;
    use crate::region::policy::{Bf16Policy, Fp16Policy, Fp32Policy};
    use DType::{BF16, F16, F32};

    /// Targets of one op per class under one policy, for the given input dtypes.
    fn classes<Pol: Policy>(inputs: &[DType]) -> [Option<DType>; 4] {
        [
            target::<Pol, op::matmul>(inputs).unwrap(),
            target::<Pol, op::softmax>(inputs).unwrap(),
            target::<Pol, op::add>(inputs).unwrap(),
            target::<Pol, op::relu>(inputs).unwrap(),
        ]
    }

    #[test]
    fn each_class_targets_what_pytorch_autocast_runs() {
        // [lower precision, fp32, promote, preserve]
        assert_eq!(
            classes::<Fp16Policy>(&[F32, F32]),
            [Some(F16), Some(F32), Some(F32), None]
        );
        assert_eq!(
            classes::<Fp16Policy>(&[F16, F16]),
            [Some(F16), Some(F32), Some(F16), None]
        );
        assert_eq!(
            classes::<Bf16Policy>(&[BF16, BF16]),
            [Some(BF16), Some(F32), Some(BF16), None]
        );
        assert_eq!(
            classes::<Bf16Policy>(&[F32, F16]),
            [Some(BF16), Some(F32), Some(F32), None]
        );
        // Promotion: the widest input wins, whichever side it is on.
        assert_eq!(
            target::<Fp16Policy, op::mul>(&[F16, F32]).unwrap(),
            Some(F32)
        );
        assert_eq!(
            target::<Fp16Policy, op::cat>(&[F16, F16, F32]).unwrap(),
            Some(F32)
        );
    }

    #[test]
    fn the_fp32_policy_upcasts_every_class() {
        assert_eq!(classes::<Fp32Policy>(&[F16, F16]), [Some(F32); 4]);
        assert_eq!(classes::<Fp32Policy>(&[BF16]), [Some(F32); 4]);
    }

    #[test]
    fn f16_with_bf16_is_an_error_naming_the_op() {
        let err = target::<Bf16Policy, op::broadcast_add>(&[F16, BF16]).unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("`broadcast_add`") && msg.contains("f16 and bf16"),
            "{msg}"
        );
        // Not for ops that cast every input anyway.
        assert_eq!(
            target::<Bf16Policy, op::matmul>(&[F16, BF16]).unwrap(),
            Some(BF16)
        );
        assert_eq!(
            target::<Fp16Policy, op::mse>(&[F16, BF16]).unwrap(),
            Some(F32)
        );
    }
}
