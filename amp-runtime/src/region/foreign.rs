//! Another crate's free function named like a candle-amp op, called in a region: candle-nn's own
//! (`candle_nn::ops::softmax_last_dim(&h)`) is routed as candle-amp's ([`CandleNnFn`]); any
//! other gets its first argument through [`foreign_arg`], which passes a value of the type the
//! function takes and turns a typed tensor where a candle tensor is expected into a compile
//! error naming the fix. candle-amp's own `ops`/`loss` shadow it with [`routed_arg`] (see
//! `free.rs` for how the shadowing picks).

use std::marker::PhantomData;

use candle_core::shape::Dim;

use super::free::{self, Call};
use super::value::AsAmp;
use crate::op;

/// The first argument of another crate's free function named like a candle-amp op
/// (`candle_nn::ops::softmax(&x, 1)` in a region), passed on unchanged when it has the type the
/// function takes; a region value where a candle tensor is expected is an error naming the fix.
/// candle-amp's own `ops`/`loss` shadow this with [`routed_arg`].
pub fn foreign_arg<T: ForeignArg<U>, U>(x: T) -> U {
    x.__amp_arg()
}

/// The first argument of candle-amp's routed free ops: any [`AsAmp`](super::AsAmp), unchanged.
pub fn routed_arg<T>(x: T) -> T {
    x
}

/// A value given to another crate's function where it expects `Target`: only `Target` itself.
#[diagnostic::on_unimplemented(
    message = "this candle function takes `{Target}`, not `{Self}`",
    label = "a typed tensor given to a function of another crate",
    note = "on a candle tensor in half precision a candle-nn op would run in that precision, \
            whatever its autocast class: write candle-amp's function of the same name \
            (`candle_amp::ops::softmax`, `layer_norm`, `rms_norm`, `sigmoid`; \
            `candle_amp::loss::mse`, `cross_entropy`, `nll`, ...), routed in the op's class, or \
            run any other candle function with the class stated: `x.fp32_op(|t| f(t))`, \
            `x.lower_op(..)`, `x.preserve_op(..)`"
)]
pub trait ForeignArg<Target> {
    /// `self`, as the type the function takes.
    #[doc(hidden)]
    fn __amp_arg(self) -> Target;
}
impl<T> ForeignArg<T> for T {
    fn __amp_arg(self) -> T {
        self
    }
}
/// Never used: a second impl for every type keeps rustc from inferring `Target` from `Self`
/// (with one impl it would pick `Target = Self` and report a plain type mismatch at the
/// function); `Target` comes from the function's parameter, and a mismatch is reported as
/// [`ForeignArg`]'s message.
#[doc(hidden)]
#[derive(Debug)]
pub struct NotAnArgument<T>(PhantomData<T>);
impl<T> ForeignArg<NotAnArgument<T>> for T {
    fn __amp_arg(self) -> NotAnArgument<T> {
        NotAnArgument(PhantomData)
    }
}

/// A call of a function named like one of candle-nn's ops (`candle_nn::ops::softmax_last_dim`,
/// `loss::nll`, a single `softmax(..)` imported, any spelling): the rewrite turns `f(a, b)`
/// into `(&&CandleNnFn::new(f, candle_nn's f)).__amp_f(a, b)`, and Rust's method probe picks by
/// the two functions' types (each function item has a type of its own; autoref specialisation):
/// 1. the same function as candle-nn's ([`CandleNnRouted`]): candle-amp's routed op of the
///    name, in the op's class, as PyTorch's autocast runs `F.softmax`;
/// 2. another function ([`AsWritten`]): called as written, with the arguments as written (a
///    user's own `softmax`, candle-amp's routed one).
///
/// candle-nn's generic `softmax`/`log_softmax` are compared as instantiated for candle's `D`
/// (`D::Minus1`), the dimension candle code passes them.
#[derive(Debug)]
pub struct CandleNnFn<F, C> {
    f: F,
    candle: PhantomData<C>,
}

impl<F, C> CandleNnFn<F, C> {
    /// The function the call names, and candle-nn's of the same name.
    pub fn new(f: F, _: C) -> Self {
        Self {
            f,
            candle: PhantomData,
        }
    }
}

/// The candle-nn functions a region routes, with candle-amp's routed op of each: the two ways
/// of [`CandleNnFn`], one method per function. A row:
/// `method = name<routed generics>(arg: routed type | way-2 type, ..) -> op`.
macro_rules! candle_nn_fns {
    ($(
        $method:ident = $name:ident <$($g:ident: $bound:path),*>
            ($($arg:ident: $routed:ty | $any:ident),*) -> $op:ident;
    )*) => {
        /// Way 1 of [`CandleNnFn`]: candle-nn's function, routed.
        pub trait CandleNnRouted {
            $(
                #[doc = concat!("candle-amp's routed `", stringify!($name), "`.")]
                fn $method<$($g: $bound),*>(self, $($arg: $routed),*) -> Call<op::$op>;
            )*
        }

        impl<C> CandleNnRouted for &&CandleNnFn<C, C> {
            $(
                fn $method<$($g: $bound),*>(self, $($arg: $routed),*) -> Call<op::$op> {
                    free::$name($($arg),*)
                }
            )*
        }

        /// Way 2 of [`CandleNnFn`]: the function as written, its arguments passed on.
        pub trait AsWritten<F> {
            $(
                #[doc = concat!("`", stringify!($name), "` as written.")]
                fn $method<$($any,)* R>(self, $($arg: $any),*) -> R
                where
                    F: Fn($($any),*) -> R;
            )*
        }

        impl<F, C> AsWritten<F> for &CandleNnFn<F, C> {
            $(
                fn $method<$($any,)* R>(self, $($arg: $any),*) -> R
                where
                    F: Fn($($any),*) -> R,
                {
                    (self.f)($($arg),*)
                }
            )*
        }
    };
}

/// A dimension argument of a routed softmax: candle's `Dim`, kept for the op's backward.
pub trait RoutedDim: Dim + Copy + 'static {}
impl<D: Dim + Copy + 'static> RoutedDim for D {}

candle_nn_fns! {
    __amp_softmax = softmax<X: AsAmp, D: RoutedDim>(xs: X | A0, dim: D | A1) -> softmax;
    __amp_log_softmax = log_softmax<X: AsAmp, D: RoutedDim>(xs: X | A0, d: D | A1) -> log_softmax;
    __amp_softmax_last_dim = softmax_last_dim<X: AsAmp>(xs: X | A0) -> softmax;
    __amp_sigmoid = sigmoid<X: AsAmp>(xs: X | A0) -> sigmoid;
    __amp_silu = silu<X: AsAmp>(xs: X | A0) -> silu;
    __amp_layer_norm = layer_norm<X: AsAmp, A: AsAmp, B: AsAmp>(
        xs: X | A0, alpha: A | A1, beta: B | A2, eps: f32 | A3
    ) -> layer_norm;
    __amp_rms_norm = rms_norm<X: AsAmp, A: AsAmp>(xs: X | A0, alpha: A | A1, eps: f32 | A2)
        -> rms_norm;
    __amp_rope = rope<X: AsAmp, Cs: AsAmp, Sn: AsAmp>(xs: X | A0, cos: Cs | A1, sin: Sn | A2)
        -> rope;
    __amp_rope_i = rope_i<X: AsAmp, Cs: AsAmp, Sn: AsAmp>(xs: X | A0, cos: Cs | A1, sin: Sn | A2)
        -> rope;
    __amp_rope_thd = rope_thd<X: AsAmp, Cs: AsAmp, Sn: AsAmp>(
        xs: X | A0, cos: Cs | A1, sin: Sn | A2
    ) -> rope;
    __amp_nll = nll<X: AsAmp, T: AsAmp>(inp: X | A0, target: T | A1) -> nll;
    __amp_cross_entropy = cross_entropy<X: AsAmp, T: AsAmp>(inp: X | A0, target: T | A1)
        -> cross_entropy;
    __amp_mse = mse<X: AsAmp, T: AsAmp>(inp: X | A0, target: T | A1) -> mse;
    __amp_huber = huber<X: AsAmp, T: AsAmp>(inp: X | A0, target: T | A1, delta: f64 | A2)
        -> huber;
    __amp_binary_cross_entropy_with_logit = binary_cross_entropy_with_logit<X: AsAmp, T: AsAmp>(
        inp: X | A0, target: T | A1
    ) -> binary_cross_entropy_with_logits;
}
