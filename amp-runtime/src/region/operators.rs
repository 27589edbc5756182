//! Operators on region values: `+ - * /` are promote-class and carry no policy (the widest
//! input wins, whatever the region's policy); `* f64` and `+ f64` are affine maps.

use candle_core::Result;

use super::policy::Policy;
use super::route::binary;
use super::value::{AmpTensor, AsAmp};
use crate::op;
use crate::precision::{Precision, F16};
use crate::tensor::Tensor;

/// The classes as `crate::op` declares them, for operators, which carry no policy.
#[derive(Clone, Copy, Debug, Default)]
struct DeclaredClasses;
impl Policy for DeclaredClasses {
    type Lower = F16;
    const NAME: &'static str = "declared";
}

macro_rules! region_operator {
    ($trait:ident, $fn:ident, $op:ident) => {
        impl<B: AsAmp> std::ops::$trait<B> for &AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: B) -> Result<AmpTensor> {
                binary::<DeclaredClasses, op::$op>(self, &rhs.to_amp(), |a, b| a.$fn(b))
            }
        }
        impl<B: AsAmp> std::ops::$trait<B> for AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: B) -> Result<AmpTensor> {
                (&self).$fn(rhs)
            }
        }
        impl<P: Precision> std::ops::$trait<&AmpTensor> for &Tensor<P> {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: &AmpTensor) -> Result<AmpTensor> {
                (&self.to_amp()).$fn(rhs)
            }
        }
    };
}
region_operator!(Add, add, add);
region_operator!(Sub, sub, sub);
region_operator!(Mul, mul, mul);
region_operator!(Div, div, div);

impl std::ops::Mul<f64> for &AmpTensor {
    type Output = Result<AmpTensor>;
    fn mul(self, rhs: f64) -> Result<AmpTensor> {
        AmpTensor::new(self.as_candle().affine(rhs, 0.0)?)
    }
}

impl std::ops::Add<f64> for &AmpTensor {
    type Output = Result<AmpTensor>;
    fn add(self, rhs: f64) -> Result<AmpTensor> {
        AmpTensor::new(self.as_candle().affine(1.0, rhs)?)
    }
}
