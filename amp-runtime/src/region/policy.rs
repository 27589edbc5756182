//! Policies: which precision each op class runs in. A policy is a type parameter of the routed
//! calls, so an op's target precision is a compile-time constant; [`CallerPolicy`] is the one
//! exception, read from the innermost active region on this thread.

use std::any::TypeId;

use candle_core::DType;

use crate::autocast_state::{self, Frame, FrameGuard};
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

    /// The class the op whose marker has type id `op` runs in, given the class it declares.
    /// Custom policies move ops between classes by overriding this (`policy!` does).
    fn class_of(op: TypeId, declared: OpClass) -> OpClass {
        let _ = op;
        declared
    }

    /// The class op `O` runs in under this policy.
    fn class<O: Op>() -> OpClass {
        Self::class_of(TypeId::of::<O>(), O::CLASS)
    }

    /// The dtype lower-precision ops run in.
    fn lower() -> DType {
        <Self::Lower as Precision>::DTYPE
    }

    /// Whether typed ops in code a region under this policy calls follow it (true but for
    /// [`Fp32Policy`], PyTorch's `autocast(enabled=False)`).
    #[doc(hidden)]
    const AUTOCASTS: bool = true;

    /// This policy as a run-time value, for the regions it calls into.
    #[doc(hidden)]
    fn frame() -> Frame {
        Frame::new(Self::NAME, Self::lower(), Self::class_of, Self::AUTOCASTS)
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
/// Typed tensors in plain code such a part calls run as written, as under PyTorch's
/// `autocast(enabled=False)`: only the region's own values are upcast.
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp32Policy;
impl Policy for Fp32Policy {
    type Lower = F32;
    const NAME: &'static str = "fp32";
    const AUTOCASTS: bool = false;
    fn class_of(_: TypeId, _: OpClass) -> OpClass {
        OpClass::Fp32
    }
}

/// The policy of whatever region is running: the one an `#[autocast]` fn, method or impl
/// without a policy of its own runs under when it is called as a plain fn or method (a helper
/// `self.scores(&q)`, a closure's call, a free `#[autocast]` fn). Outside any region it is
/// [`Fp32Policy`].
///
/// This is PyTorch's dynamic autocast state, per thread: every region entered pushes its policy
/// (a `#[keep_fp32]` part and `enabled = false` push [`Fp32Policy`]), and code it calls reads the
/// innermost one. Module calls from a region (`m.forward(&x)`) pass the policy statically
/// instead; both agree.
#[derive(Clone, Copy, Debug, Default)]
pub struct CallerPolicy;
impl Policy for CallerPolicy {
    /// Not used for routing: [`CallerPolicy::lower`] reads the calling region's.
    type Lower = F32;
    const NAME: &'static str = "caller";
    fn class_of(op: TypeId, declared: OpClass) -> OpClass {
        (current().class_of)(op, declared)
    }
    fn lower() -> DType {
        current().lower
    }
    fn frame() -> Frame {
        current()
    }
}

/// The innermost region part's policy on this thread, or f32 outside any region.
fn current() -> Frame {
    autocast_state::innermost_region().unwrap_or_else(Fp32Policy::frame)
}

/// The name of the policy code called from here runs under ([`CallerPolicy`]'s): the innermost
/// region's on this thread, `"fp32"` outside any region.
pub fn current_policy() -> &'static str {
    current().name
}

/// PyTorch's `torch.is_autocast_enabled()`: whether code called from here autocasts, that is,
/// runs inside a region part whose policy moves ops to a lower precision (not outside regions,
/// not in a `#[keep_fp32]` part, an `enabled = false` region or a `cast_inputs` op, which run
/// as written in f32).
pub fn is_autocast_enabled() -> bool {
    current().autocast
}

/// PyTorch's `torch.get_autocast_dtype(device)`: the lower precision of the region running here
/// (`F16` under `fp16`, `BF16` under `bf16`, a `policy!`'s own), `None` where autocast is off
/// ([`is_autocast_enabled`]).
pub fn autocast_dtype() -> Option<DType> {
    let frame = current();
    frame.autocast.then_some(frame.lower)
}

/// Marks a region part's extent on this thread: while alive, [`CallerPolicy`] is `Pol`.
#[doc(hidden)]
#[derive(Debug)]
pub struct PolicyScope(FrameGuard);

impl PolicyScope {
    /// Enters a region part running under `Pol` (for [`CallerPolicy`]: the caller's, unchanged).
    pub fn enter<Pol: Policy>() -> Self {
        Self(autocast_state::push(Pol::frame()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op;

    #[test]
    fn the_caller_policy_is_the_innermost_region_and_f32_outside() {
        assert_eq!(CallerPolicy::lower(), DType::F32);
        assert_eq!(CallerPolicy::class::<op::matmul>(), OpClass::Fp32);
        {
            let _fp16 = PolicyScope::enter::<Fp16Policy>();
            assert_eq!(CallerPolicy::lower(), DType::F16);
            assert_eq!(CallerPolicy::class::<op::matmul>(), OpClass::LowerPrecision);
            assert_eq!(current_policy(), "fp16");
            {
                let _kept = PolicyScope::enter::<Fp32Policy>();
                assert_eq!(CallerPolicy::class::<op::matmul>(), OpClass::Fp32);
                // A part that inherits keeps what it found.
                let _inherit = PolicyScope::enter::<CallerPolicy>();
                assert_eq!(current_policy(), "fp32");
            }
            assert_eq!(CallerPolicy::class::<op::add>(), OpClass::Promote);
        }
        assert_eq!(current_policy(), "fp32");
    }
}
