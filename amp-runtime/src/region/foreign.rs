//! Another crate's free function named like a candle-amp op, called in a region
//! (`candle_nn::ops::softmax(&h, 1)`): the rewrite passes its first argument through
//! [`foreign_arg`], which lets a candle tensor through and turns a region value into a compile
//! error naming candle-amp's op. candle-amp's own `ops`/`loss` shadow it with [`routed_arg`]
//! (see `free.rs` for how the shadowing picks).

use std::marker::PhantomData;

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
    label = "a region value or typed tensor given to a function of another crate",
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
