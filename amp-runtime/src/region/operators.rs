//! Operators on region values: `+ - * /` are promote-class ops and `x * s`, `x + s` (an `f64`
//! scalar) affine maps, routed like the methods they stand for (`add`, `affine`) under the
//! policy of the region part running on this thread: the region's own, a `#[keep_fp32]`
//! statement's f32, a `policy!` that moves `add` or `affine`. An operator is a trait impl and
//! cannot take the region's policy as a type parameter the way a routed method does; the region
//! pushes it for the code it runs ([`CallerPolicy`]). Where no region part runs (a candle
//! module's body called from candle code) they follow the classes `crate::op` declares.

use std::any::TypeId;

use candle_core::{DType, Result};

use super::policy::{in_region, CallerPolicy, Policy};
use super::route::{binary, unary};
use super::value::{AmpTensor, AsAmp, Operand};
use crate::cast::convert;
use crate::kernels::affine;
use crate::op::{self, OpClass};
use crate::precision::{Precision, F16};
use crate::tensor::Tensor;

/// The policy operators run under: the region part running on this thread ([`CallerPolicy`]),
/// or where none runs, the classes `crate::op` declares.
#[derive(Clone, Copy, Debug, Default)]
struct OperatorPolicy;
impl Policy for OperatorPolicy {
    type Lower = F16;
    const NAME: &'static str = "operator";
    fn class_of(op: TypeId, declared: OpClass) -> OpClass {
        if in_region() {
            CallerPolicy::class_of(op, declared)
        } else {
            declared
        }
    }
    fn lower() -> DType {
        if in_region() {
            CallerPolicy::lower()
        } else {
            F16::DTYPE
        }
    }
}

/// `x * mul + add`, routed as `affine`.
fn affine_operator(x: &AmpTensor, mul: f64, add: f64) -> Result<AmpTensor> {
    unary::<OperatorPolicy, op::affine>(x, |x| affine(x, mul, add))
}

macro_rules! region_operator {
    ($trait:ident, $fn:ident, $op:ident, $kernel:expr) => {
        impl<B: Operand> std::ops::$trait<B> for &AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: B) -> Result<AmpTensor> {
                binary::<OperatorPolicy, op::$op>(self, &rhs.operand(), $kernel)
            }
        }
        impl<B: Operand> std::ops::$trait<B> for AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: B) -> Result<AmpTensor> {
                (&self).$fn(rhs)
            }
        }
        // A `&Tensor<P>` parameter is a `&AmpTensor` in the region: `&x + &h` stays valid.
        impl<B: Operand> std::ops::$trait<B> for &&AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: B) -> Result<AmpTensor> {
                (*self).$fn(rhs)
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
// `+` and `-` on candle-amp's op, which gives no gradient to an operand that tracks nothing.
region_operator!(Add, add, add, crate::kernels::add);
region_operator!(Sub, sub, sub, crate::kernels::sub);
region_operator!(Mul, mul, mul, candle_core::Tensor::mul);
region_operator!(Div, div, div, candle_core::Tensor::div);

/// A `Result` on either side, as candle allows: `(a + b + c)?`, `(x * (y + z))?`.
macro_rules! result_operator {
    ($trait:ident, $fn:ident) => {
        impl std::ops::$trait<&AmpTensor> for Result<AmpTensor> {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: &AmpTensor) -> Result<AmpTensor> {
                (&self?).$fn(rhs)
            }
        }
        impl std::ops::$trait<AmpTensor> for Result<AmpTensor> {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: AmpTensor) -> Result<AmpTensor> {
                (&self?).$fn(&rhs)
            }
        }
        impl std::ops::$trait<Result<AmpTensor>> for &AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: Result<AmpTensor>) -> Result<AmpTensor> {
                self.$fn(&rhs?)
            }
        }
        impl std::ops::$trait<Result<AmpTensor>> for AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, rhs: Result<AmpTensor>) -> Result<AmpTensor> {
                (&self).$fn(&rhs?)
            }
        }
    };
}
result_operator!(Add, add);
result_operator!(Sub, sub);
result_operator!(Mul, mul);
result_operator!(Div, div);

/// `x op s` and `s op x` with an `f64` scalar: affine maps (PyTorch runs a tensor-scalar op
/// in the tensor's dtype, `affine` preserves it), routed as `affine`; except `s / x`, which is
/// PyTorch's fp32-class `rdiv`: computed in f32.
macro_rules! scalar_operator {
    ($trait:ident, $fn:ident, |$s:ident| $rhs_affine:expr, |$x:ident, $t:ident| $lhs_scalar:expr) => {
        impl std::ops::$trait<f64> for &AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, $s: f64) -> Result<AmpTensor> {
                let (mul, add) = $rhs_affine;
                affine_operator(self, mul, add)
            }
        }
        impl std::ops::$trait<f64> for AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, s: f64) -> Result<AmpTensor> {
                std::ops::$trait::$fn(&self, s)
            }
        }
        impl std::ops::$trait<f64> for &&AmpTensor {
            type Output = Result<AmpTensor>;
            fn $fn(self, s: f64) -> Result<AmpTensor> {
                std::ops::$trait::$fn(*self, s)
            }
        }
        impl std::ops::$trait<&AmpTensor> for f64 {
            type Output = Result<AmpTensor>;
            fn $fn(self, x: &AmpTensor) -> Result<AmpTensor> {
                let ($x, $t) = (x, self);
                $lhs_scalar
            }
        }
        impl std::ops::$trait<AmpTensor> for f64 {
            type Output = Result<AmpTensor>;
            fn $fn(self, x: AmpTensor) -> Result<AmpTensor> {
                std::ops::$trait::$fn(self, &x)
            }
        }
    };
}
scalar_operator!(Add, add, |s| (1.0, s), |x, s| affine_operator(x, 1.0, s));
scalar_operator!(Sub, sub, |s| (1.0, -s), |x, s| affine_operator(x, -1.0, s));
scalar_operator!(Mul, mul, |s| (s, 0.0), |x, s| affine_operator(x, s, 0.0));
scalar_operator!(Div, div, |s| (1.0 / s, 0.0), |x, s| AmpTensor::new(affine(
    &convert(x.as_candle(), candle_core::DType::F32)?.recip()?,
    s,
    0.0
)?));

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn value(dtype: DType) -> AmpTensor {
        let t = candle_core::Tensor::new(&[1f32, 2., 4.], &Device::Cpu).unwrap();
        AmpTensor::new(t.to_dtype(dtype).unwrap()).unwrap()
    }

    fn values(r: Result<AmpTensor>) -> (DType, Vec<f32>) {
        let r = r.unwrap();
        let v = r
            .as_candle()
            .to_dtype(DType::F32)
            .unwrap()
            .to_vec1()
            .unwrap();
        (r.dtype(), v)
    }

    #[test]
    fn scalars_on_either_side_match_a_hand_computation() {
        let x = value(DType::F16);
        assert_eq!(values(&x + 1.0), (DType::F16, vec![2., 3., 5.]));
        assert_eq!(values(&x - 1.0), (DType::F16, vec![0., 1., 3.]));
        assert_eq!(values(x.clone() * 3.0), (DType::F16, vec![3., 6., 12.]));
        assert_eq!(
            values(x.clone() / 8.0),
            (DType::F16, vec![0.125, 0.25, 0.5])
        );
        assert_eq!(values(1.0 - &x), (DType::F16, vec![0., -1., -3.]));
        assert_eq!(values(2.0 * x.clone()), (DType::F16, vec![2., 4., 8.]));
        assert_eq!(values(0.5 + &x), (DType::F16, vec![1.5, 2.5, 4.5]));
        // `s / x` is fp32-class (PyTorch's rdiv): an f32 result.
        assert_eq!(values(4.0 / &x), (DType::F32, vec![4., 2., 1.]));
    }

    /// `x * s` on a bf16 value is computed in f32 and rounded once, as PyTorch does, typed or in
    /// a region: candle's `affine` rounds `s` to bf16 first and differs on some of these.
    #[test]
    fn scaling_a_half_value_rounds_once() {
        let s = 1.0 / 48f64.sqrt();
        let xs: Vec<f32> = (0..512).map(|i| i as f32 / 7.0 - 30.0).collect();
        let x = candle_core::Tensor::new(xs, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let bits = |t: &candle_core::Tensor| -> Vec<u16> {
            t.to_vec1::<half::bf16>()
                .unwrap()
                .iter()
                .map(|v| v.to_bits())
                .collect()
        };
        let want: Vec<u16> = x
            .to_vec1::<half::bf16>()
            .unwrap()
            .iter()
            .map(|v| half::bf16::from_f32(v.to_f32() * s as f32).to_bits())
            .collect();
        let region = (AmpTensor::new(x.clone()).unwrap() * s).unwrap();
        assert_eq!(bits(region.as_candle()), want);
        let typed =
            (Tensor::<crate::precision::BF16>::from_candle(x.clone()).unwrap() * s).unwrap();
        assert_eq!(bits(typed.as_candle()), want);
        assert_ne!(bits(&x.affine(s, 0.0).unwrap()), want, "candle's affine");
    }

    #[test]
    fn results_chain_as_in_candle() {
        let (h, f) = (value(DType::F16), value(DType::F32));
        // (h + h) + f promotes to f32; f16 stays f16 without an f32 operand.
        assert_eq!(values((&h + &h) + &f), (DType::F32, vec![3., 6., 12.]));
        assert_eq!(
            values(h.clone() * (&h - &h)),
            (DType::F16, vec![0., 0., 0.])
        );
        assert_eq!(
            values((&h / &h) - h.clone()),
            (DType::F16, vec![0., -1., -3.])
        );
    }
}
