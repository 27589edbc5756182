//! Routed ops taken as values rather than called: `let mm = Tensor::matmul; mm(&x, &w)?`,
//! `.map(Tensor::exp)`, `.map(candle_nn::ops::softmax_last_dim)`.
//!
//! Called, such an op is routed; taken as a value it was the function itself, which ran
//! unrouted (candle's f32 `matmul` in a bf16 region). The macro now passes `ofN_K` the function
//! as written, whose type fixes the arguments' and the result's types, and a closure that makes
//! the same call routed, as any closure written in a region (under the policy of the region it
//! is called in; the f32 policy outside any). `ofN_K` returns the closure as a function pointer.
//! Its routed result comes back as the function's own result type: a candle tensor as it is, a
//! typed tensor in the precision its type names.

use candle_core::Result;

use super::exit::{ExitAs, Leave};

/// A taken op's routed result `r` as the op's own result type `D`.
pub fn returned<A: ExitAs<D>, D>(r: Result<A>) -> Result<D> {
    r.and_then(|a| a.exit_as(Leave::as_made()))
}

/// `ofN_K`: the routed closure for an op of `N` arguments whose first `K` (the receiver, then
/// the tensor operands) are references, as a function pointer of the op `_`'s own type: what
/// the function as written coerces to wherever plain Rust takes it. Its references are taken at
/// any lifetime (`for<'a> fn(&'a T0, ..)`), so `F: Fn(&Tensor) -> ..`, `Box<dyn Fn ..>` and an
/// array of several ops take it (the closure it is made from captures nothing).
macro_rules! taken {
    ($($of:ident: [$($t:ident)+] $($a:ident)*;)*) => {$(
        #[doc = concat!(
            "The routed closure of an op taking references to ", stringify!($($t)+),
            " and values ", stringify!($($a)*), " (see the module)."
        )]
        pub fn $of<$($t: ?Sized,)+ $($a,)* R>(
            _: fn($(&$t,)+ $($a),*) -> R,
            routed: fn($(&$t,)+ $($a),*) -> R,
        ) -> fn($(&$t,)+ $($a),*) -> R {
            routed
        }
    )*};
}

taken! {
    of1_1: [T0];
    of2_1: [T0] A1;
    of2_2: [T0 T1];
    of3_1: [T0] A1 A2;
    of3_2: [T0 T1] A2;
    of3_3: [T0 T1 T2];
    of4_1: [T0] A1 A2 A3;
    of4_2: [T0 T1] A2 A3;
    of4_3: [T0 T1 T2] A3;
    of5_1: [T0] A1 A2 A3 A4;
    of5_2: [T0 T1] A2 A3 A4;
    of6_1: [T0] A1 A2 A3 A4 A5;
    of6_2: [T0 T1] A2 A3 A4 A5;
    of7_1: [T0] A1 A2 A3 A4 A5 A6;
    of7_2: [T0 T1] A2 A3 A4 A5 A6;
}
