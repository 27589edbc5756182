//! A convolution and the batch norm after it as one op (CPU): the convolution's f32 sums are
//! normalised before anything is rounded.
//!
//! Under autocast the conv's output is rounded to half, and batch norm then subtracts each
//! channel's mean from it. Where that mean is large against the channel's spread (conv outputs
//! commonly sit a few spreads away from zero), the subtraction keeps few of the rounded value's
//! bits: a bf16 value 20 spreads from zero carries an error of 20 * 2^-9 spreads, 4% of a
//! normalised unit, where rounding the normalised value costs 2^-9 of it. This op normalises the
//! GEMM's f32 sums and rounds only the batch norm's output; the graph keeps what the two ops
//! keep (the conv's input and a half tensor the size of the output: here the normalised values
//! instead of the conv's output, so that the backward does not subtract the mean again either)
//! and one node instead of two, whose backward candle fills with a zero tensor and an add each.
//! The gradient of the conv's output is rounded to half, as it is between the two ops.

use std::sync::{Arc, Mutex};

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp3, DType, Device, Layout, Result, Shape, Tensor};

use super::{grad_consts, stats, GradSums, InputGrad, Normalisation};
use crate::kernels::channels::Geometry;
use crate::kernels::conv::{self, Conv2dParams};
use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::wanted;
use crate::kernels::parallel;

/// `batch_norm(conv2d(x, k) + conv_bias) * gamma + beta` for `params = [conv_bias, gamma, beta]`
/// (f32, `(3, c_out)`), in `x`'s dtype, through a ReLU if `relu` (NaN kept, as `relu` keeps
/// it); `k` may be the f32 master of a half `x` (rounded inside, as the conv op does).
/// `running` gives the running mean and variance to normalise with (evaluation); without it
/// the batch's own statistics are used and returned (mean and biased variance per channel) for
/// the running-statistics update. CPU only, for the convolutions `conv::handles`.
pub(crate) fn conv_batch_norm(
    x: &Tensor,
    k: &Tensor,
    params: &Tensor,
    conv: Conv2dParams,
    eps: f64,
    running: Option<(Vec<f32>, Vec<f32>)>,
    relu: bool,
) -> Result<(Tensor, Option<BatchStats>)> {
    let saved = Arc::new(Mutex::new(Saved::default()));
    let op = ConvNorm {
        conv,
        eps,
        running,
        relu,
        saved: Arc::clone(&saved),
    };
    let z = x
        .contiguous()?
        .apply_op3(&k.contiguous()?, &params.contiguous()?, op)?;
    let batch = lock(&saved)?.batch.take();
    Ok((z, batch))
}

/// A batch's per-channel mean and biased variance.
pub(crate) type BatchStats = (Vec<f64>, Vec<f64>);

/// What the forward leaves for the backward and the running statistics.
#[derive(Default)]
struct Saved {
    /// `(y - mean) * invstd`, in `x`'s dtype.
    xhat: Option<Tensor>,
    invstd: Vec<f32>,
    /// Training: the batch's mean and biased variance.
    batch: Option<BatchStats>,
}

fn lock(saved: &Mutex<Saved>) -> Result<std::sync::MutexGuard<'_, Saved>> {
    saved
        .lock()
        .map_err(|_| candle_core::Error::Msg("conv + batch norm: state lock poisoned".into()))
}

struct ConvNorm {
    conv: Conv2dParams,
    eps: f64,
    running: Option<(Vec<f32>, Vec<f32>)>,
    /// The output goes through a ReLU.
    relu: bool,
    saved: Arc<Mutex<Saved>>,
}

/// The normalised values `(y - center) * invstd` and the output `xhat * gamma + beta` (as
/// `(y - center) * (invstd * gamma) + beta`, through a ReLU if `relu`) per channel of the f32
/// `y`, each value rounded once to `dtype`: one pass over `y`, 64 values at a time through f32
/// blocks.
fn normalised_and_output(
    y: &[f32],
    g: Geometry,
    (center, invstd, scale, shift): (&[f32], &[f32], &[f32], &[f32]),
    relu: bool,
    dtype: DType,
) -> (CpuStorage, CpuStorage) {
    fn pass<T: Real>(
        y: &[f32],
        g: Geometry,
        (m, s, k, b): (&[f32], &[f32], &[f32], &[f32]),
        relu: bool,
    ) -> (Vec<T>, Vec<T>) {
        parallel::filled_pair(y.len(), g.hw.max(1), |row, xhat: &mut [T], z: &mut [T]| {
            let (m, s, k, b) = {
                let c = row % g.c;
                (m[c], s[c], k[c], b[c])
            };
            let (mut xb, mut zb) = ([0f32; 64], [0f32; 64]);
            let chunks = y[row * g.hw..][..g.hw].chunks(64);
            for ((ys, xhat), z) in chunks.zip(xhat.chunks_mut(64)).zip(z.chunks_mut(64)) {
                let (xb, zb) = (&mut xb[..ys.len()], &mut zb[..ys.len()]);
                for ((x, o), &v) in xb.iter_mut().zip(zb.iter_mut()).zip(ys) {
                    *x = (v - m) * s;
                    *o = (v - m) * k + b;
                }
                if relu {
                    // `o < 0` is false for NaN, which passes through.
                    for o in zb.iter_mut() {
                        *o = if *o < 0.0 { 0.0 } else { *o };
                    }
                }
                T::narrow(xb, xhat);
                T::narrow(zb, z);
            }
        })
    }
    let per_channel = (center, invstd, scale, shift);
    match dtype {
        DType::BF16 => {
            let (x, z) = pass(y, g, per_channel, relu);
            (CpuStorage::BF16(x), CpuStorage::BF16(z))
        }
        DType::F16 => {
            let (x, z) = pass(y, g, per_channel, relu);
            (CpuStorage::F16(x), CpuStorage::F16(z))
        }
        _ => {
            let (x, z) = pass(y, g, per_channel, relu);
            (CpuStorage::F32(x), CpuStorage::F32(z))
        }
    }
}

/// A CPU storage as a tensor of `shape` (a copy).
fn tensor(s: CpuStorage, shape: &Shape) -> Result<Tensor> {
    let dev = &Device::Cpu;
    match s {
        CpuStorage::BF16(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F16(v) => Tensor::from_vec(v, shape, dev),
        CpuStorage::F32(v) => Tensor::from_vec(v, shape, dev),
        other => candle_core::bail!("conv + batch norm: unexpected {:?}", other.dtype()),
    }
}

impl CustomOp3 for ConvNorm {
    fn name(&self) -> &'static str {
        "amp-conv-batch-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        k: &CpuStorage,
        lk: &Layout,
        params: &CpuStorage,
        lp: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let CpuStorage::F32(p) = params else {
            candle_core::bail!("conv + batch norm: the parameters must be f32")
        };
        let p = crate::kernels::layout::contiguous(p, lp, "conv + batch norm")?;
        let c = lk.dims()[0];
        if p.len() != 3 * c {
            candle_core::bail!("conv + batch norm: {} parameters for {c} channels", p.len())
        }
        let (conv_bias, gamma, beta) = (&p[..c], &p[c..2 * c], &p[2 * c..]);
        // The sums without the conv's bias, which only moves each channel's mean: it is
        // subtracted again with the batch's mean, and folded into the running mean's centre.
        let (y, shape) = conv::f32_sums((x, lx), (k, lk), self.conv)?;
        let g = Geometry::of(&Layout::contiguous(shape.clone()))?;
        let (center, invstd, batch): (Vec<f32>, Vec<f32>, _) = match &self.running {
            None => {
                let (mean, var) = stats(&y, g);
                let invstd = var.iter().map(|v| (1.0 / (v + self.eps).sqrt()) as f32);
                let center = mean.iter().map(|&m| m as f32).collect();
                // The statistics of the conv's output, bias included.
                let mean = mean.iter().zip(conv_bias).map(|(m, &b)| m + f64::from(b));
                (center, invstd.collect(), Some((mean.collect(), var)))
            }
            Some((mean, var)) => {
                let invstd = var
                    .iter()
                    .map(|&v| (1.0 / (f64::from(v) + self.eps).sqrt()) as f32);
                let center = mean
                    .iter()
                    .zip(conv_bias)
                    .map(|(&m, &b)| (f64::from(m) - f64::from(b)) as f32);
                (center.collect(), invstd.collect(), None)
            }
        };
        let scale: Vec<f32> = invstd.iter().zip(gamma).map(|(s, w)| s * w).collect();
        let (xhat, z) = normalised_and_output(
            &y,
            g,
            (&center, &invstd, &scale, beta),
            self.relu,
            x.dtype(),
        );
        let xhat = tensor(xhat, &shape)?;
        *lock(&self.saved)? = Saved {
            xhat: Some(xhat),
            invstd,
            batch,
        };
        Ok((z, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        k: &Tensor,
        params: &Tensor,
        z: &Tensor,
        dz: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (xhat, invstd) = {
            let saved = lock(&self.saved)?;
            let Some(xhat) = saved.xhat.clone() else {
                candle_core::bail!("conv + batch norm: backward before forward")
            };
            (xhat, saved.invstd.clone())
        };
        let c = invstd.len();
        let train = self.running.is_none();
        let dz = dz.to_dtype(xhat.dtype())?.contiguous()?;
        // Through the ReLU: the gradient where the output is positive.
        let dz = if self.relu {
            crate::kernels::activation::relu_grad_from_output(z, &dz)?
        } else {
            dz
        };
        // The batch-norm kernel's passes on the normalised values: centre 0, scale 1.
        let dev = xhat.device();
        let unit = Normalisation {
            mean: Tensor::zeros(c, DType::F32, dev)?,
            invstd: Tensor::ones(c, DType::F32, dev)?,
            train,
            affine: true,
            relu: false,
        };
        let sums = xhat.apply_op2_no_bwd(
            &dz,
            &GradSums {
                norm: unit,
                relu: None,
            },
        )?;
        let m = xhat.elem_count() as f64 / c as f64;
        // dy = k * dz + p * xhat + q, k = gamma * invstd; with the batch's statistics
        // p = -k * sum(dz * xhat) / m and q = -k * sum(dz) / m (sums over xhat: `unit`).
        let gamma = params.get(1)?;
        let consts = grad_consts(
            &sums,
            &gamma,
            &Tensor::from_slice(&invstd, c, dev)?,
            m,
            train,
            true,
        )?;
        let grad = InputGrad {
            center: Tensor::zeros(c, DType::F32, dev)?,
            consts: consts.clone(),
            relu: None,
        };
        // The conv bias's gradient, the sum of dy per channel, in closed form: with the batch's
        // statistics k * sum(dz) + p * sum(xhat) + q * m, exactly 0 (the bias only moves the
        // mean that batch norm removes; summing dy would give the rounding noise of a cancelling
        // sum, which Adam scales up into bias steps of full size); with running statistics
        // k * sum(dz).
        let conv_bias = if train {
            vec![0f32; c]
        } else {
            let (gamma, sum_dz) = (gamma.to_vec1::<f32>()?, sums.get(0)?.to_vec1::<f64>()?);
            (0..c)
                .map(|ch| (f64::from(gamma[ch]) * f64::from(invstd[ch]) * sum_dz[ch]) as f32)
                .collect()
        };
        let dy = xhat.apply_op2_no_bwd(&dz, &grad)?;
        let (dx, dk) = conv::input_and_kernel_grads(x, k, self.conv, &dy)?;
        let dparams = wanted(params, || {
            let conv_bias = Tensor::from_vec(conv_bias, c, dev)?;
            Tensor::stack(&[conv_bias, consts.get(4)?, consts.get(5)?], 0)
        })?;
        Ok((dx, dk, dparams))
    }
}
