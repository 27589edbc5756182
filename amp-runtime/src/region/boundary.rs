//! Region boundaries, called by generated code: parameters entering a region, results leaving
//! it, and the dtype plumbing of `#[custom_fwd]`/`#[custom_bwd]`.

use std::cell::Cell;

use candle_core::{DType, Result};

use super::policy::{Policy, PolicyScope};
use super::value::{AmpTensor, AsAmp, Operand};
use crate::cast::convert;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A tensor parameter type a region accepts, as declared, and what the body sees of it:
/// `Tensor<P>` enters as a region value, a plain `candle_core::Tensor` (token ids, masks,
/// positions) as itself, never cast.
pub trait RegionParam {
    /// The value the region body works with.
    type Value;
}

impl<P: Precision> RegionParam for Tensor<P> {
    type Value = AmpTensor;
}

impl RegionParam for candle_core::Tensor {
    type Value = candle_core::Tensor;
}

/// An argument for a parameter declared `D` (any tensor a region can use for a `Tensor<P>`; a
/// candle tensor for a `candle_core::Tensor`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be passed for a parameter declared `{D}` in an autocast region",
    label = "expected an argument for a `{D}` parameter",
    note = "a `Tensor<P>` parameter takes typed tensors and region values; a \
            `candle_core::Tensor` parameter (ids, masks) takes a candle tensor, passed through"
)]
pub trait EnterAs<D: RegionParam> {
    /// The argument as the body sees it.
    fn enter_as(&self) -> D::Value;
    /// The same in a `#[keep_fp32]` part: floating values upcast to f32.
    fn enter_as_fp32(&self) -> Result<D::Value>;
}

impl<P: Precision, A: AsAmp + ?Sized> EnterAs<Tensor<P>> for A {
    fn enter_as(&self) -> AmpTensor {
        self.to_amp()
    }
    fn enter_as_fp32(&self) -> Result<AmpTensor> {
        self.to_amp().to_dtype(DType::F32)
    }
}

impl EnterAs<candle_core::Tensor> for candle_core::Tensor {
    fn enter_as(&self) -> candle_core::Tensor {
        self.clone()
    }
    fn enter_as_fp32(&self) -> Result<candle_core::Tensor> {
        Ok(self.clone())
    }
}

impl<T: EnterAs<candle_core::Tensor> + ?Sized> EnterAs<candle_core::Tensor> for &T {
    fn enter_as(&self) -> candle_core::Tensor {
        (**self).enter_as()
    }
    fn enter_as_fp32(&self) -> Result<candle_core::Tensor> {
        (**self).enter_as_fp32()
    }
}

/// A parameter declared `D` entering a region.
pub fn enter<D: RegionParam, A: EnterAs<D> + ?Sized>(a: &A) -> D::Value {
    a.enter_as()
}

/// A parameter declared `D` entering a `#[keep_fp32]` part: upcast to f32 at the boundary.
pub fn enter_fp32<D: RegionParam, A: EnterAs<D> + ?Sized>(a: &A) -> Result<D::Value> {
    a.enter_as_fp32()
}

/// An input of a `#[custom_fwd(cast_inputs = ..)]` op: any tensor, typed or a region value,
/// cast to the op's declared precision `Q`.
pub fn enter_cast<Q: Precision, A: EnterAs<Tensor<Q>> + ?Sized>(a: &A) -> Result<Tensor<Q>> {
    a.enter_as().cast::<Q>()
}

/// `#[custom_bwd]`: the incoming gradient in the dtype the forward produced.
pub fn grad_like(
    grad: &candle_core::Tensor,
    res: &candle_core::Tensor,
) -> Result<candle_core::Tensor> {
    convert(grad, res.dtype())
}

/// `#[custom_bwd]`: each returned gradient in the dtype of the input it belongs to (candle
/// accumulates gradients with `add`, which fails on mixed dtypes).
pub trait GradsLike<Inputs> {
    /// Casts each present gradient to its input's dtype.
    fn like(self, inputs: Inputs) -> Result<Self>
    where
        Self: Sized;
}

fn grad_as(
    g: Option<candle_core::Tensor>,
    input: &candle_core::Tensor,
) -> Result<Option<candle_core::Tensor>> {
    g.map(|g| convert(&g, input.dtype())).transpose()
}

impl GradsLike<(&candle_core::Tensor,)> for Option<candle_core::Tensor> {
    fn like(self, (a,): (&candle_core::Tensor,)) -> Result<Self> {
        grad_as(self, a)
    }
}

impl GradsLike<(&candle_core::Tensor, &candle_core::Tensor)>
    for (Option<candle_core::Tensor>, Option<candle_core::Tensor>)
{
    fn like(self, (a, b): (&candle_core::Tensor, &candle_core::Tensor)) -> Result<Self> {
        Ok((grad_as(self.0, a)?, grad_as(self.1, b)?))
    }
}

impl
    GradsLike<(
        &candle_core::Tensor,
        &candle_core::Tensor,
        &candle_core::Tensor,
    )>
    for (
        Option<candle_core::Tensor>,
        Option<candle_core::Tensor>,
        Option<candle_core::Tensor>,
    )
{
    fn like(
        self,
        (a, b, c): (
            &candle_core::Tensor,
            &candle_core::Tensor,
            &candle_core::Tensor,
        ),
    ) -> Result<Self> {
        Ok((
            grad_as(self.0, a)?,
            grad_as(self.1, b)?,
            grad_as(self.2, c)?,
        ))
    }
}

/// A region's result leaving as the type the signature declares: a typed tensor `Tensor<Q>`
/// (cast to `Q`) or a tuple of them (each element cast).
pub fn exit<D, A: ExitAs<D>, E: From<candle_core::Error>>(
    r: std::result::Result<A, E>,
) -> std::result::Result<D, E> {
    r.and_then(|a| a.exit_as().map_err(E::from))
}

/// A region's value leaving as declared type `D` (see [`exit`]).
#[diagnostic::on_unimplemented(
    message = "a region cannot return `{Self}` as `{D}`",
    label = "this value leaves the region as `{D}`",
    note = "a region's result is a tensor (a region value, a typed or a candle tensor) leaving \
            as the `Tensor<P>` the signature declares, or a tuple, `Option` or `Vec` of them"
)]
pub trait ExitAs<D> {
    /// The value as `D`.
    fn exit_as(self) -> Result<D>;
}

impl<A: Operand, Q: Precision> ExitAs<Tensor<Q>> for A {
    fn exit_as(self) -> Result<Tensor<Q>> {
        self.operand().cast::<Q>()
    }
}

/// What a module method's declared result is in the calling region: tensors become region
/// values ([`AmpTensor`]), tuples element by element.
pub trait RegionResult {
    /// The type the calling region gets.
    type Region;

    /// The region form with each tensor cast to `dtype` (a module's declared `output = ..`);
    /// plain values as they are.
    fn cast_region(value: Self::Region, dtype: DType) -> Result<Self::Region>;
}

/// A tensor result's region form cast to a declared output precision.
macro_rules! tensor_results {
    ($($t:ty),*) => {$(
        impl RegionResult for $t {
            type Region = AmpTensor;
            fn cast_region(value: AmpTensor, dtype: DType) -> Result<AmpTensor> {
                AmpTensor::new(convert(value.as_candle(), dtype)?)
            }
        }
    )*};
}
tensor_results!(AmpTensor, candle_core::Tensor);

impl<P: Precision> RegionResult for Tensor<P> {
    type Region = AmpTensor;
    fn cast_region(value: AmpTensor, dtype: DType) -> Result<AmpTensor> {
        AmpTensor::new(convert(value.as_candle(), dtype)?)
    }
}

/// Plain values a module method returns beside (or instead of) tensors: passed back as they are.
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
            fn exit_as(self) -> Result<$t> {
                Ok(self)
            }
        }
    )*};
}
plain_results!((), bool, usize, u32, i64, f32, f64, DType);

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

impl<A: Operand> IntoRegion<AmpTensor> for A {
    fn into_region(self) -> AmpTensor {
        self.operand()
    }
}

impl<A: Operand> IntoRegion<candle_core::Tensor> for A {
    fn into_region(self) -> AmpTensor {
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
            fn exit_as(self) -> Result<($($d,)+)> {
                Ok(($(self.$i.exit_as()?,)+))
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
    fn exit_as(self) -> Result<Option<D>> {
        self.map(ExitAs::exit_as).transpose()
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
    fn exit_as(self) -> Result<Vec<D>> {
        self.into_iter().map(ExitAs::exit_as).collect()
    }
}

impl<V: IntoRegion<D>, D: RegionResult> IntoRegion<Vec<D>> for Vec<V> {
    fn into_region(self) -> Vec<D::Region> {
        self.into_iter().map(IntoRegion::into_region).collect()
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

/// The input of an `#[autocast] impl candle_nn::Module`: the candle tensor is the activation, a
/// region value (f32, f16 or bf16).
pub fn enter_activation(xs: &candle_core::Tensor) -> Result<AmpTensor> {
    AmpTensor::from_candle_value(xs)
}

thread_local! {
    /// Set by [`candle_module_call`] for the `#[autocast] impl candle_nn::Module` it calls, and
    /// taken by that module's entry ([`candle_exit_dtype`]) before its body runs: only the module
    /// a region calls (not the candle modules it calls in turn) keeps its result a region value.
    static CALLED_FROM_REGION: Cell<bool> = const { Cell::new(false) };
}

/// The dtype an `#[autocast] impl candle_nn::Module`'s result leaves in, decided at its entry:
/// `declared` (`output = ..`), else the input's, so that the module drops into candle code of
/// that dtype; `None` (no cast, the body's result as it is, as PyTorch returns it) when a region
/// called it.
pub fn candle_exit_dtype(input: DType, declared: Option<DType>) -> Option<DType> {
    let from_region = CALLED_FROM_REGION.replace(false);
    declared.or((!from_region).then_some(input))
}

/// The result of an `#[autocast] impl candle_nn::Module`: a candle tensor in `dtype` (see
/// [`candle_exit_dtype`]).
pub fn exit_like<A: Operand, E: From<candle_core::Error>>(
    r: std::result::Result<A, E>,
    dtype: Option<DType>,
) -> std::result::Result<candle_core::Tensor, E> {
    r.and_then(|a| {
        let t = a.operand();
        match dtype {
            Some(d) => convert(t.as_candle(), d).map_err(E::from),
            None => Ok(t.as_candle().clone()),
        }
    })
}

/// An `#[autocast] impl candle_nn::Module` called from a region: `forward` (the trait's method)
/// gets the region value's tensor, runs under the calling region's policy (or the module's own),
/// and its result comes back as the region value its body made, uncast.
pub fn candle_module_call<Pol: Policy>(
    x: &AmpTensor,
    forward: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
) -> Result<AmpTensor> {
    let _policy = PolicyScope::enter::<Pol>();
    CALLED_FROM_REGION.set(true);
    let out = forward(x.as_candle());
    CALLED_FROM_REGION.set(false);
    AmpTensor::new(out?)
}
