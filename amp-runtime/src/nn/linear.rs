//! The fully connected layer, PyTorch's `nn.Linear`: `y = x W^T + b` over the last dimension.
//!
//! `Linear` is in autocast's lower-precision class (`op::linear`, like PyTorch's `linear` on
//! the fp16/bf16 list): it runs in its input's precision, with the f32 master weight and bias
//! cast to it per call. Outside a region that is the typed input's precision (f32 stays f32);
//! inside an `#[autocast(bf16)]` region an f32 input is cast and the layer runs in bf16.
//! Gradients reach the f32 masters either way.
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! # use amp_macros::autocast;
//! use candle_amp::nn::{self, Linear};
//! use candle_amp::{Tensor, BF16, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! let fc = nn::linear(4, 3, vb.pp("fc"))?; // f32 master weight (3, 4) and bias (3)
//!
//! let x = Tensor::<F32>::randn(0.0, 1.0, (2, 4), &dev)?;
//! assert_eq!(fc.forward(&x)?.dims(), &[2, 3]); // no region: f32 in, f32 out
//! let h: Tensor<BF16> = fc.forward(&x.cast::<BF16>()?)?; // a bf16 input runs in bf16
//! assert_eq!(h.dtype(), DType::BF16);
//!
//! struct Model { fc: Linear }
//! #[autocast(bf16)]
//! impl Model {
//!     fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
//!         let h = self.fc.forward(&x)?;
//!         assert_eq!(h.dtype(), DType::BF16); // lower-precision op: runs in bf16
//!         Ok(h)
//!     }
//! }
//! let y = Model { fc }.forward(&x)?; // f32 at the region's exit
//! assert_eq!(y.dims(), &[2, 3]);
//! # Ok(()) }
//! ```

use candle_core::{Result, Var};
use candle_nn::VarBuilder;

use super::{count_master_casts, master_weight_and_bias, region_forward, AmpLayer};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// `y = x W^T + b`, a lower-precision op: it runs in its input's precision, with the f32 master
/// weight cast to it per call.
#[derive(Clone, Debug)]
pub struct Linear {
    weight: Var,
    bias: Option<Var>,
}

impl Linear {
    /// A linear layer from an f32 weight `(out, in)` and an optional f32 bias `(out)`.
    pub fn new(weight: Var, bias: Option<Var>) -> Result<Self> {
        let (weight, bias) = master_weight_and_bias(weight, bias, "Linear", 2)?;
        Ok(Self { weight, bias })
    }

    /// The f32 master weight `(out, in)`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The f32 master bias `(out)`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// Applies the layer to `x` of shape `(..., in)`, in `x`'s precision.
    ///
    /// The input's rows are one 2-D product `(rows, in) x (in, out)`, as candle-nn's `Linear`
    /// computes contiguous inputs: one large GEMM instead of a batched matmul over a broadcast
    /// weight (a strided input is copied first: a broadcast weight's gradient would be summed
    /// over the batch in the input's half precision). In bf16 and f16 on CPU that product is
    /// one op with the bias added before its one rounding, reading a contiguous input of any
    /// rank in place; on CUDA one op too, the weight cast inside it and the bias added after the
    /// product's rounding (`kernels::linear`).
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        // One product on the f32 masters; in half precision on CPU, one op that rounds them
        // inside (counted as the two casts it stands for).
        count_master_casts::<P>(&self.weight, self.bias.as_ref());
        let y = crate::kernels::linear(
            x.as_candle(),
            self.weight.as_tensor(),
            self.bias.as_ref().map(Var::as_tensor),
        )?;
        Ok(Tensor::wrap(y))
    }
}

impl AmpLayer for Linear {
    type Op = op::linear;
}
region_forward!(Linear);

/// A [`Linear`] and the activation after it as one op, as [`ConvBnReLU2d`](super::ConvBnReLU2d)
/// is for a convolution (oneDNN's linear + GELU post-op, IPEX's `LinearGelu`): a transformer
/// MLP's first layer `act(x W^T + b)`. Lower precision, as `Linear`; the activation (GELU in
/// either form, SiLU or ReLU) is applied to the product's rounded values in f32 and rounded
/// once, bit for bit the two layers in a row. In f16 and bf16 on CPU it is one graph node that
/// keeps the pre-activation for its backward, where the two layers are two nodes (each adding a
/// zero-filled gradient and an add to candle's backward); elsewhere the two ops.
#[derive(Clone, Debug)]
pub struct LinearAct {
    linear: Linear,
    act: candle_nn::Activation,
    form: crate::kernels::activation::Form,
}

impl LinearAct {
    /// `act` after `linear`: `Activation::Gelu` (erf), `NewGelu` or `GeluPytorchTanh` (tanh),
    /// `Silu` or `Relu`; another activation is an error naming these.
    pub fn new(linear: Linear, act: candle_nn::Activation) -> Result<Self> {
        use crate::kernels::activation::Form;
        use candle_nn::Activation;
        let form = match act {
            Activation::Gelu => Form::Erf,
            Activation::NewGelu | Activation::GeluPytorchTanh => Form::Tanh,
            Activation::Silu => Form::Silu,
            Activation::Relu => Form::Relu,
            other => candle_core::bail!(
                "LinearAct: {other:?} has no fused form (Gelu, NewGelu, GeluPytorchTanh, Silu and \
                 Relu do): keep the Linear and call the activation after it"
            ),
        };
        Ok(Self { linear, act, form })
    }

    /// The linear layer.
    pub fn linear(&self) -> &Linear {
        &self.linear
    }

    /// The activation.
    pub fn activation(&self) -> candle_nn::Activation {
        self.act
    }

    /// `act(x W^T + b)` for `x` of shape `(..., in)`, in `x`'s precision.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        let Linear { weight, bias } = &self.linear;
        count_master_casts::<P>(weight, bias.as_ref());
        let y = crate::kernels::linear_act(
            x.as_candle(),
            weight.as_tensor(),
            bias.as_ref().map(Var::as_tensor),
            self.form,
        )?;
        Ok(Tensor::wrap(y))
    }
}

impl AmpLayer for LinearAct {
    type Op = op::linear_act;
}
region_forward!(LinearAct);

/// A linear layer with bias, initialised as candle-nn's `linear` (and PyTorch's `nn.Linear`).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let bias = super::parameter(&vb, out_dim, "bias", super::fan_in_init(in_dim).1)?;
    let weight = linear_weight(in_dim, out_dim, &vb)?;
    Linear::new(weight, Some(Var::from_tensor(&bias)?))
}

/// A linear layer without bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    Linear::new(linear_weight(in_dim, out_dim, &vb)?, None)
}

/// `linear` or `linear_no_bias`, as candle-nn's `linear_b`.
pub fn linear_b(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    if bias {
        linear(in_dim, out_dim, vb)
    } else {
        linear_no_bias(in_dim, out_dim, vb)
    }
}

fn linear_weight(in_dim: usize, out_dim: usize, vb: &VarBuilder) -> Result<Var> {
    let w = super::parameter(
        vb,
        (out_dim, in_dim),
        "weight",
        super::fan_in_init(in_dim).0,
    )?;
    Var::from_tensor(&w)
}
