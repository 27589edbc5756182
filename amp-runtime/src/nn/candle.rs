//! candle-nn's own layers called from an autocast region: each runs in its PyTorch op class, as
//! candle-amp's layers do, with its weights (whatever their dtype) cast to where the op runs.
//! `Linear` and the convolutions are lower-precision, `LayerNorm`/`RmsNorm` fp32-class (through
//! the differentiable compositions: candle-nn's fused kernels have no backward), `Embedding`
//! looks up its table as it is.

use candle_core::{Result, Tensor};
use candle_nn::Module;

use crate::cast::convert;
use crate::composite;
use crate::op;
use crate::region::{calls, unary, unary_widening, AmpTensor, AsAmp, Policy, RegionCall};

/// A weight (and bias) at the dtype the op runs in.
fn at_dtype(w: &Tensor, like: &Tensor) -> Result<Tensor> {
    convert(w, like.dtype())
}

fn bias_at(b: Option<&Tensor>, like: &Tensor) -> Result<Option<Tensor>> {
    b.map(|b| at_dtype(b, like)).transpose()
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Linear {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::linear>(&x.to_amp(), |x| {
            let w = at_dtype(self.weight(), x)?;
            candle_nn::Linear::new(w, bias_at(self.bias(), x)?).forward(x)
        })
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Conv2d {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::conv2d>(&x.to_amp(), |x| {
            let c = self.config();
            let params = crate::kernels::Conv2dParams {
                padding: c.padding,
                stride: c.stride,
                dilation: c.dilation,
                groups: c.groups,
            };
            let bias = bias_at(self.bias(), x)?;
            crate::kernels::conv2d(x, &at_dtype(self.weight(), x)?, bias.as_ref(), params)
        })
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Conv1d {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::conv1d>(&x.to_amp(), |x| {
            let c = self.config();
            let w = at_dtype(self.weight(), x)?;
            let y = x.conv1d(&w, c.padding, c.stride, c.dilation, c.groups)?;
            match bias_at(self.bias(), x)? {
                Some(b) => y.broadcast_add(&b.reshape((1, (), 1))?),
                None => Ok(y),
            }
        })
    }
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
            unary::<Pol, op::rms_norm>(&x.to_amp(), |x| {
                composite::rms_norm(x, self.weight(), self.eps())
            })
        }
    }
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::RmsNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::rms_norm>(&x.to_amp(), |x| {
            composite::rms_norm(x, self.weight(), self.eps())
        })
    }
}

/// Ids are integers, not region values: the table's rows, in the table's dtype.
impl<Pol: Policy> RegionCall<Pol, calls::forward, (&Tensor,)> for candle_nn::Embedding {
    type Output = AmpTensor;
    fn region_call(&self, (ids,): (&Tensor,)) -> Result<AmpTensor> {
        AmpTensor::from_candle_value(&self.forward(ids)?)
    }
}

/// An activation runs on the value as it is (PyTorch's autocast lists none of them).
impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for candle_nn::Activation {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        use candle_nn::Activation;
        let x = x.to_amp();
        let x = x.as_candle();
        // The activations with a kernel of their own run through it, as the routed methods do.
        AmpTensor::new(match self {
            Activation::Gelu => crate::kernels::gelu_erf(x)?,
            Activation::NewGelu | Activation::GeluPytorchTanh => crate::kernels::gelu(x)?,
            Activation::Relu => crate::kernels::relu(x)?,
            Activation::Silu => crate::kernels::silu(x)?,
            _ => self.forward(x)?,
        })
    }
}
