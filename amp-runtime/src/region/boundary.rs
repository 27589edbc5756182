//! Region boundaries, called by generated code: parameters entering a region, a candle module's
//! call from one, and the dtype plumbing of `#[custom_fwd]`/`#[custom_bwd]` (results leave
//! through `exit.rs`).

use candle_core::{DType, Result};

use super::policy::{Policy, PolicyScope};
use super::value::{floating, AmpTensor, AsAmp};
use crate::autocast_state::run_op;
use crate::cast::convert;
use crate::op::OpClass;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A tensor parameter type a region accepts, as declared, and what the body sees of it:
/// `Tensor<P>` enters as a region value, a `candle_core::Tensor` as a candle tensor (a region
/// tensor all the same: its ops are routed, and it still goes wherever candle code takes a
/// `Tensor`).
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

/// An argument for a parameter declared `D`: any tensor a region can use (typed, candle, a
/// region value), by reference or not.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be passed for a parameter declared `{D}` in an autocast region",
    label = "expected a tensor for a `{D}` parameter",
    note = "a tensor parameter of an autocast fn or module takes typed tensors, candle tensors \
            and region values"
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
        upcast(self.to_amp())
    }
}

impl<A: AsAmp + ?Sized> EnterAs<candle_core::Tensor> for A {
    fn enter_as(&self) -> candle_core::Tensor {
        self.to_amp()
    }
    fn enter_as_fp32(&self) -> Result<candle_core::Tensor> {
        upcast(self.to_amp())
    }
}

/// An argument for a parameter declared `Tensor<P>` or `&Tensor<P>` of an `#[autocast]` or
/// `#[keep_fp32]` fn or inherent method: a `Tensor<P>`, or a value computed in a calling region
/// (a candle tensor, in the precision its ops gave it), directly or through a reference, `Box`,
/// `Rc`, `Arc` or a `RefCell`/`Mutex`/`RwLock` guard. The macro declares such a parameter
/// `&(impl TensorArg<P> + ?Sized)` (by value: `impl TensorArg<P>`), so that a region hands its
/// values to a typed helper as PyTorch code hands tensors to a function; a typed tensor of
/// another precision stays a compile error.
#[diagnostic::on_unimplemented(
    message = "`{Self}` cannot be passed for a `Tensor<{P}>` parameter of an autocast fn",
    label = "expected a `Tensor<{P}>` or a value computed in a region",
    note = "a typed tensor of another precision is cast first: `x.cast::<{P}>()?`"
)]
pub trait TensorArg<P: Precision>: AsAmp {}

impl<P: Precision> TensorArg<P> for Tensor<P> {}

impl<P: Precision> TensorArg<P> for candle_core::Tensor {}

/// The references and smart pointers a typed parameter reached by deref coercion before the
/// macro made it generic.
macro_rules! tensor_arg_through {
    ($($ptr:ty),* $(,)?) => {
        $(impl<P: Precision, T: TensorArg<P> + ?Sized> TensorArg<P> for $ptr {})*
    };
}

tensor_arg_through!(
    &T,
    &mut T,
    Box<T>,
    std::rc::Rc<T>,
    std::sync::Arc<T>,
    std::cell::Ref<'_, T>,
    std::cell::RefMut<'_, T>,
    std::sync::MutexGuard<'_, T>,
    std::sync::RwLockReadGuard<'_, T>,
    std::sync::RwLockWriteGuard<'_, T>,
);

/// A value entering a `#[keep_fp32]` part: f32 if floating, an integer tensor as it is.
fn upcast(x: AmpTensor) -> Result<AmpTensor> {
    if floating(&x) {
        convert(&x, DType::F32)
    } else {
        Ok(x)
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
/// cast to the op's declared precision `Q`. The cast is an op of the precision report and the
/// finite check (`cast_inputs`, at the op's site): an f32 `1e5` given to a `cast_inputs = f16`
/// op becomes `inf` here.
pub fn enter_cast<Q: Precision, A: EnterAs<Tensor<Q>> + ?Sized>(a: &A) -> Result<Tensor<Q>> {
    let x = a.enter_as();
    let class = if Q::DTYPE == DType::F32 {
        OpClass::Fp32
    } else {
        OpClass::LowerPrecision
    };
    let cast = run_op(
        "cast_inputs",
        class,
        || vec![&x],
        Some(Q::DTYPE),
        |_| convert(&x, Q::DTYPE),
    )?;
    Ok(Tensor::wrap(cast))
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

/// A returned gradient checked against its input's shape (candle would report a mismatch in
/// its `add`, naming neither the op nor the input) and cast to its dtype. `None` for an input
/// computed by another op becomes zeros: candle's backward panics on a node it expected a
/// gradient for ("grad not populated"), where PyTorch treats `None` as no contribution. A
/// variable's `None` stays `None` (no gradient, as PyTorch's).
fn grad_as(
    g: Option<candle_core::Tensor>,
    input: &candle_core::Tensor,
) -> Result<Option<candle_core::Tensor>> {
    match g {
        Some(g) if g.dims() != input.dims() => candle_core::bail!(
            "#[custom_bwd]: a returned gradient has shape {:?}, its input {:?}: each gradient \
             has its input's shape",
            g.dims(),
            input.dims()
        ),
        Some(g) => convert(&g, input.dtype()).map(Some),
        None if input.track_op() && !input.is_variable() => input.zeros_like().map(Some),
        None => Ok(None),
    }
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

/// An `#[autocast] impl candle_nn::Module` called from a region: `forward` (the trait's method)
/// gets the input's tensor, runs under the calling region's policy (or the module's own), and
/// its result comes back as its body made it, uncast (its exit sees the calling region's frame:
/// [`Leave::at_entry`](super::exit::Leave::at_entry)), of the input's kind.
pub fn candle_module_call<Pol: Policy, A: AsAmp>(
    x: A,
    forward: impl FnOnce(&candle_core::Tensor) -> Result<candle_core::Tensor>,
) -> Result<AmpTensor> {
    let _policy = PolicyScope::enter::<Pol>();
    forward(&x.to_amp())
}
