//! Region values: the tensors a region body computes with.

use candle_core::{DType, Result};

use crate::cast::convert;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A tensor inside an autocast region: f32, f16 or bf16, decided by the ops that made it.
///
/// Leave a region with [`AmpTensor::cast`] (the macro does it for the return value).
#[derive(Clone, Debug)]
pub struct AmpTensor {
    inner: candle_core::Tensor,
}

impl AmpTensor {
    /// Wraps the result of a routed op; region values are floating tensors only.
    pub(crate) fn new(inner: candle_core::Tensor) -> Result<Self> {
        match inner.dtype() {
            DType::F32 | DType::F16 | DType::BF16 => Ok(Self { inner }),
            other => candle_core::bail!(
                "autocast region values are f32, f16 or bf16 tensors, got {other:?}"
            ),
        }
    }

    /// The current dtype.
    pub fn dtype(&self) -> DType {
        self.inner.dtype()
    }

    /// The dimensions.
    pub fn dims(&self) -> &[usize] {
        self.inner.dims()
    }

    /// The underlying candle tensor.
    pub fn as_candle(&self) -> &candle_core::Tensor {
        &self.inner
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

impl<T: AsAmp + ?Sized> AsAmp for &T {
    fn to_amp(&self) -> AmpTensor {
        (**self).to_amp()
    }
}
