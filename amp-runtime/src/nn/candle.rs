//! candle-nn's own layers called from an autocast region: each runs in its PyTorch op class, as
//! candle-amp's layers do, with its weights (whatever their dtype) cast to where the op runs.
//! `Linear` and the convolutions (`ConvTranspose2d` too) are lower-precision, `LayerNorm`/`RmsNorm` fp32-class (through
//! the differentiable compositions: candle-nn's fused kernels have no backward), `Embedding`
//! looks up its table as it is, `Dropout` (`forward(x, train)` and `forward_t`) drops in the
//! value's precision, as candle-amp's does, and `BatchNorm` (`forward_t`, `forward_train`)
//! returns the input's precision, computed in f32 as `BatchNorm2d`.

use candle_core::{DType, Result, Tensor};
use candle_nn::Module;

use crate::cast::convert;
use crate::composite;
use crate::op;
use crate::region::{calls, unary, unary_widening, AmpTensor, AsAmp, Policy, RegionCall};

/// A weight as the kernels take it: an f32 master as it is (rounded inside the op, its
/// gradient f32), another dtype cast to `like`'s.
fn master_or_at(w: &Tensor, like: &Tensor) -> Result<Tensor> {
    if w.dtype() == DType::F32 {
        Ok(w.clone())
    } else {
        convert(w, like.dtype())
    }
}

/// A bias in f32 for an f32 or half input `x`, which the kernels add before the output's one
/// rounding and whose gradient they sum in f32 (a bias rounded to half first would have candle
/// sum it in half: 300 bf16 ones to 256); in f64 for an f64 input, which a region never casts.
fn wide_bias(b: Option<&Tensor>, x: &Tensor) -> Result<Option<Tensor>> {
    let wide = crate::kernels::elem::wide(x.dtype());
    b.map(|b| convert(b, wide)).transpose()
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Linear {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::linear>(&x.to_amp(), |x| {
            let w = master_or_at(self.weight(), x)?;
            crate::kernels::linear(x, &w, wide_bias(self.bias(), x)?.as_ref())
        })
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Conv2d {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::conv2d>(&x.to_amp(), |x| {
            let (w, b) = conv_operands(self.weight(), self.bias(), x)?;
            crate::kernels::conv2d(x, &w, b.as_ref(), self.config().into())
        })
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Conv1d {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::conv1d>(&x.to_amp(), |x| {
            let (w, b) = conv_operands(self.weight(), self.bias(), x)?;
            crate::kernels::conv1d(x, &w, b.as_ref(), self.config().into())
        })
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::ConvTranspose2d {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::conv_transpose2d>(&x.to_amp(), |x| {
            super::conv::transposed(x, self.weight(), self.bias(), self.config())
        })
    }
}

/// A convolution's kernel and bias as `kernels::conv2d` takes them: f32 masters as they are
/// (the kernel rounded inside, the gradients f32), otherwise both in `x`'s dtype.
fn conv_operands(w: &Tensor, b: Option<&Tensor>, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
    let w = master_or_at(w, x)?;
    let b = b.map(|b| convert(b, w.dtype())).transpose()?;
    Ok((w, b))
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::LayerNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        if self.remove_mean() {
            unary_widening::<Pol, op::layer_norm>(
                &x.to_amp(),
                |x| composite::layer_norm_f32(x, self.weight(), self.bias(), self.eps()),
                |x| composite::layer_norm(x, self.weight(), self.bias(), self.eps()),
            )
        } else {
            super::norm::routed_rms_norm::<Pol>(&x.to_amp(), self.weight(), self.eps())
        }
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::RmsNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        super::norm::routed_rms_norm::<Pol>(&x.to_amp(), self.weight(), self.eps())
    }
}

/// candle-nn's `GroupNorm`: fp32-class, its own composition run on the input cast to f32 (its
/// f32 scale and shift as they are).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::GroupNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::group_norm>(&x.to_amp(), |x| self.forward(x))
    }
}

/// Ids are integers, never cast: the table's rows, in the table's dtype, looked up as
/// candle-amp's `Embedding` does (`kernels::embedding`: each id range-checked on the CPU, a
/// `u8` 255 a row; candle's own lookup gave zeros for it and for `u32::MAX`).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Embedding {
    type Output = AmpTensor;
    fn region_call(&self, (ids,): (A,)) -> Result<AmpTensor> {
        super::embedding::routed_lookup::<Pol>(self.embeddings(), &ids.to_amp())
    }
}

/// An activation runs on the value as it is (PyTorch's autocast lists none of them).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Activation {
    type Output = AmpTensor;
    /// Routed as the op it is (`relu`, `gelu`, ...; the others as a precision-preserving op),
    /// so that a `#[keep_fp32]` statement or a `policy!` reaches it as it reaches `h.relu()`;
    /// the activations with a kernel of their own run through it, as the routed methods do.
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        use crate::kernels;
        use candle_nn::Activation;
        let x = &x.to_amp();
        match self {
            Activation::Gelu => unary::<Pol, op::gelu_erf>(x, kernels::gelu_erf),
            Activation::NewGelu | Activation::GeluPytorchTanh => {
                unary::<Pol, op::gelu>(x, kernels::gelu)
            }
            Activation::Relu => unary::<Pol, op::relu>(x, kernels::relu),
            Activation::Silu => unary::<Pol, op::silu>(x, kernels::silu),
            // candle-nn's own, computed in f32 and rounded once (PyTorch's values).
            Activation::Sigmoid => {
                unary::<Pol, op::sigmoid>(x, |x| kernels::in_f32(x, |x| self.forward(x)))
            }
            _ => unary::<Pol, op::preserve_op>(x, |x| kernels::in_f32(x, |x| self.forward(x))),
        }
    }
}

/// candle-nn's `BatchNorm`, `forward_t(&x, train)` and `forward_train(&x)`: routed as
/// `op::batch_norm`, as `BatchNorm2d` (on no list: the input's precision out), candle-nn's own
/// computation run in f32 inside, where its f32 statistics and parameters meet the input (in
/// half, candle's `sub` of an f32 mean from a bf16 input was a dtype error).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward_t, (A, bool)> for candle_nn::BatchNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x, train): (A, bool)) -> Result<AmpTensor> {
        unary::<Pol, op::batch_norm>(&x.to_amp(), |x| {
            let y = candle_nn::ModuleT::forward_t(self, &convert(x, DType::F32)?, train)?;
            convert(&y, x.dtype())
        })
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward_train, (A,)> for candle_nn::BatchNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        RegionCall::<Pol, calls::forward_t, (A, bool)>::region_call(self, (x, true))
    }
}

/// candle-nn's `Dropout`, `forward(&h, train)` and `forward_t`: routed as `op::dropout` (on no
/// list: the value's precision), running candle-nn's own dropout on it.
macro_rules! candle_dropout {
    ($($call:ident),*) => {$(
        impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::$call, (A, bool)> for candle_nn::Dropout {
            type Output = AmpTensor;
            fn region_call(&self, (x, train): (A, bool)) -> Result<AmpTensor> {
                unary::<Pol, op::dropout>(&x.to_amp(), |x| self.forward(x, train))
            }
        }
    )*};
}
candle_dropout!(forward, forward_t);
