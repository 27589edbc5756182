//! `ConvBn2d`: a `Conv2d` and the `BatchNorm2d` after it, as one layer, and `ConvBnReLU2d`, the
//! same followed by a ReLU (PyTorch's fused-module namespace has both,
//! `torch.ao.nn.intrinsic.ConvBn2d` and `ConvBnReLU2d`).
//!
//! On CPU it runs as one op (`kernels::batch_norm::conv_batch_norm`) that normalises the
//! convolution's f32 sums, where the two layers in a row round the conv's output to half first
//! and batch norm then subtracts each channel's mean from the rounded values. That subtraction
//! is where a bf16 forward loses most of its accuracy in a conv + batch-norm net: the conv's
//! outputs commonly sit a few spreads away from zero, so their rounding error, relative to the
//! value, becomes several times larger relative to the normalised one. PyTorch's autocast rounds
//! there; this layer does not, and is otherwise the same computation: the conv's operands in the
//! region's precision (the input cast, the f32 master weight and bias rounded), f32 statistics,
//! the output in the input's precision, the gradients of every parameter f32. The graph keeps
//! as much as the two layers' graph (a half tensor the size of the output, the normalised
//! values, in place of the conv's output) in one node instead of two. Training on CUDA, for the
//! convolutions that are one op there (cuDNN's, pointwise products), it is one node too
//! (`kernels::batch_norm::after_conv_op`): the conv's output rounded to the input's precision
//! first, as between the two layers, the conv bias folded as on the CPU. Elsewhere (evaluation
//! on CUDA, other devices, convolutions neither kernel takes) it is the two layers in a row.
//!
//! `ConvBnReLU2d` applies the ReLU in the same op, on the f32 output before it is rounded (ReLU
//! commutes with rounding, so the values are those of `ConvBn2d` and `relu`), and its backward
//! takes the ReLU's mask from the output: the graph has no ReLU node, and a training step skips
//! the ReLU's pass, its gradient's allocation and the accumulation candle's backward does per
//! node (on the 256-channel `quantized_sine` net, about a sixth of the bf16 step).
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! # use amp_macros::autocast;
//! use candle_amp::nn::{self, ConvBn2d};
//! use candle_amp::{Tensor, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
//! let cfg = nn::Conv2dConfig { padding: 1, ..Default::default() };
//! let block = ConvBn2d::new(
//!     nn::conv2d_no_bias(3, 8, 3, cfg, vb.pp("conv"))?, // the same variables as the two layers
//!     nn::batch_norm2d(8, 1e-5, vb.pp("bn"))?,
//! )?;
//! struct Stem { block: ConvBn2d }
//! #[autocast(bf16)]
//! impl Stem {
//!     fn forward(&self, x: &Tensor<F32>, train: bool) -> candle_core::Result<Tensor<F32>> {
//!         let h = self.block.forward_t(&x, train)?; // conv in bf16, normalised in f32
//!         assert_eq!(h.dtype(), DType::BF16);
//!         Ok(h.relu()?)
//!     }
//! }
//! let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 8, 8), &Device::Cpu)?;
//! let y = Stem { block }.forward(&x, true)?;
//! assert_eq!(y.dims(), &[2, 8, 8, 8]);
//! # Ok(()) }
//! ```

use candle_core::{Result, Var};

use super::{count_master_casts, AmpLayer, BatchNorm2d, Conv2d};
use crate::kernels::{self, Conv2dParams};
use crate::op;
use crate::precision::Precision;
use crate::tensor::Tensor;

/// A `Conv2d` followed by a `BatchNorm2d` over its output channels; see the module docs.
#[derive(Clone, Debug)]
pub struct ConvBn2d {
    conv: Conv2d,
    bn: BatchNorm2d,
    /// A ReLU after the batch norm (`ConvBnReLU2d`).
    relu: bool,
    /// The conv's bias where it has none: f32 zeros on the weight's device, made once (the
    /// fused ops take a bias row).
    zero_bias: candle_core::Tensor,
}

impl ConvBn2d {
    /// The pair, checked: the batch norm normalises the conv's output channels.
    pub fn new(conv: Conv2d, bn: BatchNorm2d) -> Result<Self> {
        let c_out = conv.weight().dim(0)?;
        if bn.channels() != c_out {
            candle_core::bail!(
                "ConvBn2d: the conv has {c_out} output channels, the batch norm {}",
                bn.channels()
            )
        }
        let w = conv.weight();
        let zero_bias = candle_core::Tensor::zeros(c_out, candle_core::DType::F32, w.device())?;
        Ok(Self {
            conv,
            bn,
            relu: false,
            zero_bias,
        })
    }

    /// The convolution.
    pub fn conv(&self) -> &Conv2d {
        &self.conv
    }

    /// The batch norm.
    pub fn bn(&self) -> &BatchNorm2d {
        &self.bn
    }

    /// [`Self::forward_t`] in training mode.
    pub fn forward_train<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        self.forward_t(x, true)
    }

    /// `bn.forward_t(&conv.forward(x)?, train)`, in `x`'s precision, without rounding the
    /// conv's output on CPU. `train` as for `BatchNorm2d`.
    pub fn forward_t<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward_t, _>(self, (x, train))
        {
            return y;
        }
        if x.elem_count() == 0 {
            // An empty batch: the conv's empty output, the batch norm's statistics left as
            // they are (`BatchNorm2d` returns an empty input as it is).
            return self.conv.forward(x);
        }
        let (w, bias) = (self.conv.weight(), self.conv.bias());
        let params = Conv2dParams::from(self.conv.config());
        let x = x.as_candle();
        if !(x.device().is_cpu() && kernels::conv2d_handles(x, w.as_tensor(), params)) {
            if train && kernels::conv_one_op_on_cuda(x, w.as_tensor(), params) {
                return self.forward_train_cuda(x);
            }
            // The conv op, then batch norm (and the ReLU in the same op).
            let z = self.conv.forward(&Tensor::<P>::wrap(x.clone()))?;
            return if self.relu {
                self.bn.forward_t_relu(&z, train)
            } else {
                self.bn.forward_t(&z, train)
            };
        }
        count_master_casts::<P>(w, bias);
        let packed = self.packed_params(x.device())?;
        let c = self.bn.channels();
        let running = if train {
            None
        } else {
            Some(self.bn.running_stats()?)
        };
        let eps = self.bn.eps();
        let (z, batch) = kernels::batch_norm::conv_batch_norm(
            x,
            w.as_tensor(),
            &packed,
            params,
            eps,
            running,
            self.relu,
        )?;
        self.bn.check_input(z.dims(), train)?;
        if let Some((mean, var)) = batch {
            self.bn.record_batch(&mean, &var, z.elem_count() / c)?;
        }
        Tensor::from_candle(z)
    }

    /// A training forward on CUDA, for the convolutions that are one op there: one node of
    /// the graph (`kernels::batch_norm::conv_batch_norm_train`).
    fn forward_train_cuda<P: Precision>(&self, x: &candle_core::Tensor) -> Result<Tensor<P>> {
        let w = self.conv.weight();
        count_master_casts::<P>(w, self.conv.bias());
        let (y, rows) = kernels::batch_norm::conv_batch_norm_train(
            x,
            w.as_tensor(),
            &self.packed_params(x.device())?,
            Conv2dParams::from(self.conv.config()),
            self.bn.running(),
            self.relu,
            |dims| self.bn.check_input(dims, true),
        )?;
        self.bn.set_running(&rows)?;
        Tensor::from_candle(y)
    }

    /// The conv's bias, the batch norm's scale and its shift as the rows of one f32 `(3, c)`
    /// tensor (zeros and ones where the layers have none), the fused ops' parameters.
    fn packed_params(&self, dev: &candle_core::Device) -> Result<candle_core::Tensor> {
        let c = self.bn.channels();
        let f32_zeros = || candle_core::Tensor::zeros(c, candle_core::DType::F32, dev);
        let f32_ones = || candle_core::Tensor::ones(c, candle_core::DType::F32, dev);
        let conv_bias = self.conv.bias().map_or(&self.zero_bias, |b| b.as_tensor());
        let (gamma, beta) = match self.bn.affine() {
            Some((g, b)) => (g.as_tensor().clone(), b.as_tensor().clone()),
            None => (f32_ones()?, f32_zeros()?),
        };
        kernels::batch_norm::pack_rows([conv_bias, &gamma, &beta])
    }

    /// The variables: the conv's weight (and bias), the batch norm's scale and shift (if
    /// affine).
    pub fn vars(&self) -> Vec<&Var> {
        let mut vars = vec![self.conv.weight()];
        vars.extend(self.conv.bias());
        if let Some((g, b)) = self.bn.affine() {
            vars.extend([g, b]);
        }
        vars
    }
}

impl AmpLayer for ConvBn2d {
    /// A convolution first: it runs in the region's lower precision.
    type Op = op::conv_bn2d;
}

/// A `Conv2d`, the `BatchNorm2d` over its output channels and a ReLU; see the module docs.
#[derive(Clone, Debug)]
pub struct ConvBnReLU2d(ConvBn2d);

impl ConvBnReLU2d {
    /// The pair, checked as for [`ConvBn2d::new`], with a ReLU after it.
    pub fn new(conv: Conv2d, bn: BatchNorm2d) -> Result<Self> {
        let mut inner = ConvBn2d::new(conv, bn)?;
        inner.relu = true;
        Ok(Self(inner))
    }

    /// The convolution.
    pub fn conv(&self) -> &Conv2d {
        self.0.conv()
    }

    /// The batch norm.
    pub fn bn(&self) -> &BatchNorm2d {
        self.0.bn()
    }

    /// [`Self::forward_t`] in training mode.
    pub fn forward_train<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        self.forward_t(x, true)
    }

    /// `bn.forward_t(&conv.forward(x)?, train)?.relu()`, in `x`'s precision, as one op on CPU.
    pub fn forward_t<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward_t, _>(self, (x, train))
        {
            return y;
        }
        self.0.forward_t(x, train)
    }

    /// The variables, as [`ConvBn2d::vars`].
    pub fn vars(&self) -> Vec<&Var> {
        self.0.vars()
    }
}

impl AmpLayer for ConvBnReLU2d {
    /// A convolution first: it runs in the region's lower precision.
    type Op = op::conv_bn_relu2d;
}

super::region_forward_t!(ConvBn2d, ConvBnReLU2d);
