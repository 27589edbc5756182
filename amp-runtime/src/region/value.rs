//! Region values: the tensors a region body computes with.

use candle_core::{DType, Result};

use crate::cast::convert;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A tensor inside an autocast region: a candle tensor. Its dtype is f32, f16 or bf16, decided
/// by the ops that made it, or an integer dtype (token ids, positions, a mask), which no op
/// casts: PyTorch's autocast casts floating tensors only.
///
/// Region code is candle code: the values a body computes are candle's `Tensor`s, so they go
/// wherever candle code takes one (a helper's `&Tensor` parameter, a field, `Tensor::cat`),
/// while the macro routes each op on them by its class. Leave a region as a typed tensor with
/// [`RegionValue::cast`] (the macro does it for a `Tensor<P>` the signature returns).
pub type AmpTensor = candle_core::Tensor;

/// What a region value offers beyond candle's methods.
pub trait RegionValue {
    /// A typed tensor of precision `Q` (a cast when the dtype differs, from the weight-cast
    /// cache for a master weight).
    fn cast<Q: Precision>(&self) -> Result<Tensor<Q>>;
}

impl RegionValue for candle_core::Tensor {
    fn cast<Q: Precision>(&self) -> Result<Tensor<Q>> {
        Ok(Tensor::wrap(convert(self, Q::DTYPE)?))
    }
}

/// Anything that enters a region as a tensor value: typed tensors, candle tensors and region
/// values, by reference or not.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor an autocast region can use",
    label = "expected a tensor here",
    note = "inside `#[autocast]` tensors are `candle_core::Tensor`s, typed tensors \
            (`Tensor<F32>`/`Tensor<F16>`/`Tensor<BF16>`) or values computed in the region, or a \
            reference, `Box`, `Rc`, `Arc` or lock guard of one"
)]
pub trait AsAmp {
    /// The value as a region tensor (a handle clone).
    fn to_amp(&self) -> AmpTensor;
}

impl AsAmp for candle_core::Tensor {
    fn to_amp(&self) -> AmpTensor {
        self.clone()
    }
}

impl<P: Precision> AsAmp for Tensor<P> {
    fn to_amp(&self) -> AmpTensor {
        self.as_candle().clone()
    }
}

/// References, smart pointers and the standard library's borrow guards to tensors (a weight
/// shared as `Arc<Tensor<F32>>`, a `&mut` one, a `RefCell`'s borrow, a `Mutex`'s guard): routed
/// like the tensor they reach. Without these a method call on one would find the typed tensor's
/// method through `Deref`: it would still run where the region's policy puts it (typed ops
/// follow the thread's region), but return a typed tensor cast back to its own precision
/// instead of a region value. (One
/// blanket impl over `Deref` would cover a user's newtypes too, but overlaps the impl for
/// candle's `Tensor`, which candle could make `Deref` one day: a type of the user's that derefs
/// to a tensor implements `AsAmp` itself.)
macro_rules! as_amp_through {
    ($($ptr:ident)::+) => {
        impl<T: AsAmp + ?Sized> AsAmp for $($ptr)::+<T> {
            fn to_amp(&self) -> AmpTensor {
                (**self).to_amp()
            }
        }
    };
    ($($ptr:ident)::+ <'_>) => {
        impl<T: AsAmp + ?Sized> AsAmp for $($ptr)::+<'_, T> {
            fn to_amp(&self) -> AmpTensor {
                (**self).to_amp()
            }
        }
    };
}
as_amp_through!(Box);
as_amp_through!(std::rc::Rc);
as_amp_through!(std::sync::Arc);
as_amp_through!(std::cell::Ref<'_>);
as_amp_through!(std::cell::RefMut<'_>);
as_amp_through!(std::sync::MutexGuard<'_>);
as_amp_through!(std::sync::RwLockReadGuard<'_>);
as_amp_through!(std::sync::RwLockWriteGuard<'_>);

impl<T: AsAmp + ?Sized> AsAmp for &T {
    fn to_amp(&self) -> AmpTensor {
        (**self).to_amp()
    }
}

impl<T: AsAmp + ?Sized> AsAmp for &mut T {
    fn to_amp(&self) -> AmpTensor {
        (**self).to_amp()
    }
}

impl<T: AsAmp + ToOwned + ?Sized> AsAmp for std::borrow::Cow<'_, T> {
    fn to_amp(&self) -> AmpTensor {
        (**self).to_amp()
    }
}

impl<P: std::ops::Deref> AsAmp for std::pin::Pin<P>
where
    P::Target: AsAmp,
{
    fn to_amp(&self) -> AmpTensor {
        (**self).to_amp()
    }
}

/// An operand of a routed op or operator: anything [`AsAmp`] (candle tensors included).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor operand an autocast region can use",
    label = "expected a `Tensor<P>`, a region value or a candle tensor here",
    note = "inside `#[autocast]` tensor operands are typed tensors, values computed in the \
            region, or candle tensors"
)]
pub trait Operand {
    /// The operand as a region value (a handle clone).
    fn operand(&self) -> AmpTensor;
}

impl<T: AsAmp + ?Sized> Operand for T {
    fn operand(&self) -> AmpTensor {
        self.to_amp()
    }
}

/// The right side of a comparison (`eq`, `ge`, ..) or of `maximum`/`minimum` in a region: a
/// tensor operand, or a scalar as candle's methods take one (`mask.eq(0u32)`,
/// `h.maximum(0.0)`).
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor or a scalar an autocast region can compare with",
    label = "expected a tensor operand or a number here",
    note = "inside `#[autocast]` the right side is a typed tensor, a region value, a candle \
            tensor, or a number of one of candle's element types"
)]
pub trait OperandOrScalar {
    /// The operand, or the scalar as a rank-0 CPU tensor of its own type.
    fn operand_or_scalar(&self) -> Result<Rhs>;
}

/// What an [`OperandOrScalar`] is.
#[derive(Debug)]
pub enum Rhs {
    /// A tensor, routed as an operand (promoted with the receiver).
    Tensor(AmpTensor),
    /// A number, as a rank-0 CPU tensor of its type: candle's scalar semantics (in the
    /// receiver's dtype, on its device, over its shape: [`Rhs::scalar_like`]).
    Scalar(candle_core::Tensor),
}

impl Rhs {
    /// The scalar `s` as candle's comparisons and extrema take one: in `x`'s dtype, on its
    /// device, broadcast to its shape.
    pub(crate) fn scalar_like(s: &candle_core::Tensor, x: &AmpTensor) -> Result<AmpTensor> {
        s.to_dtype(x.dtype())?
            .to_device(x.device())?
            .broadcast_as(x.shape())
    }
}

impl<T: AsAmp + ?Sized> OperandOrScalar for T {
    fn operand_or_scalar(&self) -> Result<Rhs> {
        Ok(Rhs::Tensor(self.to_amp()))
    }
}

macro_rules! scalar_rhs {
    ($($t:ty),*) => {$(
        impl OperandOrScalar for $t {
            fn operand_or_scalar(&self) -> Result<Rhs> {
                candle_core::Tensor::new(*self, &candle_core::Device::Cpu).map(Rhs::Scalar)
            }
        }
    )*};
}

scalar_rhs!(u8, u32, i16, i32, i64, half::f16, half::bf16, f32, f64);

/// Whether ops cast `x` to their class's precision: f32, f16 and bf16 only.
pub(crate) fn floating(x: &AmpTensor) -> bool {
    matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16)
}
