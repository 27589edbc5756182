//! Dropout, candle-nn's signature (`Dropout::new(p)`, `forward(x, train)`), in the input's
//! precision: PyTorch's autocast lists it nowhere, so it runs on whatever it is given.

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
    /// A dropout of probability `p` (in `[0, 1)`, as candle-nn checks when it runs).
    pub fn new(p: f32) -> Self {
        Self { p }
    }

    /// The drop probability.
    pub fn p(&self) -> f32 {
        self.p
    }

    /// Applies dropout when `train`, in `x`'s precision.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        Tensor::from_candle(self.run(x.as_candle(), train)?)
    }

    /// The same as [`forward`](Self::forward), under `ModuleT`'s name.
    pub fn forward_t<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        self.forward(x, train)
    }

    fn run(self, x: &candle_core::Tensor, train: bool) -> Result<candle_core::Tensor> {
        if train && self.p > 0.0 {
            candle_nn::ops::dropout(x, self.p)
        } else {
            Ok(x.clone())
        }
    }
}

impl candle_nn::ModuleT for Dropout {
    fn forward_t(&self, xs: &candle_core::Tensor, train: bool) -> Result<candle_core::Tensor> {
        self.run(xs, train)
    }
}

/// `dropout.forward(&h, train)` and `forward_t` in a region: on the value as it is.
macro_rules! region_dropout {
    ($($call:ident),*) => {$(
        impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::$call, (A, bool)> for Dropout {
            type Output = AmpTensor;
            fn region_call(&self, (x, train): (A, bool)) -> Result<AmpTensor> {
                AmpTensor::new(self.run(x.to_amp().as_candle(), train)?)
            }
        }
    )*};
}
region_dropout!(forward, forward_t);
