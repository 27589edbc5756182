//! Convolutions, PyTorch's `nn.Conv1d`, `nn.Conv2d` and `nn.ConvTranspose2d`, configured with
//! candle-nn's `Conv1dConfig`/`Conv2dConfig` (padding, stride, dilation, groups) and
//! `ConvTranspose2dConfig` (padding, output padding, stride, dilation).
//!
//! Both are in autocast's lower-precision class (`op::conv1d`/`op::conv2d`, like PyTorch's
//! `conv1d`/`conv2d` on the fp16/bf16 list): they run in their input's precision, with the f32
//! master weight and bias cast to it per call. Outside a region an f32 input stays f32 and a
//! half input runs in half; inside an `#[autocast(bf16)]` region an f32 input is cast and the
//! convolution runs in bf16 (on CPU too).
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! # use amp_macros::autocast;
//! use candle_amp::nn::{self, Conv1dConfig, Conv2d, Conv2dConfig};
//! use candle_amp::{Tensor, F16, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! let cfg = Conv2dConfig { padding: 1, ..Default::default() };
//! let conv = nn::conv2d(3, 8, 3, cfg, vb.pp("conv"))?; // f32 weight (8, 3, 3, 3)
//!
//! let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 16, 16), &dev)?;
//! assert_eq!(conv.forward(&x)?.dims(), &[2, 8, 16, 16]); // no region: f32
//! let c1 = nn::conv1d(3, 4, 3, Conv1dConfig::default(), vb.pp("c1"))?;
//! let s = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 10), &dev)?.cast::<F16>()?;
//! let h: Tensor<F16> = c1.forward(&s)?; // an f16 input runs in f16
//! assert_eq!(h.dims(), &[2, 4, 8]);
//!
//! struct Stem { conv: Conv2d }
//! #[autocast(bf16)]
//! impl Stem {
//!     fn forward(&self, x: &Tensor<F32>) -> candle_core::Result<Tensor<F32>> {
//!         let h = self.conv.forward(&x)?;
//!         assert_eq!(h.dtype(), DType::BF16); // lower-precision op: runs in bf16
//!         Ok(h.relu()?)
//!     }
//! }
//! let y = Stem { conv }.forward(&x)?; // f32 at the region's exit
//! assert_eq!((y.dtype(), y.dims()), (DType::F32, &[2, 8, 16, 16][..]));
//! # Ok(()) }
//! ```

use candle_core::{Result, Var};
use candle_nn::{Conv1dConfig, Conv2dConfig, ConvTranspose2dConfig, VarBuilder};

use super::{
    count_master_casts, expect_dims, master, master_weight_and_bias, region_forward, AmpLayer,
};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// Builds a convolution's weight `(c_out, c_in / groups, kernel...)` (Kaiming normal) and bias
/// (uniform in `±1/sqrt(fan_in)`), as candle-nn and PyTorch initialise convolutions.
fn conv_params(
    c_in: usize,
    c_out: usize,
    kernel: &[usize],
    groups: usize,
    with_bias: bool,
    vb: &VarBuilder,
) -> Result<(Var, Option<Var>)> {
    // The weight's shape needs `c_in / groups`; the layer's constructor checks the rest.
    if groups == 0 || !c_in.is_multiple_of(groups) {
        candle_core::bail!(
            "convolution: {c_in} input channels must split into groups, got {groups} groups"
        )
    }
    let c_in_g = c_in / groups;
    let shape: Vec<usize> = [c_out, c_in_g].iter().chain(kernel).copied().collect();
    crate::kernels::layout::check_allocatable("convolution's weight", &shape)?;
    let fan_in = kernel.iter().product::<usize>() * c_in_g;
    let (weight_init, bias_init) = super::fan_in_init(fan_in);
    let w = super::parameter(vb, shape, "weight", weight_init)?;
    let bias = if with_bias {
        Some(Var::from_tensor(&super::parameter(
            vb, c_out, "bias", bias_init,
        )?)?)
    } else {
        None
    };
    Ok((Var::from_tensor(&w)?, bias))
}

/// candle-nn's convolution configurations as the kernels' parameters.
macro_rules! kernel_params {
    ($($config:ty),*) => {$(
        impl From<&$config> for crate::kernels::Conv2dParams {
            fn from(c: &$config) -> Self {
                Self {
                    padding: c.padding,
                    stride: c.stride,
                    dilation: c.dilation,
                    groups: c.groups,
                }
            }
        }
    )*};
}
kernel_params!(Conv1dConfig, Conv2dConfig);

macro_rules! conv_layer {
    ($(#[$doc:meta])* $name:ident, $config:ident, $op:ident, rank $rank:literal, $shape:literal) => {
        $(#[$doc])*
        #[derive(Clone, Debug)]
        pub struct $name {
            weight: Var,
            bias: Option<Var>,
            config: $config,
        }

        impl $name {
            #[doc = concat!("A layer from an f32 weight `", $shape, "` and an optional f32 bias `(c_out)`.")]
            pub fn new(weight: Var, bias: Option<Var>, config: $config) -> Result<Self> {
                let (weight, bias) = master_weight_and_bias(weight, bias, stringify!($name), $rank)?;
                let params = crate::kernels::Conv2dParams::from(&config);
                params.check(stringify!($name))?;
                let c_out = weight.dim(0)?;
                if !c_out.is_multiple_of(config.groups) {
                    candle_core::bail!(
                        "{}: {c_out} output channels do not split into {} groups",
                        stringify!($name),
                        config.groups
                    )
                }
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
            pub fn config(&self) -> &$config {
                &self.config
            }

            /// Applies the convolution in `x`'s precision: with its bias, in one op on the f32
            /// masters (on CPU: rounded to `P` inside the op, counted as the casts they stand
            /// for; the bias added before the output's one rounding; the masters' gradients f32
            /// from the accumulators).
            pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
                if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
                    return y;
                }
                let bias = self.bias.as_ref();
                count_master_casts::<P>(&self.weight, bias);
                crate::kernels::$op(
                    x.as_candle(),
                    self.weight.as_tensor(),
                    bias.map(Var::as_tensor),
                    (&self.config).into(),
                )
                .map(Tensor::wrap)
            }
        }

        impl AmpLayer for $name {
            type Op = op::$op;
        }
        region_forward!($name);
    };
}

conv_layer!(
    /// 1-D convolution over `(batch, c_in, length)`; a lower-precision op (the 2-D one of
    /// height 1: its gradients summed in f32).
    Conv1d, Conv1dConfig, conv1d, rank 3, "(c_out, c_in / groups, k)"
);
conv_layer!(
    /// 2-D convolution over `(batch, c_in, h, w)`; a lower-precision op (bf16 works on CPU too).
    Conv2d, Conv2dConfig, conv2d, rank 4, "(c_out, c_in / groups, kh, kw)"
);

/// A `Conv1d` with bias, initialised as candle-nn's `conv1d`.
pub fn conv1d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv1dConfig,
    vb: VarBuilder,
) -> Result<Conv1d> {
    let (w, b) = conv_params(
        in_channels,
        out_channels,
        &[kernel_size],
        config.groups,
        true,
        &vb,
    )?;
    Conv1d::new(w, b, config)
}

/// A `Conv1d` without bias.
pub fn conv1d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv1dConfig,
    vb: VarBuilder,
) -> Result<Conv1d> {
    let (w, _) = conv_params(
        in_channels,
        out_channels,
        &[kernel_size],
        config.groups,
        false,
        &vb,
    )?;
    Conv1d::new(w, None, config)
}

/// A `Conv2d` with bias and a square kernel, initialised as candle-nn's `conv2d`.
pub fn conv2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    let kernel = [kernel_size, kernel_size];
    let (w, b) = conv_params(in_channels, out_channels, &kernel, config.groups, true, &vb)?;
    Conv2d::new(w, b, config)
}

/// A `Conv2d` without bias.
pub fn conv2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: Conv2dConfig,
    vb: VarBuilder,
) -> Result<Conv2d> {
    let kernel = [kernel_size, kernel_size];
    let (w, _) = conv_params(
        in_channels,
        out_channels,
        &kernel,
        config.groups,
        false,
        &vb,
    )?;
    Conv2d::new(w, None, config)
}

/// 2-D transposed convolution over `(batch, c_in, h, w)`, PyTorch's `nn.ConvTranspose2d` (no
/// groups, as candle-nn's): a lower-precision op. The f32 master weight `(c_in, c_out, kh, kw)`
/// is cast to the input's precision per call (in a region, the policy's), the product
/// accumulates in f32 and rounds once (on CPU a GEMM and col2im; with `cudnn`, cuDNN's
/// backward-data), then the f32 bias is added, its gradient summed in f32. Configured as candle-nn's `ConvTranspose2d`; its arguments are checked as PyTorch
/// checks them (stride and dilation at least 1, the output padding below the stride or the
/// dilation).
#[derive(Clone, Debug)]
pub struct ConvTranspose2d {
    weight: Var,
    bias: Option<Var>,
    config: ConvTranspose2dConfig,
}

impl ConvTranspose2d {
    /// A layer from an f32 weight `(c_in, c_out, kh, kw)` and an optional f32 bias `(c_out)`.
    pub fn new(weight: Var, bias: Option<Var>, config: ConvTranspose2dConfig) -> Result<Self> {
        let weight = master(weight, "ConvTranspose2d weight")?;
        expect_dims(&weight, "ConvTranspose2d weight", 4)?;
        let bias = bias
            .map(|b| master(b, "ConvTranspose2d bias"))
            .transpose()?;
        if let Some(b) = &bias {
            if b.dims() != [weight.dim(1)?] {
                candle_core::bail!(
                    "ConvTranspose2d bias: expected shape [{}] (the weight's output channels, \
                     its second dimension), got {:?}",
                    weight.dim(1)?,
                    b.dims()
                )
            }
        }
        let c = config;
        if c.stride == 0 || c.dilation == 0 || c.output_padding >= c.stride.max(c.dilation) {
            candle_core::bail!(
                "ConvTranspose2d: stride and dilation must be at least 1 and the output padding \
                 smaller than one of them, got stride {}, dilation {}, output padding {}",
                c.stride,
                c.dilation,
                c.output_padding
            )
        }
        Ok(Self {
            weight,
            bias,
            config,
        })
    }

    /// The f32 master weight `(c_in, c_out, kh, kw)`.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The f32 master bias `(c_out)`, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The convolution parameters.
    pub fn config(&self) -> &ConvTranspose2dConfig {
        &self.config
    }

    /// Applies the transposed convolution in `x`'s precision.
    pub fn forward<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        transposed(
            x.as_candle(),
            self.weight.as_tensor(),
            self.bias.as_ref().map(Var::as_tensor),
            &self.config,
        )
        .map(Tensor::wrap)
    }
}

/// A transposed convolution layer's op on `x`: the weight cast to `x`'s dtype (through the cast
/// cache, as a region casts a master), the product, then the bias added in f32 and rounded
/// once, its gradient summed in f32 (counted as the bias's cast). candle-nn's `ConvTranspose2d`
/// in a region runs the same.
pub(crate) fn transposed(
    x: &candle_core::Tensor,
    w: &candle_core::Tensor,
    b: Option<&candle_core::Tensor>,
    c: &ConvTranspose2dConfig,
) -> Result<candle_core::Tensor> {
    if x.rank() != 4 {
        // The shared check would name the 1-D transposed convolution for a rank-3 input.
        candle_core::bail!(
            "ConvTranspose2d: the input must be (batch, channels, h, w), got {:?}",
            x.dims()
        )
    }
    let params = crate::kernels::TransposeParams {
        padding: c.padding,
        output_padding: c.output_padding,
        stride: c.stride,
        dilation: c.dilation,
        groups: 1,
    };
    let y = crate::kernels::conv_transpose(x, &crate::cast::convert(w, x.dtype())?, params)?;
    let Some(b) = b else {
        return Ok(y);
    };
    if y.dtype() != candle_core::DType::F32 {
        crate::cast::count_casts(1, b.elem_count(), y.dtype());
    }
    let b = crate::cast::convert(b, candle_core::DType::F32)?;
    crate::kernels::add_bias(&y, &b, 1)
}

impl AmpLayer for ConvTranspose2d {
    type Op = op::conv_transpose2d;
}
region_forward!(ConvTranspose2d);

/// A `ConvTranspose2d` with bias and a square kernel, initialised as candle-nn's
/// `conv_transpose2d` and PyTorch's `nn.ConvTranspose2d` (weight and bias uniform in
/// `±1 / (sqrt(c_out) k)`).
pub fn conv_transpose2d(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: ConvTranspose2dConfig,
    vb: VarBuilder,
) -> Result<ConvTranspose2d> {
    let (w, init) = transpose_weight(in_channels, out_channels, kernel_size, &vb)?;
    let b = Var::from_tensor(&super::parameter(&vb, out_channels, "bias", init)?)?;
    ConvTranspose2d::new(w, Some(b), config)
}

/// A `ConvTranspose2d` without bias.
pub fn conv_transpose2d_no_bias(
    in_channels: usize,
    out_channels: usize,
    kernel_size: usize,
    config: ConvTranspose2dConfig,
    vb: VarBuilder,
) -> Result<ConvTranspose2d> {
    let (w, _) = transpose_weight(in_channels, out_channels, kernel_size, &vb)?;
    ConvTranspose2d::new(w, None, config)
}

/// A transposed convolution's weight `(c_in, c_out, k, k)` and the initialisation it used.
fn transpose_weight(
    c_in: usize,
    c_out: usize,
    k: usize,
    vb: &VarBuilder,
) -> Result<(Var, candle_nn::Init)> {
    if c_out == 0 || k == 0 {
        candle_core::bail!(
            "ConvTranspose2d: output channels and kernel size must be positive, got {c_out} and {k}"
        )
    }
    let bound = 1.0 / (c_out as f64).sqrt() / k as f64;
    let init = candle_nn::Init::Uniform {
        lo: -bound,
        up: bound,
    };
    let w = super::parameter(vb, (c_in, c_out, k, k), "weight", init)?;
    Ok((Var::from_tensor(&w)?, init))
}
