use candle_core::{Result, Var};
use candle_nn::VarBuilder;

use super::{master_weight_and_bias, region_forward, weight_as, AmpLayer};
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
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        let w = weight_as::<P>(&self.weight)?;
        let w = match *x.dims() {
            [b1, b2, _, _] => w.broadcast_left((b1, b2))?.t()?,
            [b, _, _] => w.broadcast_left(b)?.t()?,
            _ => w.t()?,
        };
        let y = x.matmul(&w)?;
        match &self.bias {
            Some(b) => y.broadcast_add(&weight_as::<P>(b)?),
            None => Ok(y),
        }
    }
}

impl AmpLayer for Linear {
    type Op = op::linear;
}
region_forward!(Linear);

/// A linear layer with bias, initialised as candle-nn's `linear` (and PyTorch's `nn.Linear`).
pub fn linear(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    let bound = 1.0 / (in_dim as f64).sqrt();
    let bias = vb.get_with_hints(
        out_dim,
        "bias",
        candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        },
    )?;
    let weight = linear_weight(in_dim, out_dim, &vb)?;
    Linear::new(weight, Some(Var::from_tensor(&bias)?))
}

/// A linear layer without bias.
pub fn linear_no_bias(in_dim: usize, out_dim: usize, vb: VarBuilder) -> Result<Linear> {
    Linear::new(linear_weight(in_dim, out_dim, &vb)?, None)
}

fn linear_weight(in_dim: usize, out_dim: usize, vb: &VarBuilder) -> Result<Var> {
    let w = vb.get_with_hints(
        (out_dim, in_dim),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    Var::from_tensor(&w)
}
