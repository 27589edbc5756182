//! Routed ops taken as values rather than called: `let mm = Tensor::matmul; mm(&x, &w)?`,
//! `.map(Tensor::exp)`, `.map(candle_nn::ops::softmax_last_dim)`.
//!
//! Called, such an op is routed; taken as a value it was the function itself, which ran
//! unrouted (candle's f32 `matmul` in a bf16 region). The macro now passes `ofN` the function as
//! written, whose type fixes the arguments' and the result's types, and a closure that makes
//! the same call routed, as any closure written in a region (under the policy of the region
//! it is called in; plain code outside one). `ofN` returns the closure. Its routed result
//! comes back as the function's own result type: a candle tensor as it is, a typed tensor in
//! the precision its type names.

use candle_core::Result;

use super::exit::{ExitAs, Leave};

/// A taken op's routed result `r` as the op's own result type `D`.
pub fn returned<A: ExitAs<D>, D>(r: Result<A>) -> Result<D> {
    r.and_then(|a| a.exit_as(Leave::as_made()))
}

/// `ofN`: the closure for an op of `N` arguments (its receiver the first), its argument and
/// result types those of the op `_` as written.
macro_rules! taken {
    ($($of:ident: $($a:ident)+;)*) => {$(
        #[doc = concat!("The routed closure of an op of ", stringify!($($a)+), " (see the module).")]
        pub fn $of<$($a,)+ R, F: Fn($($a),+) -> R>(_: fn($($a),+) -> R, routed: F) -> F {
            routed
        }
    )*};
}

taken! {
    of1: A0;
    of2: A0 A1;
    of3: A0 A1 A2;
    of4: A0 A1 A2 A3;
    of5: A0 A1 A2 A3 A4;
    of6: A0 A1 A2 A3 A4 A5;
    of7: A0 A1 A2 A3 A4 A5 A6;
}
