//! Normalisation layers: `LayerNorm` and `RmsNorm` (PyTorch's `nn.LayerNorm`, `nn.RMSNorm`)
//! over the last dimension, and `BatchNorm2d` over `(batch, channels, h, w)`.
//!
//! `LayerNorm` and `RmsNorm` are in autocast's fp32 class (`op::layer_norm`/`op::rms_norm`, as
//! `layer_norm` on PyTorch's fp32 list): they compute in f32 and return f32, also from a bf16 or
//! f16 value inside a region. Outside a region they take `Tensor<F32>` (a half input is a
//! compile error; [`crate::fp32::layer_norm`] is the explicit path).
//! `BatchNorm2d` (`op::batch_norm`) is on no list: it returns its input's precision, with f32
//! parameters, running statistics and arithmetic inside (cuDNN's behaviour). In a region, call
//! it as `bn.forward_t(&x, train)`.
//!
//! ```
//! # extern crate amp_runtime as candle_amp;
//! # use amp_macros::autocast;
//! use candle_amp::nn::{self, BatchNorm2d, Conv2d, Conv2dConfig, LayerNorm};
//! use candle_amp::{Tensor, F16, F32};
//! use candle_core::{DType, Device};
//! use candle_nn::{VarBuilder, VarMap};
//! # fn main() -> candle_core::Result<()> {
//! let dev = Device::Cpu;
//! let vars = VarMap::new();
//! let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
//! let ln = nn::layer_norm(4, 1e-5, vb.pp("ln"))?;
//! let rms = nn::rms_norm(4, 1e-6, vb.pp("rms"))?;
//! let x = Tensor::<F32>::randn(0.0, 1.0, (2, 3, 4, 4), &dev)?;
//! assert_eq!(rms.forward(&ln.forward(&x)?)?.dims(), &[2, 3, 4, 4]); // no region: f32
//! let bn = nn::batch_norm2d(8, 1e-5, vb.pp("bn"))?;
//! let x16 = Tensor::<F32>::randn(0.0, 1.0, (2, 8, 4, 4), &dev)?.cast::<F16>()?;
//! let h: Tensor<F16> = bn.forward_train(&x16)?; // f16 in, f16 out (f32 statistics inside)
//!
//! struct Block { conv: Conv2d, bn: BatchNorm2d, ln: LayerNorm }
//! #[autocast(bf16)]
//! impl Block {
//!     fn forward(&self, x: &Tensor<F32>, train: bool) -> candle_core::Result<Tensor<F32>> {
//!         let h = self.bn.forward_t(&self.conv.forward(&x)?, train)?;
//!         assert_eq!(h.dtype(), DType::BF16); // batch norm: the conv's bf16 in, bf16 out
//!         let y = self.ln.forward(&h.relu()?)?;
//!         assert_eq!(y.dtype(), DType::F32); // fp32 class: f32 out
//!         Ok(y)
//!     }
//! }
//! let conv = nn::conv2d(3, 8, 1, Conv2dConfig::default(), vb.pp("conv"))?;
//! let block = Block { conv, bn, ln };
//! assert_eq!(block.forward(&x, true)?.dims(), &[2, 8, 4, 4]);
//! # Ok(()) }
//! ```

use candle_core::{DType, Result, Var};
use candle_nn::{BatchNormConfig, VarBuilder};

use super::{expect_dims, master, weight_as, AmpLayer};
use crate::op::{self, Fp32Input};
use crate::precision::{Precision, F32};
use crate::region::{calls, unary, unary_widening, AmpTensor, AsAmp, Policy, RegionCall};
use crate::tensor::Tensor;
use crate::{composite, fp32, kernels};

/// Layer norm over the last dimension; an fp32-class op (f32 output, as PyTorch's autocast).
#[derive(Clone, Debug)]
pub struct LayerNorm {
    weight: Var,
    bias: Option<Var>,
    eps: f64,
}

impl LayerNorm {
    /// A layer norm from an f32 scale `(size)`, an optional f32 shift and `eps`.
    pub fn new(weight: Var, bias: Option<Var>, eps: f64) -> Result<Self> {
        let weight = master(weight, "LayerNorm weight")?;
        expect_dims(&weight, "LayerNorm weight", 1)?;
        let bias = bias.map(|b| master(b, "LayerNorm bias")).transpose()?;
        composite::check_eps("LayerNorm", eps)?;
        Ok(Self { weight, bias, eps })
    }

    /// The f32 scale.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The f32 shift, if any.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The epsilon added to the variance.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Normalises `x` in f32. Outside autocast `x` is `Tensor<F32>`; a half input is a compile
    /// error (use an autocast region, or [`fp32::layer_norm`] explicitly).
    pub fn forward<P: Fp32Input<op::layer_norm>>(&self, x: &Tensor<P>) -> Result<Tensor<F32>> {
        if let Some(y) = super::followed::<F32, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        let bias = self.bias.as_ref().map(weight_as::<F32>).transpose()?;
        fp32::layer_norm(x, &weight_as(&self.weight)?, bias.as_ref(), self.eps)
    }
}

impl AmpLayer for LayerNorm {
    type Op = op::layer_norm;
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for LayerNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        let bias = self.bias().map(Var::as_tensor);
        unary_widening::<Pol, op::layer_norm>(
            &x.to_amp(),
            |x| composite::layer_norm_f32(x, self.weight(), bias, self.eps()),
            |x| composite::layer_norm(x, self.weight(), bias, self.eps()),
        )
    }
}

/// Group normalisation (PyTorch's `nn.GroupNorm`, candle-nn's `GroupNorm`): over each group of
/// channels and all positions of an input `(batch, channels, ..)`, then a per-channel scale and
/// shift. Fp32-class (PyTorch's autocast lists `group_norm` there): computed in f32 from any
/// input precision, with f32 masters.
#[derive(Clone, Debug)]
pub struct GroupNorm {
    weight: Var,
    bias: Var,
    groups: usize,
    eps: f64,
}

impl GroupNorm {
    /// A group norm of `groups` groups from an f32 scale and shift `(channels)` and `eps`; the
    /// channels must split evenly into the groups, as PyTorch's constructor requires.
    pub fn new(weight: Var, bias: Var, groups: usize, eps: f64) -> Result<Self> {
        let weight = master(weight, "GroupNorm weight")?;
        let bias = master(bias, "GroupNorm bias")?;
        expect_dims(&weight, "GroupNorm weight", 1)?;
        expect_dims(&bias, "GroupNorm bias", 1)?;
        let channels = weight.elem_count();
        if bias.elem_count() != channels {
            candle_core::bail!(
                "GroupNorm: the bias has {} values, the weight {channels}",
                bias.elem_count()
            )
        }
        if groups == 0 || !channels.is_multiple_of(groups) {
            candle_core::bail!(
                "GroupNorm: {channels} channels do not split into {groups} groups (num_channels \
                 must be divisible by num_groups, as in PyTorch)"
            )
        }
        composite::check_eps("GroupNorm", eps)?;
        Ok(Self {
            weight,
            bias,
            groups,
            eps,
        })
    }

    /// The number of groups.
    pub fn groups(&self) -> usize {
        self.groups
    }

    /// Normalises `x` in f32. Outside autocast `x` is `Tensor<F32>`; a half input is a compile
    /// error (use an autocast region).
    pub fn forward<P: Fp32Input<op::group_norm>>(&self, x: &Tensor<P>) -> Result<Tensor<F32>> {
        if let Some(y) = super::followed::<F32, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        let y = composite::group_norm(
            x.as_candle(),
            self.weight.as_tensor(),
            self.bias.as_tensor(),
            self.groups,
            self.eps,
        )?;
        Tensor::from_candle(y)
    }
}

impl AmpLayer for GroupNorm {
    type Op = op::group_norm;
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for GroupNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        unary::<Pol, op::group_norm>(&x.to_amp(), |x| {
            let (w, b) = (self.weight.as_tensor(), self.bias.as_tensor());
            composite::group_norm(x, w, b, self.groups, self.eps)
        })
    }
}

/// A group norm as candle-nn's `group_norm`: `groups` groups of `channels`, scale ones and
/// shift zeros from `vb` (`weight`, `bias`).
pub fn group_norm(groups: usize, channels: usize, eps: f64, vb: VarBuilder) -> Result<GroupNorm> {
    let weight = super::parameter(&vb, channels, "weight", candle_nn::Init::Const(1.))?;
    let bias = super::parameter(&vb, channels, "bias", candle_nn::Init::Const(0.))?;
    GroupNorm::new(
        Var::from_tensor(&weight)?,
        Var::from_tensor(&bias)?,
        groups,
        eps,
    )
}

/// A layer norm as candle-nn's `layer_norm`: `config` is an `eps` (`1e-5`) or a
/// [`LayerNormConfig`](candle_nn::LayerNormConfig). Affine (the default): a trained scale (ones)
/// and shift (zeros) from `vb`; not affine: a fixed scale of ones and no shift. A config with
/// `remove_mean: false` is an RMS norm, which is [`rms_norm`].
pub fn layer_norm<C: Into<candle_nn::LayerNormConfig>>(
    size: usize,
    config: C,
    vb: VarBuilder,
) -> Result<LayerNorm> {
    let config = config.into();
    if !config.remove_mean {
        candle_core::bail!(
            "layer_norm: a LayerNormConfig with `remove_mean: false` is an RMS norm; use \
             `nn::rms_norm(size, eps, vb)`"
        );
    }
    if !config.affine {
        let ones = candle_core::Tensor::ones(size, DType::F32, vb.device())?;
        return LayerNorm::new(Var::from_tensor(&ones)?, None, config.eps);
    }
    let weight = super::parameter(&vb, size, "weight", candle_nn::Init::Const(1.))?;
    let bias = super::parameter(&vb, size, "bias", candle_nn::Init::Const(0.))?;
    LayerNorm::new(
        Var::from_tensor(&weight)?,
        Some(Var::from_tensor(&bias)?),
        config.eps,
    )
}

/// RMS norm over the last dimension; an fp32-class op.
#[derive(Clone, Debug)]
pub struct RmsNorm {
    weight: Var,
    eps: f64,
}

impl RmsNorm {
    /// An RMS norm from an f32 scale `(size)` and `eps`.
    pub fn new(weight: Var, eps: f64) -> Result<Self> {
        let weight = master(weight, "RmsNorm weight")?;
        expect_dims(&weight, "RmsNorm weight", 1)?;
        composite::check_eps("RmsNorm", eps)?;
        Ok(Self { weight, eps })
    }

    /// The f32 scale.
    pub fn weight(&self) -> &Var {
        &self.weight
    }

    /// The epsilon added to the mean square.
    pub fn eps(&self) -> f64 {
        self.eps
    }

    /// Normalises `x` in f32 (`Tensor<F32>` outside autocast).
    pub fn forward<P: Fp32Input<op::rms_norm>>(&self, x: &Tensor<P>) -> Result<Tensor<F32>> {
        if let Some(y) = super::followed::<F32, crate::region::calls::forward, _>(self, (x,)) {
            return y;
        }
        fp32::rms_norm(x, &weight_as(&self.weight)?, self.eps)
    }
}

impl AmpLayer for RmsNorm {
    type Op = op::rms_norm;
}

impl<Pol: Policy, A: AsAmp> RegionCall<Pol, calls::forward, (A,)> for RmsNorm {
    type Output = AmpTensor;
    fn region_call(&self, (x,): (A,)) -> Result<AmpTensor> {
        routed_rms_norm::<Pol>(&x.to_amp(), self.weight(), self.eps())
    }
}

/// An RMS norm in a region (this crate's layer or candle-nn's): fp32-class, a half input read
/// as it is by the fused op under an f32 target.
pub(crate) fn routed_rms_norm<Pol: Policy>(
    x: &AmpTensor,
    weight: &candle_core::Tensor,
    eps: f64,
) -> Result<AmpTensor> {
    unary_widening::<Pol, op::rms_norm>(
        x,
        |x| composite::rms_norm_f32(x, weight, eps),
        |x| composite::rms_norm(x, weight, eps),
    )
}

/// An RMS norm with scale initialised to ones.
pub fn rms_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<RmsNorm> {
    let weight = super::parameter(&vb, size, "weight", candle_nn::Init::Const(1.))?;
    RmsNorm::new(Var::from_tensor(&weight)?, eps)
}

/// Batch norm over `(batch, channels, h, w)`, PyTorch's `BatchNorm2d`.
///
/// On no autocast list: it runs in its input's precision, with f32 scale, shift, running
/// statistics and computation inside (cuDNN's behaviour). Training normalises with the batch's
/// biased variance and updates the running statistics with the unbiased one, as PyTorch.
///
/// On CPU and CUDA (f32, f16, bf16) it is one op with its own backward that keeps only its input
/// and two f32 numbers per channel for the backward pass, as cuDNN does; on other devices it is
/// a composition of candle ops whose intermediates (six f32 tensors of the input's size) stay
/// in the graph until `backward`.
#[derive(Clone, Debug)]
pub struct BatchNorm2d {
    weight: Option<Var>,
    bias: Option<Var>,
    running_mean: Var,
    running_var: Var,
    eps: f64,
    momentum: f64,
}

impl BatchNorm2d {
    /// A batch norm from f32 running statistics `(channels)`, an optional affine f32 scale and
    /// shift, `eps` and `momentum` (PyTorch: 1e-5 and 0.1).
    pub fn new(
        running_mean: Var,
        running_var: Var,
        affine: Option<(Var, Var)>,
        eps: f64,
        momentum: f64,
    ) -> Result<Self> {
        let running_mean = master(running_mean, "BatchNorm2d running_mean")?;
        let running_var = master(running_var, "BatchNorm2d running_var")?;
        let channels = running_mean.dims().to_vec();
        let (weight, bias) = match affine {
            Some((w, b)) => (
                Some(master(w, "BatchNorm2d weight")?),
                Some(master(b, "BatchNorm2d bias")?),
            ),
            None => (None, None),
        };
        for v in [Some(&running_var), weight.as_ref(), bias.as_ref()]
            .into_iter()
            .flatten()
        {
            if v.dims() != channels.as_slice() || channels.len() != 1 {
                candle_core::bail!(
                    "BatchNorm2d: parameters must all have shape [channels], got {channels:?} \
                     and {:?}",
                    v.dims()
                )
            }
        }
        composite::check_eps("BatchNorm2d", eps)?;
        if !(0.0..=1.0).contains(&momentum) {
            candle_core::bail!("BatchNorm2d: momentum must be in [0, 1], got {momentum}")
        }
        Ok(Self {
            weight,
            bias,
            running_mean,
            running_var,
            eps,
            momentum,
        })
    }

    /// The f32 scale, if affine.
    pub fn weight(&self) -> Option<&Var> {
        self.weight.as_ref()
    }

    /// The f32 shift, if affine.
    pub fn bias(&self) -> Option<&Var> {
        self.bias.as_ref()
    }

    /// The running mean (f32).
    pub fn running_mean(&self) -> &Var {
        &self.running_mean
    }

    /// The running variance (f32, unbiased estimates).
    pub fn running_var(&self) -> &Var {
        &self.running_var
    }

    /// Training mode: normalise with batch statistics and update the running ones.
    pub fn forward_train<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        self.forward_t(x, true)
    }

    /// `train` selects batch statistics (and updates the running ones) or running statistics.
    pub fn forward_t<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        if let Some(y) = super::followed::<P, crate::region::calls::forward_t, _>(self, (x, train))
        {
            return y;
        }
        self.check_input(x.dims(), train)?;
        if x.elem_count() == 0 {
            return Ok(x.clone());
        }
        if kernels::batch_norm::supports(x.as_candle()) {
            self.forward_fused(x.as_candle(), train, false)
        } else {
            self.forward_composed(x.as_candle(), train)
        }
        .and_then(Tensor::<P>::from_candle)
    }

    /// [`Self::forward_t`] and a ReLU, one op where the fused kernels run (`ConvBnReLU2d` off the
    /// CPU: no ReLU pass and no ReLU node).
    pub(crate) fn forward_t_relu<P: Precision>(
        &self,
        x: &Tensor<P>,
        train: bool,
    ) -> Result<Tensor<P>> {
        self.check_input(x.dims(), train)?;
        if x.elem_count() == 0 {
            return Ok(x.clone());
        }
        if kernels::batch_norm::supports(x.as_candle()) {
            Tensor::<P>::from_candle(self.forward_fused(x.as_candle(), train, true)?)
        } else {
            self.forward_t(x, train)?.relu()
        }
    }

    /// The checks of an input of dimensions `dims`: `(batch, channels, h, w)` with the layer's
    /// channels, and not exactly one value per channel to train on (PyTorch's check: no
    /// variance to take). An input of no value is no error: the layers return it as it is,
    /// empty, and leave the running statistics, as PyTorch's.
    pub(crate) fn check_input(&self, dims: &[usize], train: bool) -> Result<()> {
        let &[n, c, h, w] = dims else {
            candle_core::bail!("BatchNorm2d expects (batch, channels, h, w), got {dims:?}")
        };
        if c != self.channels() {
            candle_core::bail!(
                "BatchNorm2d: input has {c} channels, the layer {}",
                self.channels()
            )
        }
        if train && n * h * w == 1 {
            candle_core::bail!(
                "BatchNorm2d: training needs more than one value per channel, got {dims:?}"
            )
        }
        Ok(())
    }

    /// The number of channels.
    pub fn channels(&self) -> usize {
        self.running_mean.elem_count()
    }

    /// The f32 scale and shift, `None` without `affine`.
    pub(crate) fn affine(&self) -> Option<(&Var, &Var)> {
        self.weight.as_ref().zip(self.bias.as_ref())
    }

    /// `eps`, added to the variance.
    pub(crate) fn eps(&self) -> f64 {
        self.eps
    }

    /// The running mean and variance, as f32 values.
    pub(crate) fn running_stats(&self) -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((self.running_mean.to_vec1()?, self.running_var.to_vec1()?))
    }

    /// The running statistics, `eps` and momentum, for the kernels' training forwards.
    pub(crate) fn running(&self) -> kernels::batch_norm::Running<'_> {
        kernels::batch_norm::Running {
            mean: self.running_mean.as_tensor(),
            var: self.running_var.as_tensor(),
            eps: self.eps,
            momentum: self.momentum,
        }
    }

    /// The running statistics moved, from the `(4, channels)` rows of the kernels' training
    /// statistics (mean, invstd, the new running mean and variance).
    pub(crate) fn set_running(&self, rows: &candle_core::Tensor) -> Result<()> {
        self.running_mean.set(&rows.get(2)?)?;
        self.running_var.set(&rows.get(3)?)
    }

    /// Folds a batch's per-channel mean and biased variance over `count` values per channel
    /// into the running statistics (the variance made unbiased first, as PyTorch does): the
    /// CPU's `ConvBn2d`, whose op returns its statistics on the host.
    pub(crate) fn record_batch(&self, mean: &[f64], var: &[f64], count: usize) -> Result<()> {
        let dev = self.running_mean.device();
        let to_tensor =
            |v: &[f64]| candle_core::Tensor::from_iter(v.iter().map(|&v| v as f32), dev);
        let count = count as f64;
        let unbiased: Vec<f64> = var.iter().map(|v| v * count / (count - 1.0)).collect();
        self.update_running(&to_tensor(mean)?, &to_tensor(&unbiased)?)
    }

    /// The CPU and CUDA kernels: the graph keeps `x` and per-channel statistics, nothing else;
    /// the per-channel arithmetic stays on `x`'s device.
    fn forward_fused(
        &self,
        x: &candle_core::Tensor,
        train: bool,
        relu: bool,
    ) -> Result<candle_core::Tensor> {
        let x = &x.contiguous()?; // once, for the statistics and the op
        let c = self.channels();
        let (mean, invstd) = if train {
            let r = self.running();
            let rows = kernels::batch_norm::batch_stats(x, r.mean, r.var, None, r.eps, r.momentum)?;
            self.set_running(&rows)?;
            (rows.get(0)?, rows.get(1)?)
        } else {
            let var = self.running_var.as_tensor().detach().to_dtype(DType::F64)?;
            let invstd = (var + self.eps)?.sqrt()?.recip()?.to_dtype(DType::F32)?;
            (self.running_mean.as_tensor().detach(), invstd)
        };
        let (weight, bias) = match (&self.weight, &self.bias) {
            (Some(w), Some(b)) => (w.as_tensor().clone(), b.as_tensor().clone()),
            _ => (
                candle_core::Tensor::ones(c, DType::F32, x.device())?,
                candle_core::Tensor::zeros(c, DType::F32, x.device())?,
            ),
        };
        let stats = kernels::batch_norm::Normalisation {
            mean,
            invstd,
            train,
            affine: self.weight.is_some(),
            relu,
        };
        kernels::batch_norm::batch_norm(x, &weight, &bias, stats)
    }

    /// Candle ops (other devices): every intermediate stays in the graph.
    fn forward_composed(
        &self,
        x: &candle_core::Tensor,
        train: bool,
    ) -> Result<candle_core::Tensor> {
        let c = self.running_mean.dim(0)?;
        let per_channel = |v: &candle_core::Tensor| v.reshape((1, c, 1, 1));
        let x32 = x.to_dtype(DType::F32)?;
        let (centered, var) = if train {
            let count = (x.elem_count() / c) as f64;
            let mean = x32.mean_keepdim((0, 2, 3))?;
            let centered = x32.broadcast_sub(&mean)?;
            let var = centered.sqr()?.mean_keepdim((0, 2, 3))?;
            let unbiased = (var.detach() * (count / (count - 1.0)))?;
            self.update_running(&mean.flatten_all()?, &unbiased.flatten_all()?)?;
            (centered, var)
        } else {
            // Detached: the running statistics are buffers, never trained (as variables in the
            // graph they would get gradients an optimizer over `all_vars()` would apply).
            let mean = self.running_mean.as_tensor().detach();
            let centered = x32.broadcast_sub(&per_channel(&mean)?)?;
            (
                centered,
                per_channel(&self.running_var.as_tensor().detach())?,
            )
        };
        let mut y = centered.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        if let (Some(wt), Some(b)) = (&self.weight, &self.bias) {
            y = y
                .broadcast_mul(&per_channel(wt.as_tensor())?)?
                .broadcast_add(&per_channel(b.as_tensor())?)?;
        }
        y.to_dtype(x.dtype())
    }

    /// `running = (1 - momentum) * running + momentum * batch` for both statistics, PyTorch's
    /// update (the variance estimate is the unbiased one).
    fn update_running(
        &self,
        mean: &candle_core::Tensor,
        unbiased_var: &candle_core::Tensor,
    ) -> Result<()> {
        let m = self.momentum;
        for (running, batch) in [
            (&self.running_mean, mean),
            (&self.running_var, unbiased_var),
        ] {
            running.set(&((running.as_tensor() * (1.0 - m))? + (batch.detach() * m)?)?)?;
        }
        Ok(())
    }
}

impl AmpLayer for BatchNorm2d {
    type Op = op::batch_norm;
}

super::region_forward_t!(BatchNorm2d);

/// A `BatchNorm2d` as candle-nn's `batch_norm`: running mean 0, running var 1, and when
/// `config.affine` scale 1 and shift 0. `config` may be just `eps` (an `f64`).
pub fn batch_norm2d<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
) -> Result<BatchNorm2d> {
    let config = config.into();
    if !config.remove_mean {
        candle_core::bail!("batch_norm2d: remove_mean = false is not a batch norm PyTorch has")
    }
    let get = |name: &str, value: f64| -> Result<Var> {
        Var::from_tensor(&super::parameter(
            &vb,
            num_features,
            name,
            candle_nn::Init::Const(value),
        )?)
    };
    let affine = if config.affine {
        Some((get("weight", 1.0)?, get("bias", 0.0)?))
    } else {
        None
    };
    BatchNorm2d::new(
        get("running_mean", 0.0)?,
        get("running_var", 1.0)?,
        affine,
        config.eps,
        config.momentum,
    )
}

/// Batch normalisation over `(batch, channels)` or `(batch, channels, length)` inputs
/// (PyTorch's `nn.BatchNorm1d`): [`BatchNorm2d`]'s op on the input seen as `(batch, channels,
/// length, 1)`, so the same precision rule (the input's precision, f32 statistics and
/// parameters) and the same single op with its own backward.
#[derive(Clone, Debug)]
pub struct BatchNorm1d {
    inner: BatchNorm2d,
}

impl BatchNorm1d {
    /// A batch norm over the channels of a 2-D or 3-D input (see [`BatchNorm2d::new`]).
    pub fn new(
        running_mean: Var,
        running_var: Var,
        affine: Option<(Var, Var)>,
        eps: f64,
        momentum: f64,
    ) -> Result<Self> {
        let inner = BatchNorm2d::new(running_mean, running_var, affine, eps, momentum)?;
        Ok(Self { inner })
    }

    /// The 2-D layer it runs as.
    pub fn as_batch_norm2d(&self) -> &BatchNorm2d {
        &self.inner
    }

    /// Training mode: batch statistics, the running ones updated.
    pub fn forward_train<P: Precision>(&self, x: &Tensor<P>) -> Result<Tensor<P>> {
        self.forward_t(x, true)
    }

    /// `train` selects batch statistics (and updates the running ones) or running statistics.
    pub fn forward_t<P: Precision>(&self, x: &Tensor<P>, train: bool) -> Result<Tensor<P>> {
        let dims = x.dims().to_vec();
        let (n, c, l) = match dims.as_slice() {
            &[n, c] => (n, c, 1),
            &[n, c, l] => (n, c, l),
            other => candle_core::bail!(
                "BatchNorm1d: the input is (batch, channels) or (batch, channels, length), got \
                 {other:?} (a 4-D input is BatchNorm2d's)"
            ),
        };
        let y = self.inner.forward_t(&x.reshape((n, c, l, 1))?, train)?;
        y.reshape(dims)
    }
}

impl AmpLayer for BatchNorm1d {
    type Op = op::batch_norm;
}

super::region_forward_t!(BatchNorm1d);

/// A `BatchNorm1d` as candle-nn's `batch_norm` (see [`batch_norm2d`]).
pub fn batch_norm1d<C: Into<BatchNormConfig>>(
    num_features: usize,
    config: C,
    vb: VarBuilder,
) -> Result<BatchNorm1d> {
    Ok(BatchNorm1d {
        inner: batch_norm2d(num_features, config, vb)?,
    })
}
