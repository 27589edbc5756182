//! Region values: the tensors a region body computes with.

use candle_core::{DType, Result};

use crate::cast::convert;
use crate::precision::Precision;
use crate::tensor::{shape_accessors, Tensor};

/// A tensor inside an autocast region: f32, f16 or bf16, decided by the ops that made it.
///
/// Leave a region with [`AmpTensor::cast`] (the macro does it for the return value).
#[derive(Clone, Debug)]
pub struct AmpTensor {
    inner: candle_core::Tensor,
}

impl AmpTensor {
    /// An indexed view keeps the dtype.
    fn wrap_indexed(inner: candle_core::Tensor) -> Result<Self> {
        Self::new(inner)
    }

    /// Wraps the result of a routed op; region values are floating tensors only.
    pub(crate) fn new(inner: candle_core::Tensor) -> Result<Self> {
        match inner.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => Ok(Self { inner }),
            other => candle_core::bail!(
                "autocast region values are f32, f16 or bf16 tensors, got {other:?}"
            ),
        }
    }

    /// A candle tensor as a region value (f32, f16 or bf16; another dtype is an error).
    pub fn from_candle_value(t: &candle_core::Tensor) -> Result<Self> {
        Self::new(t.clone())
    }

    /// The current dtype.
    pub fn dtype(&self) -> DType {
        self.inner.dtype()
    }

    /// The underlying candle tensor.
    pub fn as_candle(&self) -> &candle_core::Tensor {
        &self.inner
    }

    shape_accessors!();

    /// An explicit cast to `dtype` (f32, f16 or bf16), like PyTorch's `.float()`/`.half()` in an
    /// autocast region: the ops that follow still route by their class.
    pub fn to_dtype(&self, dtype: DType) -> Result<AmpTensor> {
        Self::new(convert(&self.inner, dtype)?)
    }

    /// Zeros of the same shape, dtype and device.
    pub fn zeros_like(&self) -> Result<AmpTensor> {
        Self::new(self.inner.zeros_like()?)
    }

    /// Ones of the same shape, dtype and device.
    pub fn ones_like(&self) -> Result<AmpTensor> {
        Self::new(self.inner.ones_like()?)
    }

    /// The same values, cut from the autograd graph.
    pub fn detach(&self) -> AmpTensor {
        Self {
            inner: self.inner.detach(),
        }
    }

    /// A typed tensor of precision `Q` (a cast when the dtype differs).
    pub fn cast<Q: Precision>(&self) -> Result<Tensor<Q>> {
        Ok(Tensor::wrap(convert(&self.inner, Q::DTYPE)?))
    }
}

impl std::fmt::Display for AmpTensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Display::fmt(&self.inner, f)
    }
}

/// Anything that enters a region as a tensor value: typed tensors and region values, by
/// reference or not.
#[diagnostic::on_unimplemented(
    message = "`{Self}` is not a tensor an autocast region can use",
    label = "expected a `Tensor<P>` or a region value here",
    note = "inside `#[autocast]` tensor operands are `Tensor<F32>`/`Tensor<F16>`/`Tensor<BF16>` \
            or values computed in the region"
)]
pub trait AsAmp {
    /// The value as a region tensor (a handle clone).
    fn to_amp(&self) -> AmpTensor;
}

impl AsAmp for AmpTensor {
    fn to_amp(&self) -> AmpTensor {
        self.clone()
    }
}

impl<P: Precision> AsAmp for Tensor<P> {
    fn to_amp(&self) -> AmpTensor {
        AmpTensor {
            inner: self.as_candle().clone(),
        }
    }
}

/// References, smart pointers and the standard library's borrow guards to tensors (a weight
/// shared as `Arc<Tensor<F32>>`, a `&mut` one, a `RefCell`'s borrow, a `Mutex`'s guard): routed
/// like the tensor they reach. Without these a method call on one would find the typed tensor's
/// method through `Deref`: it would still run where the region's policy puts it (typed ops
/// follow the thread's region), but return a typed tensor cast back to its own precision
/// instead of a region value. (One
/// blanket impl over `Deref` would cover a user's newtypes too, but overlaps the operand
/// impls: a type of the user's that derefs to a tensor implements `AsAmp` itself.)
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

/// An operand of a routed op or operator: anything [`AsAmp`], and a plain candle tensor (an
/// additive mask, a position table), which takes part in the op's class like a region value and
/// is never cast on entry. Receivers stay [`AsAmp`]: a method called on a candle tensor in a
/// region is candle's own.
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

macro_rules! candle_operand {
    ($($ty:ty),*) => {$(
        impl Operand for $ty {
            fn operand(&self) -> AmpTensor {
                AmpTensor {
                    inner: <candle_core::Tensor as Clone>::clone(self),
                }
            }
        }
    )*};
}
candle_operand!(
    candle_core::Tensor,
    &candle_core::Tensor,
    &&candle_core::Tensor
);
