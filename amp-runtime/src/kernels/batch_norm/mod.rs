//! Batch norm over `(batch, channels, h, w)` as one custom op with its own backward, on CPU (and
//! CUDA).
//!
//! A batch norm written as candle ops (mean, subtract, square, mean, add, sqrt, divide, multiply,
//! add) leaves every intermediate in the autograd graph: six full-size f32 tensors per layer,
//! whatever the input's precision. That is most of a conv net's activation memory and it hides
//! what AMP saves. This op keeps what cuDNN keeps: its input (in the input's precision, f16
//! under autocast) and two f32 numbers per channel (mean and inverse standard deviation).
//!
//! All arithmetic is f32 per element (half inputs widened 16 at a time), per-channel sums f32
//! within runs of 256 values and f64 across runs (the passes of `kernels::channels`); outputs and
//! the input gradient are rounded once to the input's dtype. Work is split over channels
//! (statistics) or over `(n, c)` rows (elementwise passes) on the kernels' pool. With the `cuda`
//! feature the same ops run on CUDA (`kernels::cuda::batch_norm`): the same sums (f32 per thread,
//! f64 per block) and affine pass; other devices keep the composition of candle ops in
//! `nn::BatchNorm2d`.
//!
//! The per-channel values (statistics, sums, the input gradient's constants) are `(channels)`
//! tensors on the input's device, and the arithmetic between the passes is candle ops on them:
//! on CUDA nothing is read back to the host inside a training step (each read-back would wait
//! for the GPU to drain), on CPU the same ops cost microseconds.

mod after_conv;

pub(crate) use after_conv::conv_batch_norm;

use crate::kernels::channels::{channel_sum, Affine, Geometry};
#[cfg(feature = "cuda")]
use crate::kernels::cuda::batch_norm as cuda;

use crate::kernels::elem::with_floats;
use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::{offer, wanted};
use crate::kernels::parallel;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

/// Whether [`channel_stats`] and [`batch_norm`] handle `x`: a 4-d f32, f16 or bf16 tensor on
/// CPU, or (feature `cuda`) on a CUDA device.
pub(crate) fn supports(x: &Tensor) -> bool {
    let float = matches!(x.dtype(), DType::F32 | DType::F16 | DType::BF16);
    let device = x.device().is_cpu() || (cfg!(feature = "cuda") && x.device().is_cuda());
    float && device && x.rank() == 4
}

/// Per-channel mean and biased variance of `x`, f64 `(channels)` tensors on its device (two
/// passes; see [`crate::kernels::widen::lane_sums2`]). A NaN input makes its channel's
/// variance NaN.
pub(crate) fn channel_stats(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let x = x.contiguous()?;
    if x.device().is_cpu() {
        let rows = x.apply_op1_no_bwd(&ChannelStats)?;
        return Ok((rows.get(0)?, rows.get(1)?));
    }
    device_stats(&x)
}

/// [`channel_stats`] off the CPU: the sum of the values, then the sum of squares about the
/// f32-rounded mean, two passes of `amp_bn_sums`, the rest tensor ops on the device.
#[cfg(feature = "cuda")]
fn device_stats(x: &Tensor) -> Result<(Tensor, Tensor)> {
    let c = x.dim(1)?;
    let count = (x.elem_count() / c) as f64;
    let zeros = Tensor::zeros(c, DType::F32, x.device())?;
    let sums = x.apply_op2_no_bwd(&Tensor::stack(&[&zeros, &zeros], 0)?, &ChannelSums(0))?;
    let mean = (sums.get(0)? / count)?;
    let center = mean.to_dtype(DType::F32)?;
    let per_channel = Tensor::stack(&[&center, &zeros], 0)?;
    let squares = x.apply_op2_no_bwd(&per_channel, &ChannelSums(1))?.get(0)?;
    Ok((mean.clone(), variance(&squares, &mean, &center, count)?))
}

#[cfg(not(feature = "cuda"))]
fn device_stats(x: &Tensor) -> Result<(Tensor, Tensor)> {
    candle_core::bail!("batch norm kernel: no kernel for {:?}", x.device())
}

/// The biased variance from the sum of squares about `center`, the f32-rounded `mean` (the
/// values are centred on it), the (tiny) offset of that centre corrected exactly. A NaN (a NaN
/// input) stays NaN, as PyTorch's does: clamping with `max` would make it 0, and a running
/// variance that looks healthy beside a NaN running mean.
#[cfg(feature = "cuda")]
fn variance(squares: &Tensor, mean: &Tensor, center: &Tensor, count: f64) -> Result<Tensor> {
    let shift = (center.to_dtype(DType::F64)? - mean)?;
    let v = ((squares / count)? - shift.sqr()?)?;
    // `v < 0` is false for NaN, which stays.
    v.lt(0.0)?.where_cond(&v.zeros_like()?, &v)
}

/// `(x - mean) * invstd * weight + bias` per channel, in `x`'s dtype, differentiable in `x`,
/// `weight` and `bias` (f32 `(channels)` tensors). `train` says that `mean` and `invstd` are the
/// batch's own statistics, so that the input gradient flows through them too; otherwise they
/// are constants (running statistics). Without `affine`, `weight` and `bias` are ones and zeros
/// and get no gradient.
pub(crate) fn batch_norm(
    x: &Tensor,
    weight: &Tensor,
    bias: &Tensor,
    stats: Normalisation,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3(weight, bias, stats)
}

/// The per-channel constants of one batch-norm application: f32 `(channels)` tensors on the
/// input's device.
#[derive(Clone, Debug)]
pub(crate) struct Normalisation {
    pub mean: Tensor,
    pub invstd: Tensor,
    pub train: bool,
    pub affine: bool,
}

/// The values of a per-channel f32 tensor on the host (CPU kernels: a copy of `c` values).
fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.to_vec1()
}

/// Two f64 values per channel from `x` alone: mean and biased variance (CPU: one task per
/// channel takes both passes over it).
struct ChannelStats;

/// Per-channel sums over `x` (`amp_bn_sums`'s modes 0 and 1, CUDA) about the per-channel
/// `(2, channels)` f32 `[center; scale]`: `(2, channels)` f64, the sums in row 0.
#[cfg(feature = "cuda")]
struct ChannelSums(i32);

#[cfg(feature = "cuda")]
impl CustomOp2 for ChannelSums {
    fn name(&self) -> &'static str {
        "amp-batch-norm-sums"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("amp-batch-norm-sums runs on CUDA (the CPU takes ChannelStats)")
    }

    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        per_channel: &candle_core::CudaStorage,
        lp: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = Geometry::of(lx)?;
        let (center, scale) = cuda::rows(per_channel, lp, g.c)?;
        cuda::sums(x, lx, g, None, self.0, Some(center), Some(scale))
    }
}

impl CustomOp1 for ChannelStats {
    fn name(&self) -> &'static str {
        "amp-batch-norm-stats"
    }

    fn cpu_fwd(&self, storage: &CpuStorage, layout: &Layout) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(layout)?;
        let (mean, var): (Vec<f64>, Vec<f64>) =
            with_floats!("batch norm", storage, layout, |xs| stats(xs, g));
        Ok((CpuStorage::F64([mean, var].concat()), Shape::from((2, g.c))))
    }
}

fn stats<T: Real>(xs: &[T], g: Geometry) -> (Vec<f64>, Vec<f64>) {
    let m = g.count() as f64;
    parallel::map_indices(g.c, |c| {
        let mean = channel_sum(xs, g, c, |x| x) / m;
        let center = mean as f32;
        let squares = channel_sum(xs, g, c, |x| (x - center) * (x - center));
        (mean, host_variance(squares, mean, m))
    })
    .into_iter()
    .unzip()
}

/// [`variance`] of one channel, on the host.
fn host_variance(squares: f64, mean: f64, count: f64) -> f64 {
    let shift = f64::from(mean as f32) - mean;
    let v = squares / count - shift * shift;
    if v < 0.0 {
        0.0
    } else {
        v
    }
}

impl CustomOp3 for Normalisation {
    fn name(&self) -> &'static str {
        "amp-batch-norm"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        weight: &CpuStorage,
        lw: &Layout,
        bias: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(lx)?;
        let (CpuStorage::F32(w), CpuStorage::F32(b)) = (weight, bias) else {
            candle_core::bail!("batch norm kernel: weight and bias must be f32")
        };
        let (w, b) = (
            crate::kernels::layout::contiguous(w, lw, "batch norm")?,
            crate::kernels::layout::contiguous(b, lb, "batch norm")?,
        );
        let (mean, invstd) = (host(&self.mean)?, host(&self.invstd)?);
        if [w.len(), b.len(), mean.len(), invstd.len()] != [g.c; 4] {
            candle_core::bail!(
                "batch norm kernel: per-channel values do not match {} channels",
                g.c
            )
        }
        // y = (x - mean) * scale + b, scale = invstd * w. Centering first keeps the accuracy
        // of inputs whose mean is large against their spread.
        let scale: Vec<f32> = invstd.iter().zip(w).map(|(s, w)| s * w).collect();
        let affine = Affine {
            center: &mean,
            scale: &scale,
            shift: b,
        };
        let y = with_floats!("batch norm", x, lx, |xs| WithDType::to_cpu_storage_owned(
            affine.apply(xs, None, g)
        ));
        Ok((y, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        weight: &candle_core::CudaStorage,
        lw: &Layout,
        bias: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (mean, lm) = self.mean.storage_and_layout();
        let (invstd, li) = self.invstd.storage_and_layout();
        cuda::Apply {
            center: cuda::on_device(&mean, lm)?,
            scale: cuda::on_device(&invstd, li)?,
            mul: Some(cuda::PerChannel(weight, lw.clone())),
            shift: cuda::PerChannel(bias, lb.clone()),
            dy: None,
        }
        .run(x, lx)
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _y: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let x = x.contiguous()?;
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let sums = x.apply_op2_no_bwd(&dy, &GradSums(self.clone()))?;
        let c = self.mean.elem_count();
        let count = x.elem_count() as f64 / c as f64;
        let invstd = self.invstd.to_dtype(DType::F64)?;
        // dx = k * dy + p * (x - mean) + q per channel, with k = w * invstd and, when the
        // statistics are the batch's: p = -k * invstd * sum(dy * xhat) / m, q = -k * sum(dy) / m
        // (the textbook k * (dy - mean(dy) - xhat * mean(dy * xhat)), expanded).
        let k = (weight.to_dtype(DType::F64)? * &invstd)?;
        let grad = InputGrad::new(self.mean.clone(), &k, &invstd, &sums, count, self.train)?;
        let dx = wanted(&x, || x.apply_op2_no_bwd(&dy, &grad))?;
        if !self.affine {
            return Ok((dx, None, None));
        }
        Ok((
            dx,
            offer(weight, || sums.get(1)?.to_dtype(DType::F32))?,
            offer(bias, || sums.get(0)?.to_dtype(DType::F32))?,
        ))
    }
}

/// Per channel, from `x` and `dy`: `sum(dy)` and `sum(dy * xhat)` (f64, shape `(2, channels)`).
struct GradSums(Normalisation);

impl CustomOp2 for GradSums {
    fn name(&self) -> &'static str {
        "amp-batch-norm-grad-sums"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(lx)?;
        let (mean, invstd) = (host(&self.0.mean)?, host(&self.0.invstd)?);
        let (sum_dy, sum_dy_xhat) =
            with_floats!("batch norm", x, lx, dy, ldy, |xs, dys| grad_sums(
                xs,
                dys,
                (&mean, &invstd),
                g
            ));
        Ok((
            CpuStorage::F64([sum_dy, sum_dy_xhat].concat()),
            Shape::from((2, g.c)),
        ))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (mean, lm) = self.0.mean.storage_and_layout();
        let (invstd, li) = self.0.invstd.storage_and_layout();
        cuda::sums(
            x,
            lx,
            Geometry::of(lx)?,
            Some((dy, ldy)),
            2,
            Some(cuda::on_device(&mean, lm)?),
            Some(cuda::on_device(&invstd, li)?),
        )
    }
}

fn grad_sums<T: Real>(
    xs: &[T],
    dys: &[T],
    (mean, invstd): (&[f32], &[f32]),
    g: Geometry,
) -> (Vec<f64>, Vec<f64>) {
    parallel::map_indices(g.c, |c| {
        let (mean, invstd) = (mean[c], invstd[c]);
        let mut sum_dy = 0f64;
        let mut sum_dy_xhat = 0f64;
        for (x, dy) in g.rows(xs, c).zip(g.rows(dys, c)) {
            crate::kernels::widen::widened2(x, dy, |x, dy| {
                let (a, b) = crate::kernels::widen::lane_sums2(x, dy, |x, dy| {
                    (dy, dy * (x - mean) * invstd)
                });
                sum_dy += a;
                sum_dy_xhat += b;
            });
        }
        (sum_dy, sum_dy_xhat)
    })
    .into_iter()
    .unzip()
}

/// The input gradient `dx = k * dy + p * (x - center) + q` per channel, in `x`'s dtype (f32
/// `(channels)` tensors on `x`'s device).
struct InputGrad {
    center: Tensor,
    k: Tensor,
    p: Tensor,
    q: Tensor,
}

impl InputGrad {
    /// The constants for `k` (f64), the gradient sums `[sum(dy); sum(dy * xhat)]` ((2, c) f64)
    /// over `count` values per channel, and `unit`, the factor from `x - center` to the `xhat`
    /// of the sums (f64): with the batch's statistics (`train`) `p = -k * unit * sum(dy * xhat)
    /// / count` and `q = -k * sum(dy) / count`; with running statistics both are 0.
    fn new(
        center: Tensor,
        k: &Tensor,
        unit: &Tensor,
        sums: &Tensor,
        count: f64,
        train: bool,
    ) -> Result<Self> {
        let (p, q) = if train {
            let minus_k = k.neg()?;
            (
                (((&minus_k * unit)? * sums.get(1)?)? / count)?,
                ((minus_k * sums.get(0)?)? / count)?,
            )
        } else {
            (k.zeros_like()?, k.zeros_like()?)
        };
        let f32 = |t: Tensor| t.to_dtype(DType::F32);
        Ok(Self {
            center,
            k: f32(k.clone())?,
            p: f32(p)?,
            q: f32(q)?,
        })
    }
}

impl CustomOp2 for InputGrad {
    fn name(&self) -> &'static str {
        "amp-batch-norm-input-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        dy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(lx)?;
        let (center, k) = (host(&self.center)?, host(&self.k)?);
        let (p, q) = (host(&self.p)?, host(&self.q)?);
        let affine = Affine {
            center: &center,
            scale: &p,
            shift: &q,
        };
        let dx = with_floats!("batch norm", x, lx, dy, ldy, |xs, dys| {
            WithDType::to_cpu_storage_owned(affine.apply(xs, Some((dys, &k)), g))
        });
        Ok((dx, lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let (center, lc) = self.center.storage_and_layout();
        let (p, lp) = self.p.storage_and_layout();
        let (q, lq) = self.q.storage_and_layout();
        let (k, lk) = self.k.storage_and_layout();
        cuda::Apply {
            center: cuda::on_device(&center, lc)?,
            scale: cuda::on_device(&p, lp)?,
            mul: None,
            shift: cuda::on_device(&q, lq)?,
            dy: Some(((dy, ldy), cuda::on_device(&k, lk)?)),
        }
        .run(x, lx)
    }
}
