//! This thread's autocast state, PyTorch's dynamic autocast: the stack of policy frames that
//! region parts push while they run, and the dtype an op runs in under a frame.
//!
//! Regions (`region/`) push a frame per region part (a region body, a `#[keep_fp32]` statement,
//! a module called from a region); code they call reads the innermost one. Two readers:
//! - `CallerPolicy` and the region operators, for region values (`region/policy.rs`);
//! - the typed ops of `Tensor<P>`, for a typed tensor in a plain fn, method or trait default
//!   method that a region calls ([`followed`]): while a frame that autocasts is innermost, a
//!   typed op runs where that frame's policy puts it, and its result is cast back to the
//!   precision its signature names.
//!
//! While a routed op runs its own implementation (a layer's typed forward, a closure given to
//! `lower_op`) an [`OpScope`] marks the frame, so that the typed ops inside it run as written:
//! the op was routed once, as a whole.

use std::any::TypeId;
use std::cell::RefCell;

use candle_core::{DType, Result};

use crate::op::{Op, OpClass};
use crate::{cast, report};

/// A policy as a run-time value: what a region part pushes for the code it calls.
#[doc(hidden)]
#[derive(Clone, Copy, Debug)]
pub struct Frame {
    /// The policy's name, for messages and `current_policy()`.
    pub name: &'static str,
    /// The dtype lower-precision ops run in.
    pub lower: DType,
    /// The class an op runs in, from its marker's type id and its declared class.
    pub class_of: fn(TypeId, OpClass) -> OpClass,
    /// Whether typed ops follow this frame: false for the f32 policy of `#[keep_fp32]`,
    /// `enabled = false` and `#[custom_fwd(cast_inputs = f32)]`, which are PyTorch's
    /// `autocast(enabled=False)`: there a typed op runs in its tensors' precision, as written.
    pub autocast: bool,
    /// Pushed by [`OpScope`]: a routed op's own implementation is running.
    internal: bool,
}

impl Frame {
    /// A frame for a policy.
    pub fn new(
        name: &'static str,
        lower: DType,
        class_of: fn(TypeId, OpClass) -> OpClass,
        autocast: bool,
    ) -> Self {
        Self {
            name,
            lower,
            class_of,
            autocast,
            internal: false,
        }
    }

    /// The class op `O` runs in under this frame.
    pub fn class<O: Op>(&self) -> OpClass {
        (self.class_of)(TypeId::of::<O>(), O::CLASS)
    }

    /// The dtype op `O` runs in under this frame, given its inputs' dtypes (`None`: no cast).
    pub fn target<O: Op>(&self, inputs: &[DType]) -> Result<Option<DType>> {
        target(self.class::<O>(), self.lower, O::NAME, inputs)
    }
}

/// The dtype an op of `class` runs in, `lower` being the policy's lower dtype, given its inputs'
/// dtypes (`None`: as they are). Promotion picks the widest floating input (integer inputs,
/// such as a mask, are never cast and take no part; an f64 one makes the others f64, as
/// PyTorch's type promotion does after autocast, which casts no f64 tensor); f16 with bf16 is
/// an error naming `op`. The casts themselves are the region's (`region::route::at`): f64
/// inputs are never cast, so an fp32- or lower-class op runs on them in f64.
pub fn target(class: OpClass, lower: DType, op: &str, inputs: &[DType]) -> Result<Option<DType>> {
    Ok(match class {
        OpClass::LowerPrecision => Some(lower),
        OpClass::Fp32 => Some(DType::F32),
        OpClass::Preserve => None,
        OpClass::Promote => {
            if inputs.contains(&DType::F64) {
                Some(DType::F64)
            } else if inputs.contains(&DType::F32) {
                Some(DType::F32)
            } else if inputs.contains(&DType::F16) && inputs.contains(&DType::BF16) {
                candle_core::bail!(
                    "`{op}` mixes f16 and bf16 in an autocast region: F16 and BF16 never mix \
                     implicitly; cast one operand first"
                )
            } else {
                inputs
                    .iter()
                    .copied()
                    .find(|d| matches!(d, DType::F16 | DType::BF16))
            }
        }
    })
}

/// The inputs whose dtypes decide a promotion, as PyTorch's: a zero-dimensional tensor does
/// not promote a dimensioned one (a half tensor plus an f32 rank-0 tensor stays half), unless
/// every input is zero-dimensional.
pub fn promoting<'a>(
    inputs: &'a [&'a candle_core::Tensor],
) -> impl Iterator<Item = &'a candle_core::Tensor> + 'a {
    let any_dimensioned = inputs.iter().any(|x| x.rank() > 0);
    inputs
        .iter()
        .copied()
        .filter(move |x| x.rank() > 0 || !any_dimensioned)
}

thread_local! {
    static FRAMES: RefCell<Vec<Frame>> = const { RefCell::new(Vec::new()) };
}

/// The innermost frame on this thread, `None` outside any region part.
pub fn innermost() -> Option<Frame> {
    FRAMES.with(|f| f.borrow().last().copied())
}

/// The innermost frame pushed by a region part (not by an [`OpScope`]): what code written
/// in a region, or called from one, runs under.
pub fn innermost_region() -> Option<Frame> {
    FRAMES.with(|f| f.borrow().iter().rev().find(|f| !f.internal).copied())
}

/// The frame a typed op follows: the innermost, when it autocasts and no routed op's own
/// implementation is running. `None` outside regions, under `#[keep_fp32]`-like parts and
/// inside routed ops: there typed ops run as written.
pub fn followed() -> Option<Frame> {
    innermost().filter(|f| f.autocast && !f.internal)
}

/// Pushes a region part's frame until the guard drops.
pub fn push(frame: Frame) -> FrameGuard {
    FRAMES.with(|f| f.borrow_mut().push(frame));
    FrameGuard {
        _not_send: std::marker::PhantomData,
    }
}

/// Pops its frame when dropped. Frames are per thread, so the guard stays on its thread.
#[doc(hidden)]
#[derive(Debug)]
pub struct FrameGuard {
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Drop for FrameGuard {
    fn drop(&mut self) {
        FRAMES.with(|f| f.borrow_mut().pop());
    }
}

/// Marks a routed op's implementation while it runs: typed ops inside it run as written (the op
/// was routed as a whole), while the policy seen by region code stays the region's. Pushes
/// nothing outside region parts.
#[derive(Debug)]
pub struct OpScope {
    _frame: Option<FrameGuard>,
}

impl OpScope {
    /// Enters a routed op's implementation.
    pub fn enter() -> Self {
        let frame = innermost().map(|f| {
            push(Frame {
                internal: true,
                ..f
            })
        });
        Self { _frame: frame }
    }
}

/// Runs an op that autocast placed (a routed op, or a typed op following a region): `run` gets
/// `target` and casts the inputs to it; it runs inside an [`OpScope`]. While a precision report
/// records or the finite check is on, the op is reported with the casts it made
/// ([`crate::report`]); `inputs` gives its inputs before the casts.
pub(crate) fn run_op<'a>(
    name: &'static str,
    class: OpClass,
    inputs: impl FnOnce() -> Vec<&'a candle_core::Tensor>,
    target: Option<DType>,
    run: impl FnOnce(Option<DType>) -> Result<candle_core::Tensor>,
) -> Result<candle_core::Tensor> {
    let _op = OpScope::enter();
    if !report::active() {
        return run(target);
    }
    let before = cast::stats();
    let out = run(target)?;
    report::observe(name, class, &inputs(), &out, cast::stats() - before)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op;

    fn frame(autocast: bool) -> Frame {
        Frame::new("test", DType::BF16, |_, declared| declared, autocast)
    }

    #[test]
    fn typed_ops_follow_the_innermost_autocasting_frame_outside_routed_ops() {
        assert!(followed().is_none());
        {
            let _region = push(frame(true));
            assert_eq!(followed().map(|f| f.lower), Some(DType::BF16));
            {
                let _op = OpScope::enter();
                assert!(followed().is_none());
                // Region code running inside (a module called by the op) sees the region.
                assert_eq!(innermost_region().map(|f| f.name), Some("test"));
                assert!(innermost().is_some_and(|f| f.internal));
            }
            {
                let _off = push(frame(false));
                assert!(followed().is_none());
            }
            assert_eq!(
                followed()
                    .unwrap()
                    .target::<op::matmul>(&[DType::F32])
                    .unwrap(),
                Some(DType::BF16)
            );
        }
        assert!(followed().is_none());
        // Outside regions an op scope pushes nothing.
        let _op = OpScope::enter();
        assert!(innermost().is_none());
    }
}
