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

/// Per-channel mean and biased variance of `x` (two passes; see [`crate::kernels::widen::lane_sums2`]).
pub(crate) fn channel_stats(x: &Tensor) -> Result<(Vec<f64>, Vec<f64>)> {
    let rows = x.contiguous()?.apply_op1_no_bwd(&ChannelStats)?.to_vec2()?;
    let mut rows = rows.into_iter();
    Ok((
        rows.next().unwrap_or_default(),
        rows.next().unwrap_or_default(),
    ))
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

/// The per-channel constants of one batch-norm application.
#[derive(Clone, Debug)]
pub(crate) struct Normalisation {
    pub mean: Vec<f32>,
    pub invstd: Vec<f32>,
    pub train: bool,
    pub affine: bool,
}

/// Two f64 values per channel from `x` alone: mean and biased variance.
struct ChannelStats;

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

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        storage: &candle_core::CudaStorage,
        layout: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let g = Geometry::of(layout)?;
        let m = g.count() as f64;
        let zeros = vec![0f32; g.c];
        let (sums, _) = cuda::sums(storage, layout, g, None, 0, &zeros, &zeros)?;
        let mean: Vec<f64> = sums.iter().map(|s| s / m).collect();
        let center: Vec<f32> = mean.iter().map(|&v| v as f32).collect();
        let (squares, _) = cuda::sums(storage, layout, g, None, 1, &center, &zeros)?;
        let var: Vec<f64> = squares
            .iter()
            .zip(&mean)
            .map(|(&sq, &mean)| variance(sq, mean, m))
            .collect();
        cuda::upload_pair(&storage.device, &mean, &var)
    }
}

fn stats<T: Real>(xs: &[T], g: Geometry) -> (Vec<f64>, Vec<f64>) {
    let m = g.count() as f64;
    parallel::map_indices(g.c, |c| {
        let mean = channel_sum(xs, g, c, |x| x) / m;
        let center = mean as f32;
        let squares = channel_sum(xs, g, c, |x| (x - center) * (x - center));
        (mean, variance(squares, mean, m))
    })
    .into_iter()
    .unzip()
}

/// The biased variance from the sum of squares about the f32-rounded mean (the values are
/// centred on it), the (tiny) offset of that mean corrected exactly.
/// A NaN (a NaN input) stays NaN, as PyTorch's does: `f64::max` would make it 0, and a running
/// variance that looks healthy beside a NaN running mean.
fn variance(squares: f64, mean: f64, count: f64) -> f64 {
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
        if [w.len(), b.len(), self.mean.len(), self.invstd.len()] != [g.c; 4] {
            candle_core::bail!(
                "batch norm kernel: per-channel values do not match {} channels",
                g.c
            )
        }
        // y = (x - mean) * scale + b, scale = invstd * w. Centering first keeps the accuracy
        // of inputs whose mean is large against their spread.
        let scale: Vec<f32> = self.invstd.iter().zip(w).map(|(s, w)| s * w).collect();
        let affine = Affine {
            center: &self.mean,
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
        cuda::Apply {
            center: &self.mean,
            scale: &self.invstd,
            mul: Some((weight, lw)),
            shift: cuda::Shift::Device(bias, lb),
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
        let sums = x
            .apply_op2_no_bwd(&dy, &GradSums(self.clone()))?
            .to_vec2::<f64>()?;
        let (sum_dy, sum_dy_xhat) = (&sums[0], &sums[1]);
        let w = weight.to_vec1::<f32>()?;
        let m = x.elem_count() as f64 / w.len() as f64;
        // dx = k * dy + p * (x - mean) + q per channel, with k = w * invstd and, when the
        // statistics are the batch's: p = -k * invstd * sum(dy * xhat) / m, q = -k * sum(dy) / m
        // (the textbook k * (dy - mean(dy) - xhat * mean(dy * xhat)), expanded).
        let mut grad = InputGrad {
            mean: self.mean.clone(),
            k: Vec::with_capacity(w.len()),
            p: Vec::with_capacity(w.len()),
            q: Vec::with_capacity(w.len()),
        };
        for c in 0..w.len() {
            let invstd = f64::from(self.invstd[c]);
            let k = f64::from(w[c]) * invstd;
            let (p, q) = if self.train {
                (-k * invstd * sum_dy_xhat[c] / m, -k * sum_dy[c] / m)
            } else {
                (0.0, 0.0)
            };
            grad.k.push(k as f32);
            grad.p.push(p as f32);
            grad.q.push(q as f32);
        }
        let dx = wanted(&x, || x.apply_op2_no_bwd(&dy, &grad))?;
        if !self.affine {
            return Ok((dx, None, None));
        }
        let per_channel = |v: &[f64]| {
            let v: Vec<f32> = v.iter().map(|&v| v as f32).collect();
            Tensor::from_vec(v, w.len(), x.device())
        };
        Ok((
            dx,
            offer(weight, || per_channel(sum_dy_xhat))?,
            offer(bias, || per_channel(sum_dy))?,
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
        let (sum_dy, sum_dy_xhat) =
            with_floats!("batch norm", x, lx, dy, ldy, |xs, dys| grad_sums(
                xs, dys, &self.0, g
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
        let n = &self.0;
        let (sum_dy, sum_dy_xhat) = cuda::sums(
            x,
            lx,
            Geometry::of(lx)?,
            Some((dy, ldy)),
            2,
            &n.mean,
            &n.invstd,
        )?;
        cuda::upload_pair(&x.device, &sum_dy, &sum_dy_xhat)
    }
}

fn grad_sums<T: Real>(xs: &[T], dys: &[T], n: &Normalisation, g: Geometry) -> (Vec<f64>, Vec<f64>) {
    parallel::map_indices(g.c, |c| {
        let (mean, invstd) = (n.mean[c], n.invstd[c]);
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

/// The input gradient `dx = k * dy + p * (x - mean) + q` per channel, in `x`'s dtype.
struct InputGrad {
    mean: Vec<f32>,
    k: Vec<f32>,
    p: Vec<f32>,
    q: Vec<f32>,
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
        let affine = Affine {
            center: &self.mean,
            scale: &self.p,
            shift: &self.q,
        };
        let dx = with_floats!("batch norm", x, lx, dy, ldy, |xs, dys| {
            WithDType::to_cpu_storage_owned(affine.apply(xs, Some((dys, &self.k)), g))
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
        cuda::Apply {
            center: &self.mean,
            scale: &self.p,
            mul: None,
            shift: cuda::Shift::Host(&self.q),
            dy: Some((dy, ldy, &self.k)),
        }
        .run(x, lx)
    }
}
