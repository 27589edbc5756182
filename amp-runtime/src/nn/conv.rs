use candle_core::{Result, Var};
use candle_nn::{Conv1dConfig, Conv2dConfig, VarBuilder};

use super::{expect_dims, master, weight_as, AmpLayer};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// Builds the layer's weight (Kaiming normal) and bias (uniform in `±1/sqrt(fan_in)`), as
/// candle-nn and PyTorch initialise convolutions.
fn conv_params(
    shape: &[usize],
    fan_in: usize,
    with_bias: bool,
    vb: &VarBuilder,
) -> Result<(Var, Option<Var>)> {
    let w = vb.get_with_hints(shape, "weight", candle_nn::init::DEFAULT_KAIMING_NORMAL)?;
    let bias = if with_bias {
        let bound = 1.0 / (fan_in as f64).sqrt();
        let init = candle_nn::Init::Uniform {
            lo: -bound,
            up: bound,
        };
        Some(Var::from_tensor(
            &vb.get_with_hints(shape[0], "bias", init)?,
        )?)
    } else {
        None
    };
    Ok((Var::from_tensor(&w)?, bias))
}

fn checked(weight: Var, bias: Option<Var>, what: &str, rank: usize) -> Result<(Var, Option<Var>)> {
    let weight = master(weight, what)?;
    expect_dims(&weight, what, rank)?;
    let bias = bias.map(|b| master(b, what)).transpose()?;
    if let Some(b) = &bias {
        if b.dims() != [weight.dim(0)?] {
            candle_core::bail!(
                "{what} bias: expected shape [{}], got {:?}",
                weight.dim(0)?,
                b.dims()
            )
        }
    }
    Ok((weight, bias))
}

/// Adds a per-channel bias to `(batch, channels, ...)`.
fn add_channel_bias<P: Precision>(y: Tensor<P>, bias: Option<&Var>) -> Result<Tensor<P>> {
    let Some(b) = bias else { return Ok(y) };
    let mut shape = vec![1; y.rank()];
    shape[1] = b.dim(0)?;
    y.broadcast_add(&weight_as::<P>(b)?.reshape(shape)?)
}

/// 1-D convolution over `(batch, c_in, length)`; a lower-precision op.
#[derive(Clone, Debug)]
pub struct Conv1d {
    weight: Var,
    bias: Option<Var>,
    config: Conv1dConfig,
}

impl Conv1d {
    /// A layer from an f32 weight `(c_out, c_in / groups, k)` and an optional f32 bias `(c_out)`.
    pub fn new(weight: Var, bias: Option<Var>, config: Conv1dConfig) -> Result<Self> {
        let (weight, bias) = checked(weight, bias, "Conv1d weight", 3)?;
        Ok(Self {
            weight,
            bias,
            config,
        })
    }

    /// The f32 master weight.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The f32 master bias, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The convolution parameters.
    pub fn config(&self) -> &Conv1dConfig {
        &self.config
    }

    /// Applies the convolution in `x`'s precision.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        let c = &self.config;
        let y = x.conv1d(
            &weight_as::<P>(&self.weight)?,
            c.padding,
            c.stride,
            c.dilation,
            c.groups,
        )?;
        add_channel_bias(y, self.bias.as_ref())
    }
}

impl AmpLayer for Conv1d {
    type Op = op::conv1d;
}

/// 2-D convolution over `(batch, c_in, h, w)`; a lower-precision op (bf16 works on CPU too).
#[derive(Clone, Debug)]
pub struct Conv2d {
    weight: Var,
    bias: Option<Var>,
    config: Conv2dConfig,
}

impl Conv2d {
    /// A layer from an f32 weight `(c_out, c_in / groups, kh, kw)` and an optional f32 bias.
    pub fn new(weight: Var, bias: Option<Var>, config: Conv2dConfig) -> Result<Self> {
        let (weight, bias) = checked(weight, bias, "Conv2d weight", 4)?;
        Ok(Self {
            weight,
            bias,
            config,
        })
    }

    /// The f32 master weight.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The f32 master bias, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The convolution parameters.
    pub fn config(&self) -> &Conv2dConfig {
        &self.config
    }

    /// Applies the convolution in `x`'s precision.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        let c = &self.config;
        let y = x.conv2d(
            &weight_as::<P>(&self.weight)?,
            c.padding,
            c.stride,
            c.dilation,
            c.groups,
        )?;
        add_channel_bias(y, self.bias.as_ref())
    }
}

impl AmpLayer for Conv2d {
    type Op = op::conv2d;
}

/// A `Conv1d` with bias, initialised as candle-nn's `conv1d`.
pub fn conv1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv1dConfig,
    vb: VarBuilder,
) -> Result<Conv1d> {
    conv1d_impl(in_channels, out_channels, kernel_size, config, true, &vb)
}

/// A `Conv1d` without bias.
pub fn conv1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv1dConfig,
    vb: VarBuilder,
) -> Result<Conv1d> {
    conv1d_impl(in_channels, out_channels, kernel_size, config, false, &vb)
}

fn conv1d_impl(
    c_in: usize,
    c_out: usize,
    k: usize,
    config: Conv1dConfig,
    with_bias: bool,
    vb: &VarBuilder,
) -> Result<Conv1d> {
    let c_in_g = c_in / config.groups.max(1);
    let (w, b) = conv_params(&[c_out, c_in_g, k], c_in_g * k, with_bias, vb)?;
    Conv1d::new(w, b, config)
}

/// A `Conv2d` with bias and a square kernel, initialised as candle-nn's `conv2d`.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    conv2d_impl(in_channels, out_channels, kernel_size, config, true, &vb)
}

/// A `Conv2d` without bias.
pub fn conv2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    conv2d_impl(in_channels, out_channels, kernel_size, config, false, &vb)
}

fn conv2d_impl(
    c_in: usize,
    c_out: usize,
    k: usize,
    config: Conv2dConfig,
    with_bias: bool,
    vb: &VarBuilder,
) -> Result<Conv2d> {
    let c_in_g = c_in / config.groups.max(1);
    let (w, b) = conv_params(&[c_out, c_in_g, k, k], c_in_g * k * k, with_bias, vb)?;
    Conv2d::new(w, b, config)
}
