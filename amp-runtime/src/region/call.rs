//! Module calls from a region: `m.forward(args)`, `m.forward_t(args)`, `m.forward_train(args)`
//! pass the region's policy on to the module.
//!
//! A module is callable from a region through [`RegionCall`] (`forward(&self, ..)`) or
//! [`RegionCallMut`] (`forward(&mut self, ..)`, a module holding a KV cache), which the built-in
//! layers implement and `#[autocast]` generates for an impl's module methods. The rewrite turns
//! `m.forward(&x)` into `m.__amp_forward(PhantomData::<Pol>, (&x,))` with this file's traits in
//! scope. That is a method call on the receiver as written, so Rust's method probe borrows it the
//! way the module's own method does: shared for a `&self` module (tried first), mutably only
//! otherwise. Calling a `&mut self` module from a `&self` method is then Rust's own borrow error
//! ("cannot borrow `self.attn` as mutable"), as it would be without the macro, and a module that
//! is neither fails on [`ModuleCall`], whose message says what to do.

use candle_core::Result;

use super::policy::Policy;

/// Method names of module calls, the `Method` parameter of [`RegionCall`].
#[allow(non_camel_case_types)]
pub mod calls {
    /// `module.forward(...)`.
    #[derive(Debug)]
    pub struct forward;
    /// `module.forward_t(..., train)`.
    #[derive(Debug)]
    pub struct forward_t;
    /// `module.forward_train(...)`.
    #[derive(Debug)]
    pub struct forward_train;
}

/// A module callable from an autocast region through `&self`: the built-in layers, and user
/// modules whose impl has `#[autocast]` (which inherit the caller's policy `Pol`) or their own
/// policy.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is called inside an autocast region, but it is not autocast-aware",
    label = "this call passes region tensors to a plain module",
    note = "add `#[autocast]` to the module's impl so it inherits the caller's policy \
            (or `#[autocast(fp16)]`/`#[keep_fp32]` for its own), or call it with explicit \
            typed tensors: `x.cast::<F32>()?`"
)]
pub trait RegionCall<Pol: Policy, Method, Args> {
    /// What the calling region gets: a region value, or a tuple of them.
    type Output;
    /// Runs the call on region values.
    fn region_call(&self, args: Args) -> Result<Self::Output>;
}

/// A module callable from an autocast region through `&mut self`: an `#[autocast]` impl whose
/// `forward` takes `&mut self` (a KV cache in a field). The calling region needs the module
/// mutably, as plain Rust would.
pub trait RegionCallMut<Pol: Policy, Method, Args> {
    /// What the calling region gets: a region value, or a tuple of them.
    type Output;
    /// Runs the call on region values.
    fn region_call_mut(&mut self, args: Args) -> Result<Self::Output>;
}

impl<Pol: Policy, M, Args, T: RegionCall<Pol, M, Args> + ?Sized> RegionCall<Pol, M, Args> for &T {
    type Output = T::Output;
    fn region_call(&self, args: Args) -> Result<T::Output> {
        (**self).region_call(args)
    }
}

/// Boxed and shared modules (`Box<dyn AmpModule>`, `Rc<Linear>`, `Arc<..>`: a layer tied in
/// two places) are called as the module itself.
macro_rules! shared_region_call {
    ($($ptr:ident)::*) => {
        impl<Pol: Policy, M, Args, T: RegionCall<Pol, M, Args> + ?Sized> RegionCall<Pol, M, Args>
            for $($ptr)::*<T>
        {
            type Output = T::Output;
            fn region_call(&self, args: Args) -> Result<T::Output> {
                (**self).region_call(args)
            }
        }
    };
}
shared_region_call!(Box);
shared_region_call!(std::rc::Rc);
shared_region_call!(std::sync::Arc);

impl<Pol: Policy, M, Args, T: RegionCallMut<Pol, M, Args> + ?Sized> RegionCallMut<Pol, M, Args>
    for Box<T>
{
    type Output = T::Output;
    fn region_call_mut(&mut self, args: Args) -> Result<T::Output> {
        (**self).region_call_mut(args)
    }
}

/// How a module call reaches the module, by which of [`RegionCall`] or [`RegionCallMut`] it
/// implements: the last parameter of [`ModuleCall`], inferred, so that the two blanket impls do
/// not overlap.
#[doc(hidden)]
#[derive(Debug)]
pub struct ViaShared;

/// See [`ViaShared`].
#[doc(hidden)]
#[derive(Debug)]
pub struct ViaMut;

/// A module call from a region given the module mutably: what the rewrite falls back to when the
/// module is not callable through `&self`.
#[doc(hidden)]
#[diagnostic::on_unimplemented(
    message = "`{Self}` is called inside an autocast region, but it is not autocast-aware, or \
               its method takes `&mut self` and the call has only a shared reference",
    label = "this call passes region tensors to a module the region cannot call",
    note = "add `#[autocast]` to the module's impl so it inherits the caller's policy \
            (or `#[autocast(fp16)]`/`#[keep_fp32]` for its own), or call it with explicit \
            typed tensors: `x.cast::<F32>()?`",
    note = "a module whose `forward` takes `&mut self` (a KV cache) needs a mutable reference \
            at the call, as in plain Rust: `&mut self` in the caller, `iter_mut()` over a stack",
    note = "a type parameter bounded by `AmpModule` is called as `x.apply(&m)`",
    note = "a layer of another crate (candle-nn's `BatchNorm`, `Sequential`, ...) cannot take \
            `#[autocast]`: use candle-amp's layer where there is one \
            (`candle_amp::nn::BatchNorm2d`, `Conv2d`, `ConvTranspose2d`, `Linear`, `LayerNorm`, \
            `RmsNorm`, `GroupNorm`, `Embedding`), or run it with its class stated: \
            `x.lower_op(|t| layer.forward(t))`, `x.fp32_op(..)`, `x.preserve_op(..)`"
)]
pub trait ModuleCall<Pol: Policy, Method, Args, Via> {
    /// What the calling region gets.
    type Output;
    /// Runs the call on region values.
    fn module_call(&mut self, args: Args) -> Result<Self::Output>;
}

impl<Pol: Policy, M, Args, T> ModuleCall<Pol, M, Args, ViaShared> for T
where
    T: RegionCall<Pol, M, Args> + ?Sized,
{
    type Output = T::Output;
    fn module_call(&mut self, args: Args) -> Result<T::Output> {
        self.region_call(args)
    }
}

impl<Pol: Policy, M, Args, T> ModuleCall<Pol, M, Args, ViaMut> for T
where
    T: RegionCallMut<Pol, M, Args> + ?Sized,
{
    type Output = T::Output;
    fn module_call(&mut self, args: Args) -> Result<T::Output> {
        self.region_call_mut(args)
    }
}

/// For each module-call name, a pair of traits with one method `__amp_NAME`. The first takes
/// `&self` and applies only to [`RegionCall`] modules, so the method probe picks it, borrowing
/// the receiver shared, whenever the module allows; otherwise the probe reaches the second, which
/// takes `&mut self`, applies to every type, and requires [`ModuleCall`]: a `&mut self` module,
/// a `&self` one reached through `&mut` (a stack walked with `iter_mut()`), or else the error
/// naming the cause.
macro_rules! module_call_traits {
    ($($name:ident => $method:ident: $by_ref:ident, $by_mut:ident;)*) => {
        /// The traits whose methods the rewrite of a module call names, `__Amp{Name}` and
        /// `__Amp{Name}Mut` for a call `name` (generated code imports them by those names).
        pub mod module_call {
            use std::marker::PhantomData;

            use super::{calls, ModuleCall, Policy, RegionCall, Result};

            $(
                #[doc = concat!("`m.", stringify!($name), "(..)` of a `&self` module.")]
                pub trait $by_ref<Pol, Args> {
                    /// What the calling region gets.
                    type Output;
                    #[doc = concat!("Calls `", stringify!($name), "` under `Pol`.")]
                    fn $method(&self, policy: PhantomData<Pol>, args: Args)
                        -> Result<Self::Output>;
                }

                impl<Pol: Policy, Args, T> $by_ref<Pol, Args> for T
                where
                    T: RegionCall<Pol, calls::$name, Args> + ?Sized,
                {
                    type Output = T::Output;
                    fn $method(&self, _: PhantomData<Pol>, args: Args) -> Result<T::Output> {
                        self.region_call(args)
                    }
                }

                #[doc = concat!("`m.", stringify!($name), "(..)` of any other module.")]
                pub trait $by_mut<Pol: Policy, Args> {
                    #[doc = concat!("Calls `", stringify!($name), "` under `Pol`.")]
                    fn $method<Via>(&mut self, policy: PhantomData<Pol>, args: Args)
                        -> Result<<Self as ModuleCall<Pol, calls::$name, Args, Via>>::Output>
                    where
                        Self: ModuleCall<Pol, calls::$name, Args, Via>;
                }

                impl<Pol: Policy, Args, T: ?Sized> $by_mut<Pol, Args> for T {
                    fn $method<Via>(&mut self, _: PhantomData<Pol>, args: Args)
                        -> Result<<Self as ModuleCall<Pol, calls::$name, Args, Via>>::Output>
                    where
                        Self: ModuleCall<Pol, calls::$name, Args, Via>,
                    {
                        self.module_call(args)
                    }
                }
            )*
        }
    };
}

module_call_traits! {
    forward => __amp_forward: __AmpForward, __AmpForwardMut;
    forward_t => __amp_forward_t: __AmpForwardT, __AmpForwardTMut;
    forward_train => __amp_forward_train: __AmpForwardTrain, __AmpForwardTrainMut;
}
