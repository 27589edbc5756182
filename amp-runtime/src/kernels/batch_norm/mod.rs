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
mod after_conv_op;

pub(crate) use after_conv::conv_batch_norm;
pub(crate) use after_conv_op::{conv_batch_norm_train, Running};

use crate::kernels::channels::{channel_sum, Affine, Geometry};
#[cfg(feature = "cuda")]
use crate::kernels::cuda::batch_norm as cuda;

use crate::kernels::elem::with_floats;
use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::{offer, wanted};
use crate::kernels::parallel;
use candle_core::backend::BackendStorage;
use candle_core::{
    CpuStorage, CustomOp2, CustomOp3, DType, Layout, Result, Shape, Tensor, WithDType,
};

/// Whether [`batch_stats`] and [`batch_norm`] handle `x`: a 4-d f32, f16 or bf16 tensor on
/// CPU, or (feature `cuda`) on a CUDA device.
pub(crate) fn supports(x: &Tensor) -> bool {
    use crate::kernels::elem::{cpu_float, cuda_float};
    (cpu_float(x) || cuda_float(x)) && x.rank() == 4
}

/// A training forward's per-channel values from `x` and the running statistics (f32
/// `(channels)` tensors on `x`'s device): a `(4, channels)` f32 tensor of the batch's mean, its
/// inverse standard deviation `1 / sqrt(var + eps)` (biased variance, two passes: see
/// [`crate::kernels::widen::lane_sums2`]) and the running mean and variance moved by `momentum`
/// towards the batch's (the variance made unbiased first, as PyTorch does). One op with no
/// backward: on CUDA three small launches besides the two passes, nothing read back. A NaN input
/// makes its channel's variance NaN. `shift` (f32 `(channels)`), when given, is added to the
/// batch's mean (in f64) before the running mean moves towards it: the bias of a convolution
/// whose output `x` was taken without it.
pub(crate) fn batch_stats(
    x: &Tensor,
    running_mean: &Tensor,
    running_var: &Tensor,
    shift: Option<&Tensor>,
    eps: f64,
    momentum: f64,
) -> Result<Tensor> {
    x.contiguous()?.apply_op3_no_bwd(
        &running_mean.contiguous()?,
        &running_var.contiguous()?,
        &BatchStats {
            eps,
            momentum,
            shift: shift.map(Tensor::contiguous).transpose()?,
        },
    )
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

/// Three per-channel f32 vectors of one length `c` as the rows of one contiguous `(3, c)` tensor
/// (a conv's bias, a batch norm's scale and shift: the parameters of the conv + batch-norm ops),
/// one op whose backward hands each row's gradient to [`offer`]: under the gradient scaler's
/// collector no accumulation per row, where `Tensor::stack` leaves a reshape and a narrow per
/// row in the graph, each stored by candle's backward as a zero tensor plus an add (about a
/// dozen small ops per layer and step).
pub(crate) fn pack_rows(rows: [&Tensor; 3]) -> Result<Tensor> {
    let c = rows[0].elem_count();
    for r in rows {
        if r.dims() != [c] || r.dtype() != DType::F32 {
            candle_core::bail!(
                "batch norm kernel: per-channel parameters must be f32 ({c}), got {:?} {:?}",
                r.dtype(),
                r.dims()
            )
        }
    }
    rows[0].apply_op3(rows[1], rows[2], PackRows)
}

/// See [`pack_rows`].
struct PackRows;

impl PackRows {
    /// The rows copied one after the other into a fresh storage of `dev`.
    fn fwd<S: BackendStorage>(
        dev: &impl candle_core::backend::BackendDevice<Storage = S>,
        rows: [(&S, &Layout); 3],
    ) -> Result<(S, Shape)> {
        let c = rows[0].1.shape().elem_count();
        let shape = Shape::from((3, c));
        // SAFETY: the three copies below write all 3 * c values before the storage is read.
        let mut out = unsafe { dev.alloc_uninit(&shape, DType::F32) }?;
        for (r, (s, l)) in rows.into_iter().enumerate() {
            s.copy_strided_src(&mut out, r * c, l)?;
        }
        Ok((out, shape))
    }
}

impl CustomOp3 for PackRows {
    fn name(&self) -> &'static str {
        "amp-pack-rows"
    }

    fn cpu_fwd(
        &self,
        a: &CpuStorage,
        la: &Layout,
        b: &CpuStorage,
        lb: &Layout,
        c: &CpuStorage,
        lc: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        Self::fwd(
            &candle_core::cpu_backend::CpuDevice,
            [(a, la), (b, lb), (c, lc)],
        )
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        a: &candle_core::CudaStorage,
        la: &Layout,
        b: &candle_core::CudaStorage,
        lb: &Layout,
        c: &candle_core::CudaStorage,
        lc: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Self::fwd(&a.device, [(a, la), (b, lb), (c, lc)])
    }

    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _packed: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        Ok((
            offer(a, || grad.get(0))?,
            offer(b, || grad.get(1))?,
            offer(c, || grad.get(2))?,
        ))
    }
}

/// The per-channel constants of one batch-norm application: f32 `(channels)` tensors on the
/// input's device.
#[derive(Clone, Debug)]
pub(crate) struct Normalisation {
    pub mean: Tensor,
    pub invstd: Tensor,
    pub train: bool,
    pub affine: bool,
    /// The output goes through a ReLU (in the same pass; its backward masks `dy` by the output).
    pub relu: bool,
}

/// The values of a per-channel f32 tensor on the host (CPU kernels: a copy of `c` values).
fn host(t: &Tensor) -> Result<Vec<f32>> {
    t.to_dtype(DType::F32)?.to_vec1()
}

/// See [`batch_stats`].
struct BatchStats {
    eps: f64,
    momentum: f64,
    shift: Option<Tensor>,
}

impl CustomOp3 for BatchStats {
    fn name(&self) -> &'static str {
        "amp-batch-norm-stats"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        running_mean: &CpuStorage,
        lm: &Layout,
        running_var: &CpuStorage,
        lv: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let g = Geometry::of(lx)?;
        let (CpuStorage::F32(rm), CpuStorage::F32(rv)) = (running_mean, running_var) else {
            candle_core::bail!("batch norm kernel: the running statistics must be f32")
        };
        let rm = crate::kernels::layout::contiguous(rm, lm, "batch norm")?;
        let rv = crate::kernels::layout::contiguous(rv, lv, "batch norm")?;
        if rm.len() != g.c || rv.len() != g.c {
            candle_core::bail!("batch norm kernel: running statistics of {} channels", g.c)
        }
        let (mean, var): (Vec<f64>, Vec<f64>) =
            with_floats!("batch norm", x, lx, |xs| stats(xs, g));
        let shift = match &self.shift {
            Some(t) => host(t)?,
            None => vec![0.0; g.c],
        };
        if shift.len() != g.c {
            candle_core::bail!(
                "batch norm kernel: a shift of {} for {} channels",
                shift.len(),
                g.c
            )
        }
        let count = g.count() as f64;
        let (keep, moved) = ((1.0 - self.momentum) as f32, self.momentum as f32);
        let mut out = vec![0f32; 4 * g.c];
        for c in 0..g.c {
            let mean32 = mean[c] as f32;
            let towards = (mean[c] + f64::from(shift[c])) as f32;
            let unbiased = (var[c] * count / (count - 1.0)) as f32;
            out[c] = mean32;
            out[g.c + c] = (1.0 / (var[c] + self.eps).sqrt()) as f32;
            out[2 * g.c + c] = rm[c] * keep + towards * moved;
            out[3 * g.c + c] = rv[c] * keep + unbiased * moved;
        }
        Ok((CpuStorage::F32(out), Shape::from((4, g.c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        x: &candle_core::CudaStorage,
        lx: &Layout,
        running_mean: &candle_core::CudaStorage,
        lm: &Layout,
        running_var: &candle_core::CudaStorage,
        lv: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        let running = (
            cuda::PerChannel(running_mean, lm.clone()),
            cuda::PerChannel(running_var, lv.clone()),
        );
        let shift = self.shift.as_ref().map(Tensor::storage_and_layout);
        let shift = match &shift {
            Some((s, l)) => Some(cuda::on_device(s, l)?),
            None => None,
        };
        cuda::batch_stats(x, lx, running, shift, self.eps, self.momentum)
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
/// centred on it), the (tiny) offset of that mean corrected exactly. A NaN (a NaN input) stays
/// NaN, as PyTorch's does: `f64::max` would make it 0, and a running variance that looks
/// healthy beside a NaN running mean.
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
        let y = with_floats!("batch norm", x, lx, |xs| {
            let mut y = affine.apply(xs, None, g);
            if self.relu {
                relu_in_place(&mut y);
            }
            WithDType::to_cpu_storage_owned(y)
        });
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
            relu: self.relu,
            relu_mask: None,
        }
        .run(x, lx)
    }

    fn bwd(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: &Tensor,
        _y: &Tensor, // the ReLU's mask is recomputed from x
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, consts) = self.grads(&x.contiguous()?, (weight, bias), dy, |x, dy, grad| {
            wanted(x, || x.apply_op2_no_bwd(dy, grad))
        })?;
        if !self.affine {
            return Ok((dx, None, None));
        }
        Ok((
            dx,
            offer(weight, || consts.get(4))?,
            offer(bias, || consts.get(5))?,
        ))
    }
}

impl Normalisation {
    /// The backward's passes for the contiguous input `x` of the forward with `(weight, bias)`
    /// and the output's gradient `dy`: the input gradient, as `input_grad(x, dy, op)` computes it
    /// with the [`InputGrad`] op, and the `(6, c)` constants of [`grad_consts`] (rows 4 and 5:
    /// the weight's and bias's gradients). Through the ReLU, both passes count `dy` only where
    /// the output was positive, recomputing it from `x` ([`ForwardRelu`]).
    fn grads<G>(
        &self,
        x: &Tensor,
        (weight, bias): (&Tensor, &Tensor),
        dy: &Tensor,
        input_grad: impl FnOnce(&Tensor, &Tensor, &InputGrad) -> Result<G>,
    ) -> Result<(G, Tensor)> {
        let dy = dy.to_dtype(x.dtype())?.contiguous()?;
        let relu = self.relu.then(|| ForwardRelu {
            invstd: self.invstd.clone(),
            weight: weight.detach(),
            bias: bias.detach(),
        });
        let sums = x.apply_op2_no_bwd(
            &dy,
            &GradSums {
                norm: self.clone(),
                relu: relu.clone(),
            },
        )?;
        let count = x.elem_count() as f64 / self.mean.elem_count() as f64;
        // dx = k * dy + p * (x - mean) + q per channel, with k = w * invstd and, when the
        // statistics are the batch's: p = -k * invstd * sum(dy * xhat) / m, q = -k * sum(dy) / m
        // (the textbook k * (dy - mean(dy) - xhat * mean(dy * xhat)), expanded).
        let consts = grad_consts(&sums, weight, &self.invstd, count, self.train, false)?;
        let grad = InputGrad {
            center: self.mean.clone(),
            consts: consts.clone(),
            relu,
        };
        Ok((input_grad(x, &dy, &grad)?, consts))
    }
}

/// A forward's ReLU, for the backward's passes: the forward's per-channel inverse deviation,
/// weight and shift (its centre is the pass's), from which the output is recomputed where `dy`
/// is read. On CUDA in the same pass (no pass over the output, no masked copy of `dy`).
#[derive(Clone, Debug)]
struct ForwardRelu {
    invstd: Tensor,
    weight: Tensor,
    bias: Tensor,
}

impl ForwardRelu {
    /// `dy` where the forward's output at `x` (recomputed with the forward's CPU pass from the
    /// centre `center`) is positive, 0 elsewhere.
    fn masked_cpu<T: Real>(
        &self,
        center: &[f32],
        xs: &[T],
        dys: &[T],
        g: Geometry,
    ) -> Result<Vec<T>> {
        let (invstd, w, b) = (host(&self.invstd)?, host(&self.weight)?, host(&self.bias)?);
        let scale: Vec<f32> = invstd.iter().zip(&w).map(|(s, w)| s * w).collect();
        let affine = Affine {
            center,
            scale: &scale,
            shift: &b,
        };
        let y = affine.apply(xs, None, g);
        Ok(dys
            .iter()
            .zip(&y)
            .map(|(&dy, y)| if y.get() > 0.0 { dy } else { T::put(0.0) })
            .collect())
    }

    /// The CUDA kernels' view of the mask.
    #[cfg(feature = "cuda")]
    fn on_device<R>(&self, f: impl FnOnce(cuda::ReluMask<'_>) -> Result<R>) -> Result<R> {
        let (s, ls) = self.invstd.storage_and_layout();
        let (w, lw) = self.weight.storage_and_layout();
        let (b, lb) = self.bias.storage_and_layout();
        f(cuda::ReluMask {
            scale: cuda::on_device(&s, ls)?,
            mul: cuda::on_device(&w, lw)?,
            shift: cuda::on_device(&b, lb)?,
        })
    }
}

/// The input gradient's per-channel constants from the gradient sums `[sum(dy); sum(dy *
/// xhat)]` ((2, c) f64) over `count` values per channel, the weight and `invstd` (f32 `(c)`): a
/// `(6, c)` f32 tensor of `k = weight * invstd`, `p`, `q` (with the batch's statistics, `train`:
/// `p = -k * u * sum(dy * xhat) / count`, `q = -k * sum(dy) / count`, `u` = `invstd`, or 1 with
/// `unit`, sums over values already normalised; otherwise 0), a row of zeros, and the two sums
/// in f32 (the weight's and the bias's gradients). The arithmetic is f64, rounded once to f32.
/// Rows 3 to 5 are the gradient of the packed `[conv bias; weight; bias]` of the conv +
/// batch-norm ops in training (the conv bias's exactly 0), a view.
fn grad_consts(
    sums: &Tensor,
    weight: &Tensor,
    invstd: &Tensor,
    count: f64,
    train: bool,
    unit: bool,
) -> Result<Tensor> {
    sums.contiguous()?.apply_op3_no_bwd(
        &weight.contiguous()?,
        &invstd.contiguous()?,
        &GradConsts { count, train, unit },
    )
}

/// The rows of [`grad_consts`].
pub(crate) const CONST_ROWS: usize = 6;

/// See [`grad_consts`].
struct GradConsts {
    count: f64,
    train: bool,
    unit: bool,
}

impl CustomOp3 for GradConsts {
    fn name(&self) -> &'static str {
        "amp-batch-norm-grad-consts"
    }

    fn cpu_fwd(
        &self,
        sums: &CpuStorage,
        ls: &Layout,
        weight: &CpuStorage,
        lw: &Layout,
        invstd: &CpuStorage,
        li: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F64(sums), CpuStorage::F32(w), CpuStorage::F32(s)) =
            (sums, weight, invstd)
        else {
            candle_core::bail!("batch norm kernel: f64 sums and f32 weight and invstd expected")
        };
        let sums = crate::kernels::layout::contiguous(sums, ls, "batch norm")?;
        let w = crate::kernels::layout::contiguous(w, lw, "batch norm")?;
        let s = crate::kernels::layout::contiguous(s, li, "batch norm")?;
        let c = w.len();
        if sums.len() != 2 * c || s.len() != c {
            candle_core::bail!("batch norm kernel: per-channel values do not match {c} channels")
        }
        let mut out = vec![0f32; CONST_ROWS * c];
        for ch in 0..c {
            let invstd = f64::from(s[ch]);
            let k = f64::from(w[ch]) * invstd;
            let (p, q) = if self.train {
                let u = if self.unit { 1.0 } else { invstd };
                (
                    -k * u * sums[c + ch] / self.count,
                    -k * sums[ch] / self.count,
                )
            } else {
                (0.0, 0.0)
            };
            out[ch] = k as f32;
            out[c + ch] = p as f32;
            out[2 * c + ch] = q as f32;
            out[4 * c + ch] = sums[c + ch] as f32;
            out[5 * c + ch] = sums[ch] as f32;
        }
        Ok((CpuStorage::F32(out), Shape::from((CONST_ROWS, c))))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sums: &candle_core::CudaStorage,
        ls: &Layout,
        weight: &candle_core::CudaStorage,
        lw: &Layout,
        invstd: &candle_core::CudaStorage,
        li: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        cuda::grad_consts(
            (sums, ls),
            cuda::PerChannel(weight, lw.clone()),
            cuda::PerChannel(invstd, li.clone()),
            self.count,
            self.train,
            self.unit,
        )
    }
}

/// ReLU in place (`v < 0` is false for NaN, which passes through).
fn relu_in_place<T: Real>(values: &mut [T]) {
    for v in values.iter_mut().filter(|v| v.get() < 0.0) {
        *v = T::put(0.0);
    }
}

/// Per channel, from `x` and `dy`: `sum(dy)` and `sum(dy * xhat)` (f64, shape `(2, channels)`),
/// `dy` through the forward's ReLU where there was one.
struct GradSums {
    norm: Normalisation,
    relu: Option<ForwardRelu>,
}

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
        let (mean, invstd) = (host(&self.norm.mean)?, host(&self.norm.invstd)?);
        let (sum_dy, sum_dy_xhat) = with_floats!("batch norm", x, lx, dy, ldy, |xs, dys| {
            match &self.relu {
                Some(r) => grad_sums(xs, &r.masked_cpu(&mean, xs, dys, g)?, (&mean, &invstd), g),
                None => grad_sums(xs, dys, (&mean, &invstd), g),
            }
        });
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
        let (mean, lm) = self.norm.mean.storage_and_layout();
        let (invstd, li) = self.norm.invstd.storage_and_layout();
        let sums = |relu: Option<cuda::ReluMask<'_>>| {
            cuda::sums(
                x,
                lx,
                Geometry::of(lx)?,
                Some((dy, ldy)),
                2,
                Some(cuda::on_device(&mean, lm)?),
                Some(cuda::on_device(&invstd, li)?),
                relu,
            )
        };
        match &self.relu {
            Some(r) => r.on_device(|mask| sums(Some(mask))),
            None => sums(None),
        }
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

/// The input gradient `dx = k * dy + p * (x - center) + q` per channel, in `x`'s dtype: `center`
/// f32 `(c)`, `consts` the `(6, c)` f32 of [`grad_consts`] (rows k, p, q), on `x`'s device; `dy`
/// through the forward's ReLU where there was one.
struct InputGrad {
    center: Tensor,
    consts: Tensor,
    relu: Option<ForwardRelu>,
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
        let center = host(&self.center)?;
        let consts = host(&self.consts.flatten_all()?)?;
        let (k, rest) = consts.split_at(g.c);
        let (p, rest) = rest.split_at(g.c);
        let q = &rest[..g.c];
        let affine = Affine {
            center: &center,
            scale: p,
            shift: q,
        };
        let dx = with_floats!("batch norm", x, lx, dy, ldy, |xs, dys| {
            let dx = match &self.relu {
                Some(r) => affine.apply(xs, Some((&r.masked_cpu(&center, xs, dys, g)?, k)), g),
                None => affine.apply(xs, Some((dys, k)), g),
            };
            WithDType::to_cpu_storage_owned(dx)
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
        let (consts, lk) = self.consts.storage_and_layout();
        let cuda::PerChannel(consts, lk) = cuda::on_device(&consts, lk)?;
        let mut rows = cuda::rows(consts, &lk, CONST_ROWS, lx.dims()[1])?.into_iter();
        let (Some(k), Some(p), Some(q)) = (rows.next(), rows.next(), rows.next()) else {
            candle_core::bail!("batch norm kernel: six rows of gradient constants expected")
        };
        let apply = |relu_mask: Option<cuda::ReluMask<'_>>| {
            cuda::Apply {
                center: cuda::on_device(&center, lc)?,
                scale: p,
                mul: None,
                shift: q,
                dy: Some(((dy, ldy), k)),
                relu: false,
                relu_mask,
            }
            .run(x, lx)
        };
        match &self.relu {
            Some(r) => r.on_device(|mask| apply(Some(mask))),
            None => apply(None),
        }
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;
    use crate::kernels::leaf_grads::Collect;

    /// Batch norm with its ReLU in the op, whose backward recomputes the ReLU's mask from the
    /// input, against the op without it followed by the ReLU op, whose backward masks by the
    /// output: the same output and gradients (input, weight, bias), bit for bit, in f32, f16
    /// and bf16, with the batch's statistics and with running ones.
    #[test]
    fn relu_in_the_op_matches_the_relu_op_after_it() -> Result<()> {
        let dev = &Device::Cpu;
        let values = |n: usize, seed: u64| -> Result<Tensor> {
            Tensor::from_vec(crate::kernels::testing::values(n, seed), n, dev)
        };
        let (n, c, hw) = (3, 4, 6);
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for train in [true, false] {
                let x = Var::from_tensor(
                    &values(n * c * hw, 1)?
                        .reshape((n, c, 2, 3))?
                        .to_dtype(dtype)?,
                )?;
                let w = Var::from_tensor(&(values(c, 2)? + 0.5)?)?;
                let b = Var::from_tensor(&(values(c, 3)? * 0.5)?)?;
                let r = values(n * c * hw, 4)?.reshape((n, c, 2, 3))?;
                let rows = batch_stats(
                    x.as_tensor(),
                    &Tensor::zeros(c, DType::F32, dev)?,
                    &Tensor::ones(c, DType::F32, dev)?,
                    None,
                    1e-5,
                    0.1,
                )?;
                let run = |relu: bool| -> Result<(Tensor, candle_core::backprop::GradStore)> {
                    let norm = Normalisation {
                        mean: rows.get(0)?,
                        invstd: rows.get(1)?,
                        train,
                        affine: true,
                        relu,
                    };
                    let y = batch_norm(x.as_tensor(), &w, &b, norm)?;
                    let y = if relu {
                        y
                    } else {
                        crate::kernels::activation::relu(&y)?
                    };
                    let grads = (y.to_dtype(DType::F32)? * &r)?.sum_all()?.backward()?;
                    Ok((y, grads))
                };
                let ((fused, fg), (apart, ag)) = (run(true)?, run(false)?);
                let bits = |t: &Tensor| -> Result<Vec<f32>> {
                    t.to_dtype(DType::F32)?.flatten_all()?.to_vec1()
                };
                let case = format!("{dtype:?} train {train}");
                assert_eq!(bits(&fused)?, bits(&apart)?, "{case}: output");
                let zeros = bits(&fused)?.iter().filter(|v| **v == 0.0).count();
                assert!(
                    zeros > 0 && zeros < n * c * hw,
                    "{case}: the ReLU cuts some values"
                );
                for (name, v) in [("x", &x), ("w", &w), ("b", &b)] {
                    let (Some(got), Some(want)) = (fg.get(v), ag.get(v)) else {
                        panic!("{case}: no gradient of {name}")
                    };
                    assert_eq!(bits(got)?, bits(want)?, "{case}: gradient of {name}");
                }
            }
        }
        Ok(())
    }

    /// The packed rows are the vectors, and each vector's gradient is its row of the packed
    /// tensor's: through candle's backward, or kept by a live collector for a variable (then
    /// absent from candle's store).
    #[test]
    fn pack_rows_hands_each_row_its_gradient() -> Result<()> {
        let dev = &Device::Cpu;
        let vars = [
            Var::new(&[1f32, 2.0], dev)?,
            Var::new(&[3f32, 4.0], dev)?,
            Var::new(&[5f32, 6.0], dev)?,
        ];
        let weights = Tensor::new(&[[1f32, -1.0], [0.5, 2.0], [-3.0, 0.25]], dev)?;
        let loss = || -> Result<Tensor> {
            let packed = pack_rows([
                vars[0].as_tensor(),
                vars[1].as_tensor(),
                vars[2].as_tensor(),
            ])?;
            assert_eq!(
                packed.to_vec2::<f32>()?,
                [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
            );
            (packed * &weights)?.sum_all()
        };
        let grads = loss()?.backward()?;
        for (r, v) in vars.iter().enumerate() {
            let g = grads.get(v).map(Tensor::to_vec1::<f32>).transpose()?;
            assert_eq!(g, Some(weights.get(r)?.to_vec1::<f32>()?), "row {r}");
        }
        let collect = Collect::begin();
        let grads = loss()?.backward()?;
        let kept = collect.finish();
        for (r, v) in vars.iter().enumerate() {
            assert!(grads.get(v).is_none(), "row {r} left in candle's store");
            assert_eq!(
                kept[&v.id()].to_vec1::<f32>()?,
                weights.get(r)?.to_vec1::<f32>()?
            );
        }
        Ok(())
    }
}
