//! Results leaving a region part: a fn or method's value as its declared return type (to plain
//! code, or to a region calling it as a helper), and a module's value back to the region that
//! called it.
//!
//! What a value leaves as is decided by the type the signature resolves to, not by how it is
//! spelt: the macro wraps every returned value in a [`Leaving`] and calls `__amp_leave` on it,
//! and Rust's method probe picks the way out by the types (autoref specialisation, tried in
//! order):
//! 1. a `Result` of the declared type whose value [`ExitAs`] converts ([`LeaveConverted`]): a
//!    candle tensor in the dtype [`Leave`] chose at entry, a typed tensor as it is, plain values
//!    as they are, tuples, `Option`s, `Vec`s, arrays and `Box`es of them element by element (a value still to be
//!    inferred, `Ok(iter.collect())`, takes the declared type here);
//! 2. a value of the declared type that is not such a `Result` ([`LeaveAsIs`]): unchanged
//!    (`Ok(Self { .. })`, a `String`);
//! 3. a `Result` of another value that converts to the declared one ([`LeaveAsDeclared`]): a
//!    region value as the declared `Tensor<Q>`, cast to `Q`;
//! 4. none of these ([`LeaveUnsupported`]): a compile error naming the two types and the forms
//!    that leave.

use std::cell::Cell;
use std::marker::PhantomData;

use candle_core::{DType, Result};

use super::value::{floating, AmpTensor, AsAmp, Operand, RegionValue};
use crate::autocast_state;
use crate::cast::convert;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// How a region part's results leave it, decided when the part is entered.
#[derive(Clone, Copy, Debug)]
pub struct Leave {
    /// The dtype a candle tensor result leaves in; `None`: as the body made it.
    candle: Option<DType>,
    /// The precision `output = ..` declares.
    declared: Option<DType>,
}

impl Leave {
    /// Called at a part's entry, before it pushes its own policy, with the dtypes of its tensor
    /// parameters and the precision `output = ..` declares. A candle tensor result leaves in the
    /// declared precision; else, when a region is running on the thread (the part is a helper
    /// or module a region called), as the body made it, as PyTorch's autocast returns it; else
    /// (called from plain code) in the first floating input's dtype (f32 when no input is
    /// floating), so that the candle code it returns to computes as it did before the port: an
    /// f32 program stays f32 outside its regions.
    pub fn at_entry(inputs: &[Option<DType>], declared: Option<DType>) -> Self {
        let from_region = autocast_state::innermost_region().is_some();
        let input = inputs.iter().flatten().copied().next();
        Self {
            candle: declared.or((!from_region).then(|| input.unwrap_or(DType::F32))),
            declared,
        }
    }

    /// Results as the body made them, in the precision a typed result's type names: how an op
    /// taken as a value returns (`super::taken`).
    pub(crate) fn as_made() -> Self {
        Self {
            candle: None,
            declared: None,
        }
    }
}

/// A tensor parameter's dtype for [`Leave::at_entry`], when it is floating.
pub fn floating_dtype<T: AsAmp + ?Sized>(x: &T) -> Option<DType> {
    let x = x.to_amp();
    floating(&x).then(|| x.dtype())
}

/// A region part's returned value `V` on its way out as the declared type `D`; see the module
/// doc for the three ways out.
pub struct Leaving<D, V> {
    value: Cell<Option<V>>,
    leave: Leave,
    declared: PhantomData<fn() -> D>,
}

impl<D, V> std::fmt::Debug for Leaving<D, V> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Leaving")
            .field("leave", &self.leave)
            .finish_non_exhaustive()
    }
}

impl<D, V> Leaving<D, V> {
    /// Wraps a returned value.
    pub fn new(value: V, leave: Leave) -> Self {
        Self {
            value: Cell::new(Some(value)),
            leave,
            declared: PhantomData,
        }
    }

    /// The value; a `Leaving` is built for one `__amp_leave` call, which takes it once.
    fn take(&self) -> V {
        match self.value.take() {
            Some(v) => v,
            None => unreachable!("a returned value leaves once"),
        }
    }
}

/// Way out 1: a `Result` of the declared type, converted by `ExitAs`.
pub trait LeaveConverted<D> {
    /// The value as declared.
    fn __amp_leave(self) -> D;
}

impl<D: ExitAs<D>, E: From<candle_core::Error>> LeaveConverted<std::result::Result<D, E>>
    for &&&Leaving<std::result::Result<D, E>, std::result::Result<D, E>>
{
    fn __amp_leave(self) -> std::result::Result<D, E> {
        self.take()
            .and_then(|a| a.exit_as(self.leave).map_err(E::from))
    }
}

/// Way out 2: a value of the declared type, unchanged.
pub trait LeaveAsIs<D> {
    /// The value as declared.
    fn __amp_leave(self) -> D;
}

impl<D> LeaveAsIs<D> for &&Leaving<D, D> {
    fn __amp_leave(self) -> D {
        self.take()
    }
}

/// Way out 3: a `Result` of another value, converted to the declared one by `ExitAs`.
pub trait LeaveAsDeclared<D> {
    /// The value as declared.
    fn __amp_leave(self) -> D;
}

impl<D, A: ExitAs<D>, E: From<candle_core::Error>> LeaveAsDeclared<std::result::Result<D, E>>
    for &Leaving<std::result::Result<D, E>, std::result::Result<A, E>>
{
    fn __amp_leave(self) -> std::result::Result<D, E> {
        self.take()
            .and_then(|a| a.exit_as(self.leave).map_err(E::from))
    }
}

/// No way out: a value none of the three ways takes (a region value as `-> Option<Tensor<F32>>`
/// without a `Result`, a map of region values). Probed last, it is picked only then,
/// and its bound fails with `CannotLeave`'s message, where rustc would otherwise say only that
/// no method `__amp_leave` fits.
pub trait LeaveUnsupported<D, V> {
    /// Never compiles: `V: CannotLeave<D>` holds for no types.
    fn __amp_leave(self) -> D
    where
        V: CannotLeave<D>;
}

impl<D, V> LeaveUnsupported<D, V> for Leaving<D, V> {
    fn __amp_leave(self) -> D
    where
        V: CannotLeave<D>,
    {
        unreachable!("`CannotLeave` has no implementations")
    }
}

/// The bound a value that cannot leave a region as its declared type fails; implemented by
/// nothing.
#[diagnostic::on_unimplemented(
    message = "this region's value `{Self}` cannot leave it as the declared `{D}`",
    label = "returned as `{D}`",
    note = "tensors leave a region through a `Result` (`-> Result<Tensor<F32>>`, not \
            `-> Tensor<F32>` or `-> Option<Tensor<F32>>`): as the `Tensor<P>` or candle `Tensor` \
            declared, or in a tuple, `Option`, `Vec`, array or `Box` of them",
    note = "for a map or another container of tensors, declare a `Vec`, an array or a tuple, or \
            convert each tensor before it goes in (`RegionValue::cast`: `y.cast::<F32>()?`): \
            then the value is the declared type and leaves as it is",
    note = "a value the declared type needs coerced (a boxed closure returned as \
            `Box<dyn Fn ..>`, an array's reference returned as a slice) is coerced where it is \
            built: `Ok(Box::new(f) as Box<dyn Fn(..)>)`, `Ok((y, &[1, 2][..]))`"
)]
pub trait CannotLeave<D> {}

/// A region's value leaving as declared type `D`.
#[diagnostic::on_unimplemented(
    message = "a region cannot return `{Self}` as `{D}`",
    label = "this value leaves the region as `{D}`",
    note = "a region's result is a tensor (a region value, a typed or a candle tensor) leaving \
            as the `Tensor<P>` or candle `Tensor` the signature declares, or a tuple, `Option` \
            or `Vec` of them"
)]
pub trait ExitAs<D> {
    /// The value as `D`.
    fn exit_as(self, leave: Leave) -> Result<D>;
}

/// A typed result: cast to the precision the signature names, which `output = ..` may only
/// repeat (the macro checks a spelt precision; this one behind an alias or a bare `Tensor`).
impl<A: Operand, Q: Precision> ExitAs<Tensor<Q>> for A {
    fn exit_as(self, leave: Leave) -> Result<Tensor<Q>> {
        if let Some(declared) = leave.declared.filter(|&d| d != Q::DTYPE) {
            candle_core::bail!(
                "`output = {declared:?}` contradicts the signature, which returns Tensor<{:?}>: \
                 a typed result leaves in the precision its type names",
                Q::DTYPE
            )
        }
        self.operand().cast::<Q>()
    }
}

/// A candle tensor result (a region value): in the dtype [`Leave::at_entry`] chose, an integer
/// tensor as it is.
impl<A: Operand> ExitAs<candle_core::Tensor> for A {
    fn exit_as(self, leave: Leave) -> Result<candle_core::Tensor> {
        let t = self.operand();
        match leave.candle {
            Some(d) if floating(&t) => convert(&t, d),
            _ => Ok(t),
        }
    }
}

/// What a module method's declared result is in the calling region: tensors become region
/// values (candle tensors), tuples element by element.
pub trait RegionResult {
    /// The type the calling region gets.
    type Region;

    /// The region form with each tensor cast to `dtype` (a module's declared `output = ..`);
    /// plain values as they are.
    fn cast_region(value: Self::Region, dtype: DType) -> Result<Self::Region>;
}

/// A typed result's region form: a region value.
impl<P: Precision> RegionResult for Tensor<P> {
    type Region = AmpTensor;
    fn cast_region(value: AmpTensor, dtype: DType) -> Result<AmpTensor> {
        convert(&value, dtype)
    }
}

/// A region value's (a candle tensor's) region form: itself; an integer one never cast.
impl RegionResult for candle_core::Tensor {
    type Region = candle_core::Tensor;
    fn cast_region(value: candle_core::Tensor, dtype: DType) -> Result<candle_core::Tensor> {
        if floating(&value) {
            convert(&value, dtype)
        } else {
            Ok(value)
        }
    }
}

/// Plain values a region or a module method returns beside (or instead of) tensors: passed back
/// as they are. Each one listed here lets a tuple, `Option`, `Vec`, array or `Box` holding it
/// convert its tensors element by element (a value outside the list makes the whole container
/// leave unchanged, its tensors too: `(logits, label)` with a `String` label left the logits in
/// bf16 where `(logits, 1usize)` gave f32), so the list holds what models return beside
/// tensors: numbers, text, dtypes, shapes, devices, durations, and any borrowed value below.
macro_rules! plain_results {
    ($($t:ty),*) => {$(
        impl RegionResult for $t {
            type Region = $t;
            fn cast_region(value: $t, _: DType) -> Result<$t> {
                Ok(value)
            }
        }
        impl IntoRegion<$t> for $t {
            fn into_region(self) -> $t {
                self
            }
        }
        impl ExitAs<$t> for $t {
            fn exit_as(self, _: Leave) -> Result<$t> {
                Ok(self)
            }
        }
    )*};
}
plain_results!(
    (),
    bool,
    char,
    u8,
    u16,
    u32,
    u64,
    usize,
    i8,
    i16,
    i32,
    i64,
    i128,
    u128,
    isize,
    f32,
    f64,
    half::f16,
    half::bf16,
    String,
    DType,
    candle_core::Shape,
    candle_core::Device,
    std::time::Duration
);

/// A borrowed value beside tensors (a label `&str`, a shape `&[usize]`): as it is. A borrowed
/// tensor cannot be converted, and leaves as it is too.
impl<'a, T: ?Sized> RegionResult for &'a T {
    type Region = &'a T;
    fn cast_region(value: &'a T, _: DType) -> Result<&'a T> {
        Ok(value)
    }
}

impl<'a, T: ?Sized> IntoRegion<&'a T> for &'a T {
    fn into_region(self) -> &'a T {
        self
    }
}

impl<'a, T: ?Sized> ExitAs<&'a T> for &'a T {
    fn exit_as(self, _: Leave) -> Result<&'a T> {
        Ok(self)
    }
}

/// The `Ok` type of a module method's declared `Result`, whatever spells it (an alias too).
pub trait RegionReturn {
    /// The declared `Ok` type.
    type Ok: RegionResult;
}

impl<T: RegionResult, E> RegionReturn for std::result::Result<T, E> {
    type Ok = T;
}

/// The region form of a module method's declared return type `R`.
pub type RegionOutput<R> = <<R as RegionReturn>::Ok as RegionResult>::Region;

/// A module body's value given back to the calling region as declared type `D`'s region form.
#[diagnostic::on_unimplemented(
    message = "a module called from a region cannot return `{Self}` as `{D}`",
    label = "this value goes back to the calling region as `{D}`",
    note = "a module method returns tensors (region values, typed or candle tensors) declared \
            as `AmpTensor`, `Tensor<P>` or `candle_core::Tensor`, plain values (`usize`, `bool`, \
            `f32`, `f64`, `DType`, ...), or a tuple, `Option` or `Vec` of them"
)]
pub trait IntoRegion<D: RegionResult> {
    /// The value in region form.
    fn into_region(self) -> D::Region;
}

impl<A: Operand, P: Precision> IntoRegion<Tensor<P>> for A {
    fn into_region(self) -> AmpTensor {
        self.operand()
    }
}

impl<A: Operand> IntoRegion<candle_core::Tensor> for A {
    fn into_region(self) -> candle_core::Tensor {
        self.operand()
    }
}

/// Tuples of results, element by element: `(k, v)` from a module holding a KV cache.
macro_rules! tuple_results {
    ($(($($a:ident $d:ident $i:tt),+))*) => {$(
        impl<$($d: RegionResult),+> RegionResult for ($($d,)+) {
            type Region = ($($d::Region,)+);
            fn cast_region(value: Self::Region, dtype: DType) -> Result<Self::Region> {
                Ok(($($d::cast_region(value.$i, dtype)?,)+))
            }
        }

        impl<$($a, $d),+> ExitAs<($($d,)+)> for ($($a,)+)
        where
            $($a: ExitAs<$d>),+
        {
            fn exit_as(self, leave: Leave) -> Result<($($d,)+)> {
                Ok(($(self.$i.exit_as(leave)?,)+))
            }
        }

        impl<$($a, $d: RegionResult),+> IntoRegion<($($d,)+)> for ($($a,)+)
        where
            $($a: IntoRegion<$d>),+
        {
            fn into_region(self) -> ($($d::Region,)+) {
                ($(self.$i.into_region(),)+)
            }
        }
    )*};
}

tuple_results! {
    (A0 D0 0, A1 D1 1)
    (A0 D0 0, A1 D1 1, A2 D2 2)
    (A0 D0 0, A1 D1 1, A2 D2 2, A3 D3 3)
    (A0 D0 0, A1 D1 1, A2 D2 2, A3 D3 3, A4 D4 4)
    (A0 D0 0, A1 D1 1, A2 D2 2, A3 D3 3, A4 D4 4, A5 D5 5)
    (A0 D0 0, A1 D1 1, A2 D2 2, A3 D3 3, A4 D4 4, A5 D5 5, A6 D6 6)
    (A0 D0 0, A1 D1 1, A2 D2 2, A3 D3 3, A4 D4 4, A5 D5 5, A6 D6 6, A7 D7 7)
}

/// `Option`s and `Vec`s of results, element by element: a module returning an optional cache
/// or one tensor per head, a region returning `Result<Option<Tensor<F32>>>`.
impl<D: RegionResult> RegionResult for Option<D> {
    type Region = Option<D::Region>;
    fn cast_region(value: Self::Region, dtype: DType) -> Result<Self::Region> {
        value.map(|v| D::cast_region(v, dtype)).transpose()
    }
}

impl<V: ExitAs<D>, D> ExitAs<Option<D>> for Option<V> {
    fn exit_as(self, leave: Leave) -> Result<Option<D>> {
        self.map(|v| v.exit_as(leave)).transpose()
    }
}

impl<V: IntoRegion<D>, D: RegionResult> IntoRegion<Option<D>> for Option<V> {
    fn into_region(self) -> Option<D::Region> {
        self.map(IntoRegion::into_region)
    }
}

impl<D: RegionResult> RegionResult for Vec<D> {
    type Region = Vec<D::Region>;
    fn cast_region(value: Self::Region, dtype: DType) -> Result<Self::Region> {
        value
            .into_iter()
            .map(|v| D::cast_region(v, dtype))
            .collect()
    }
}

impl<V: ExitAs<D>, D> ExitAs<Vec<D>> for Vec<V> {
    fn exit_as(self, leave: Leave) -> Result<Vec<D>> {
        self.into_iter().map(|v| v.exit_as(leave)).collect()
    }
}

impl<V: IntoRegion<D>, D: RegionResult> IntoRegion<Vec<D>> for Vec<V> {
    fn into_region(self) -> Vec<D::Region> {
        self.into_iter().map(IntoRegion::into_region).collect()
    }
}

/// Arrays and boxes of a region's results, element by element, as `Vec`s.
impl<V: ExitAs<D>, D, const N: usize> ExitAs<[D; N]> for [V; N] {
    fn exit_as(self, leave: Leave) -> Result<[D; N]> {
        let items: Vec<D> = self
            .into_iter()
            .map(|v| v.exit_as(leave))
            .collect::<Result<_>>()?;
        match items.try_into() {
            Ok(array) => Ok(array),
            Err(_) => unreachable!("N values map to N values"),
        }
    }
}

impl<V: ExitAs<D>, D> ExitAs<Box<D>> for Box<V> {
    fn exit_as(self, leave: Leave) -> Result<Box<D>> {
        (*self).exit_as(leave).map(Box::new)
    }
}

/// A module body's result returned to a calling region (a module call) in region form: the
/// declared return type `R` (`Result<Tensor<F32>>`, `Result<(Tensor<F32>, Tensor<F32>)>`)
/// says which.
pub fn exit_to_region<R: RegionReturn, A: IntoRegion<R::Ok>, E>(
    r: std::result::Result<A, E>,
) -> std::result::Result<RegionOutput<R>, E> {
    r.map(IntoRegion::into_region)
}

/// [`exit_to_region`] for a module that declares `output = f32|f16|bf16`: its tensors go back
/// to the calling region in that precision `P`, as the declaration says (not as the body made
/// them).
pub fn exit_to_region_as<R: RegionReturn, P: Precision, A: IntoRegion<R::Ok>, E>(
    r: std::result::Result<A, E>,
) -> std::result::Result<RegionOutput<R>, E>
where
    E: From<candle_core::Error>,
{
    let value = r.map(IntoRegion::into_region)?;
    Ok(<R::Ok as RegionResult>::cast_region(value, P::DTYPE)?)
}
