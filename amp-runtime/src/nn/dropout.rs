//! Dropout, candle-nn's signature (`Dropout::new(p)`, `forward(x, train)`), in the input's
//! precision: PyTorch's autocast lists it nowhere, so it runs on whatever it is given. The kept
//! values are scaled in f32 and rounded once (`kernels::masked_scale`).

use candle_core::Result;

use crate::precision::Precision;
use crate::region::{calls, AmpTensor, AsAmp, Policy, RegionCall};
use crate::tensor::Tensor;

/// Zeroes each element with probability `p` in training and scales the rest by `1 / (1 - p)`;
/// the identity in evaluation. In a region: `self.dropout.forward(&h, train)` or
/// `forward_t(&h, train)`.
#[derive(Clone, Copy, Debug)]
pub struct Dropout {
    p: f32,
}

impl Dropout {
    /// A dropout of probability `p`, which must be in `[0, 1]` (1 drops everything, as PyTorch): checked when it runs (an error
    /// from `forward`), since this is candle-nn's infallible signature.
    pub fn new(p: f32) -> Self {
        Self { p }
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// Applies dropout when `train`, in `x`'s precision.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x, train)) {
            return y;
        }
        Tensor::from_candle(self.run(x.as_candle(), train)?)
    }

    /// The same as [`forward`](Self::forward), under `ModuleT`'s name.
    pub fn forward_t<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        self.forward(x, train)
    }

    /// candle-nn's `dropout` (a uniform draw per element, kept where it is at least `p`), with
    /// the kept values scaled in f32 and rounded once, as PyTorch's `native_dropout` does:
    /// candle-nn multiplies by a mask in `x`'s dtype, where `1 / (1 - p)` rounds (to 1.109375 in
    /// bf16 for p = 0.1, a 0.16% bias of every kept activation), and its backward computes a
    /// gradient for the mask too.
    ///
    /// `p` is checked on every call, in training and evaluation alike (`new` keeps candle-nn's
    /// infallible signature): a NaN or negative `p` would otherwise pass as "nothing to drop".
    fn run(self, x: &candle_core::Tensor, train: bool) -> Result<candle_core::Tensor> {
        if !(0.0..=1.0).contains(&self.p) {
            candle_core::bail!("dropout probability has to be in [0, 1], got {}", self.p)
        }
        if !train || self.p <= 0.0 {
            return Ok(x.clone());
        }
        if self.p >= 1.0 {
            // Everything dropped, as PyTorch's p = 1 (`input * 0`: a NaN stays NaN) with a zero
            // gradient; the scale 1 / (1 - p) would be inf.
            let none = candle_core::Tensor::zeros(x.shape(), candle_core::DType::U8, x.device())?;
            return crate::kernels::masked_scale(x, &none, 0.0);
        }
        let draw = candle_core::Tensor::rand(0f32, 1f32, x.shape(), x.device())?;
        let keep = draw.ge(f64::from(self.p))?;
        crate::kernels::masked_scale(x, &keep, 1.0 / (1.0 - f64::from(self.p)))
    }
}

impl candle_nn::ModuleT for Dropout {
    fn forward_t(&self, xs: &candle_core::Tensor, train: bool) -> Result<candle_core::Tensor> {
        self.run(xs, train)
    }
}

/// `dropout.forward(&h, train)` and `forward_t` in a region: routed as `op::dropout` (on no
/// list: the value's precision, f32 in a `#[keep_fp32]` statement).
macro_rules! region_dropout {
    ($($call:ident),*) => {$(
        impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::$call, (A, bool)> for Dropout {
            type Output = AmpTensor;
            fn region_call(&self, (x, train): (A, bool)) -> Result<AmpTensor> {
                crate::region::unary::<Pol, crate::op::dropout>(&x.to_amp(), |x| self.run(x, train))
            }
        }
    )*};
}
region_dropout!(forward, forward_t);
