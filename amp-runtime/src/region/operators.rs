//! Operators on tensors in a region: `+ - * /` between two tensors are promote-class ops, and
//! between a tensor and an `f64` affine maps (`s / x` PyTorch's fp32-class `rdiv`), routed like
//! the methods they stand for under the region's policy. A region's values are candle tensors,
//! whose own operators candle implements (mixing dtypes is a run-time error there, and a scalar
//! rounds to a half value's dtype first), so the macro rewrites each operator expression into
//! [`Operands`], which picks the routed op by the operands' types.

use std::cell::Cell;
use std::marker::PhantomData;

use candle_core::{DType, Result};

use super::policy::Policy;
use super::route::{at, binary, routed, unary};
use super::value::{AmpTensor, AsAmp};
use crate::kernels::affine;
use crate::op;

/// `s / x`: PyTorch's fp32-class `rdiv`, computed in f32 (a quotient: `kernels::rdiv_scalar`).
fn rdiv(s: f64, x: &AmpTensor) -> Result<AmpTensor> {
    crate::kernels::rdiv_scalar(s, x)
}

/// An operator's two operands in a region, on their way to it: the rewrite turns `a + b` into
/// `(&&&Operands::<Pol, _, _>::new(a, b)).__amp_add()` (`-`, `*`, `/` the same), and Rust's
/// method probe picks, by the operands' types (autoref specialisation, tried in order):
/// 1. two tensors ([`TensorOperators`]: candle tensors, typed tensors, or a `Result` of one, as
///    candle chains them): the promote-class op, routed under the region's policy `Pol`;
/// 2. a tensor and an `f64` on either side ([`ScalarRight`], [`ScalarLeft`]): an affine map in
///    the tensor's dtype, computed in f32 and rounded once, as PyTorch does (candle's `affine`
///    rounds the scalar to a half value's dtype first); `s / x` is PyTorch's fp32-class `rdiv`;
/// 3. anything else ([`PlainAdd`], ...): the operator as written (numbers, shapes, strings).
pub struct Operands<Pol, L, R> {
    pair: Cell<Option<(L, R)>>,
    policy: PhantomData<Pol>,
}

impl<Pol, L, R> std::fmt::Debug for Operands<Pol, L, R> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Operands").finish_non_exhaustive()
    }
}

impl<Pol, L, R> Operands<Pol, L, R> {
    /// The two operands, left then right (evaluated in that order, as the operator would).
    pub fn new(left: L, right: R) -> Self {
        Self {
            pair: Cell::new(Some((left, right))),
            policy: PhantomData,
        }
    }

    /// The operands; an `Operands` is built for one operator call, which takes them once.
    fn take(&self) -> (L, R) {
        match self.pair.take() {
            Some(pair) => pair,
            None => unreachable!("an operator takes its operands once"),
        }
    }
}

/// A tensor operand of an operator: a tensor, or a `Result` of one (`(a + b)? * c` and
/// `(a + b) * c` both chain, as in candle).
pub trait OperatorSide {
    /// The operand as a region value (the `Result`'s error, if any).
    fn side(self) -> Result<AmpTensor>;
}

impl<T: AsAmp> OperatorSide for T {
    fn side(self) -> Result<AmpTensor> {
        Ok(self.to_amp())
    }
}

impl<T: AsAmp> OperatorSide for Result<T> {
    fn side(self) -> Result<AmpTensor> {
        Ok(self?.to_amp())
    }
}

/// Way 1: two tensors.
pub trait TensorOperators {
    /// Routed `add`.
    fn __amp_add(self) -> Result<AmpTensor>;
    /// Routed `sub`.
    fn __amp_sub(self) -> Result<AmpTensor>;
    /// Routed `mul`.
    fn __amp_mul(self) -> Result<AmpTensor>;
    /// Routed `div`.
    fn __amp_div(self) -> Result<AmpTensor>;
}

impl<Pol: Policy, L: OperatorSide, R: OperatorSide> TensorOperators for &&&Operands<Pol, L, R> {
    // `+` and `-` on candle-amp's op, which gives no gradient to an operand that tracks nothing
    // (a mask).
    fn __amp_add(self) -> Result<AmpTensor> {
        self.sum::<op::add>(false)
    }
    fn __amp_sub(self) -> Result<AmpTensor> {
        self.sum::<op::sub>(true)
    }
    fn __amp_mul(self) -> Result<AmpTensor> {
        self.binary::<op::mul>(candle_core::Tensor::mul)
    }
    fn __amp_div(self) -> Result<AmpTensor> {
        self.binary::<op::div>(candle_core::Tensor::div)
    }
}

impl<Pol: Policy, L: OperatorSide, R: OperatorSide> Operands<Pol, L, R> {
    /// `+` (`-` with `sub`): where the policy sums an f32 and a half operand of one shape in
    /// f32 (the promote class: a residual stream plus a half branch), one op reading the half
    /// operand as it is ([`crate::kernels::widening_sum`], the cast-then-sum's values to the
    /// bit); otherwise each operand cast to the target, then candle-amp's sum.
    fn sum<O: op::Op>(&self, sub: bool) -> Result<AmpTensor> {
        let (l, r) = self.take();
        let (a, b) = (l.side()?, r.side()?);
        routed::<Pol, O>(&[&a, &b], |t| {
            if t == Some(DType::F32) {
                if let Some(y) = crate::kernels::widening_sum(&a, &b, sub)? {
                    return Ok(y);
                }
            }
            let (a, b) = (at(&a, t)?, at(&b, t)?);
            if sub {
                crate::kernels::sub(&a, &b)
            } else {
                crate::kernels::add(&a, &b)
            }
        })
    }

    fn binary<O: op::Op>(
        &self,
        f: impl FnOnce(&candle_core::Tensor, &candle_core::Tensor) -> Result<candle_core::Tensor>,
    ) -> Result<AmpTensor> {
        let (l, r) = self.take();
        binary::<Pol, O>(&l.side()?, &r.side()?, f)
    }
}

/// Way 2: a tensor and an `f64` scalar on its right.
pub trait ScalarRight {
    /// `x + s`.
    fn __amp_add(self) -> Result<AmpTensor>;
    /// `x - s`.
    fn __amp_sub(self) -> Result<AmpTensor>;
    /// `x * s`.
    fn __amp_mul(self) -> Result<AmpTensor>;
    /// `x / s`.
    fn __amp_div(self) -> Result<AmpTensor>;
}

impl<Pol: Policy, L: OperatorSide> ScalarRight for &&Operands<Pol, L, f64> {
    fn __amp_add(self) -> Result<AmpTensor> {
        let (x, s) = self.take();
        affine_op::<Pol>(x.side()?, 1.0, s)
    }
    fn __amp_sub(self) -> Result<AmpTensor> {
        let (x, s) = self.take();
        affine_op::<Pol>(x.side()?, 1.0, -s)
    }
    fn __amp_mul(self) -> Result<AmpTensor> {
        let (x, s) = self.take();
        affine_op::<Pol>(x.side()?, s, -0.0)
    }
    fn __amp_div(self) -> Result<AmpTensor> {
        let (x, s) = self.take();
        unary::<Pol, op::affine>(&x.side()?, |x| crate::kernels::div_scalar(x, s))
    }
}

/// Way 2: an `f64` scalar and a tensor on its right.
pub trait ScalarLeft {
    /// `s + x`.
    fn __amp_add(self) -> Result<AmpTensor>;
    /// `s - x`.
    fn __amp_sub(self) -> Result<AmpTensor>;
    /// `s * x`.
    fn __amp_mul(self) -> Result<AmpTensor>;
    /// `s / x`: fp32-class, computed in f32.
    fn __amp_div(self) -> Result<AmpTensor>;
}

impl<Pol: Policy, R: OperatorSide> ScalarLeft for &&Operands<Pol, f64, R> {
    fn __amp_add(self) -> Result<AmpTensor> {
        let (s, x) = self.take();
        affine_op::<Pol>(x.side()?, 1.0, s)
    }
    fn __amp_sub(self) -> Result<AmpTensor> {
        let (s, x) = self.take();
        affine_op::<Pol>(x.side()?, -1.0, s)
    }
    fn __amp_mul(self) -> Result<AmpTensor> {
        let (s, x) = self.take();
        affine_op::<Pol>(x.side()?, s, -0.0)
    }
    fn __amp_div(self) -> Result<AmpTensor> {
        let (s, x) = self.take();
        rdiv(s, &x.side()?)
    }
}

/// `x * mul + add`, routed as `affine`.
fn affine_op<Pol: Policy>(x: AmpTensor, mul: f64, add: f64) -> Result<AmpTensor> {
    unary::<Pol, op::affine>(&x, |x| affine(x, mul, add))
}

/// Way 3: the operator as written, for operands that are not tensors.
macro_rules! plain_operator {
    ($name:ident, $trait:ident, $fn:ident, $method:ident) => {
        #[doc = concat!("Way 3: `", stringify!($fn), "` as written.")]
        pub trait $name {
            /// The operator's own output.
            type Output;
            #[doc = concat!("`", stringify!($trait), "::", stringify!($fn), "`.")]
            fn $method(self) -> Self::Output;
        }

        impl<Pol, L: std::ops::$trait<R>, R> $name for &Operands<Pol, L, R> {
            type Output = L::Output;
            fn $method(self) -> L::Output {
                let (l, r) = self.take();
                std::ops::$trait::$fn(l, r)
            }
        }
    };
}
plain_operator!(PlainAdd, Add, add, __amp_add);
plain_operator!(PlainSub, Sub, sub, __amp_sub);
plain_operator!(PlainMul, Mul, mul, __amp_mul);
plain_operator!(PlainDiv, Div, div, __amp_div);

#[cfg(test)]
mod tests {
    use super::*;
    use crate::precision::{Precision, BF16};
    use crate::region::policy::Fp16Policy;
    use crate::tensor::Tensor;
    use candle_core::Device;

    /// `l OP r` as a region runs it (under fp16), by the way the probe picks.
    macro_rules! op {
        ($l:expr, $method:ident, $r:expr) => {
            (&&&Operands::<Fp16Policy, _, _>::new($l, $r)).$method()
        };
    }

    fn value(dtype: DType) -> AmpTensor {
        let t = candle_core::Tensor::new(&[1f32, 2., 4.], &Device::Cpu).unwrap();
        t.to_dtype(dtype).unwrap()
    }

    fn values(r: Result<AmpTensor>) -> (DType, Vec<f32>) {
        let r = r.unwrap();
        let v = r.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        (r.dtype(), v)
    }

    #[test]
    fn scalars_on_either_side_match_a_hand_computation() {
        let x = value(DType::F16);
        assert_eq!(
            values(op!(&x, __amp_add, 1.0)),
            (DType::F16, vec![2., 3., 5.])
        );
        assert_eq!(
            values(op!(&x, __amp_sub, 1.0)),
            (DType::F16, vec![0., 1., 3.])
        );
        assert_eq!(
            values(op!(x.clone(), __amp_mul, 3.0)),
            (DType::F16, vec![3., 6., 12.])
        );
        assert_eq!(
            values(op!(x.clone(), __amp_div, 8.0)),
            (DType::F16, vec![0.125, 0.25, 0.5])
        );
        assert_eq!(
            values(op!(1.0, __amp_sub, &x)),
            (DType::F16, vec![0., -1., -3.])
        );
        assert_eq!(
            values(op!(2.0, __amp_mul, x.clone())),
            (DType::F16, vec![2., 4., 8.])
        );
        assert_eq!(
            values(op!(0.5, __amp_add, &x)),
            (DType::F16, vec![1.5, 2.5, 4.5])
        );
        // `s / x` is fp32-class (PyTorch's rdiv): an f32 result.
        assert_eq!(
            values(op!(4.0, __amp_div, &x)),
            (DType::F32, vec![4., 2., 1.])
        );
        // Not tensors: the operator as written.
        assert_eq!(op!(6usize, __amp_div, 4), 1);
        assert_eq!(op!(String::from("a"), __amp_add, "b"), "ab");
    }

    /// `x * s` on a bf16 value is computed in f32 and rounded once, as PyTorch does, typed or in
    /// a region: candle's `affine` (and its `*`) rounds `s` to bf16 first and differs on some of
    /// these.
    #[test]
    fn scaling_a_half_value_rounds_once() {
        let s = 1.0 / 48f64.sqrt();
        let xs: Vec<f32> = (0..512).map(|i| i as f32 / 7.0 - 30.0).collect();
        let x = candle_core::Tensor::new(xs, &Device::Cpu)
            .unwrap()
            .to_dtype(BF16::DTYPE)
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
        let region = op!(&x, __amp_mul, s).unwrap();
        assert_eq!(bits(&region), want);
        let typed = (Tensor::<BF16>::from_candle(x.clone()).unwrap() * s).unwrap();
        assert_eq!(bits(typed.as_candle()), want);
        assert_ne!(bits(&(&x * s).unwrap()), want, "candle's own operator");
    }

    #[test]
    fn results_chain_as_in_candle() {
        let (h, f) = (value(DType::F16), value(DType::F32));
        // (h + h) + f promotes to f32; f16 stays f16 without an f32 operand.
        let hh = op!(&h, __amp_add, &h);
        assert_eq!(
            values(op!(hh, __amp_add, &f)),
            (DType::F32, vec![3., 6., 12.])
        );
        let zero = op!(&h, __amp_sub, &h);
        assert_eq!(
            values(op!(h.clone(), __amp_mul, zero)),
            (DType::F16, vec![0., 0., 0.])
        );
        // candle's own `+` cannot mix them.
        assert!((&h + &f).is_err());
    }
}
