//! The optimizers' update passes (`crate::optim`): one parameter updated in place in one pass
//! over its elements, computed in f32 and rounded once into the parameter's dtype.
//!
//! candle-nn's `SGD` makes three tensors per parameter and step (`grad * lr`, the difference,
//! then `Var::set` copies it back), its `AdamW` a dozen; each is a fresh allocation and a pass
//! over memory. Here a step reads the gradient and the parameter (and AdamW's two moments) once
//! and writes them once, in place, split over the kernels' thread pool (`parallel`) when the parameter is large.

use crate::kernels::elem::as_f32;

use crate::kernels::elem::as_f32_mut;

use crate::kernels::layout::contiguous;

use crate::kernels::parallel;

use crate::kernels::elem::Real;

#[cfg(feature = "cuda")]
use crate::kernels::cuda::optim as cuda;
use crate::kernels::widen::BLOCK;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, InplaceOp2, Layout, Result};

/// Elements per parallel task: a parameter of one task is updated on the calling thread
/// (`parallel` runs a single call inline), a larger one over the pool.
const CHUNK: usize = 1 << 15;

/// The per-step constants of an update rule.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rule {
    /// `w -= lr * g` (candle-nn's and PyTorch's plain SGD).
    Sgd { lr: f32 },
    /// AdamW (decoupled weight decay), see [`AdamWStep`].
    AdamW(AdamWStep),
}

/// The constants of one AdamW step, from the hyper-parameters and the parameter's step count
/// `t`: `decay = 1 - lr * weight_decay`, `scale_m = 1 / (1 - beta1^t)`,
/// `scale_v = 1 / (1 - beta2^t)`, in f64 and rounded once to f32 where they meet f32 values.
/// The step, in candle-nn's order of operations (so an f32 parameter ends bit for bit where
/// candle-nn's `AdamW` puts it):
/// `m = beta1 m + (1 - beta1) g; v = beta2 v + (1 - beta2) g^2;
/// w = decay w - lr (scale_m m) / (sqrt(scale_v v) + eps)`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct AdamWStep {
    pub lr: f64,
    pub decay: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub scale_m: f64,
    pub scale_v: f64,
    pub eps: f64,
}

/// The in-place op: updates the parameter it is applied to from the gradient it is given, with
/// AdamW's moments (each the parameter's length, f32) borrowed for the call.
pub(crate) struct Update<'a> {
    pub rule: Rule,
    /// AdamW's `(m, v)`; `None` for SGD. Taken by the one `cpu_fwd` call.
    pub moments: std::cell::Cell<Option<(&'a mut [f32], &'a mut [f32])>>,
}

impl InplaceOp2 for Update<'_> {
    fn name(&self) -> &'static str {
        "amp-optimizer-step"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let name = self.name();
        let range = dst_l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg(format!("{name}: parameter not contiguous")))?;
        match (dst, src) {
            (CpuStorage::F32(w), CpuStorage::F32(g)) => {
                self.run(&mut w[range.0..range.1], contiguous(g, src_l, name)?)
            }
            (CpuStorage::BF16(w), CpuStorage::BF16(g)) => {
                self.run(&mut w[range.0..range.1], contiguous(g, src_l, name)?)
            }
            (CpuStorage::F16(w), CpuStorage::F16(g)) => {
                self.run(&mut w[range.0..range.1], contiguous(g, src_l, name)?)
            }
            (w, g) => candle_core::bail!(
                "{name}: parameter and gradient must share one of f32, bf16, f16; got {:?} and {:?}",
                w.dtype(),
                g.dtype()
            ),
        }
    }

    /// SGD on CUDA (`kernels::cuda::optim`); AdamW there is [`AdamWMoments`] then
    /// [`AdamWApply`], its moments a device tensor.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()> {
        match self.rule {
            Rule::Sgd { lr } => cuda::sgd(dst, dst_l, src, src_l, lr),
            Rule::AdamW(_) => candle_core::bail!(
                "{}: AdamW on CUDA runs as AdamWMoments and AdamWApply",
                self.name()
            ),
        }
    }
}

impl AdamWStep {
    /// The moments' constants in f32: `[beta1, 1 - beta1, beta2, 1 - beta2]`.
    #[allow(clippy::cast_possible_truncation)]
    fn moment_consts(&self) -> [f32; 4] {
        let f = |x: f64| x as f32;
        [
            f(self.beta1),
            f(1.0 - self.beta1),
            f(self.beta2),
            f(1.0 - self.beta2),
        ]
    }

    /// The parameter's constants in f32: `[lr, decay, scale_m, scale_v, eps]`.
    #[allow(clippy::cast_possible_truncation)]
    fn apply_consts(&self) -> [f32; 5] {
        let f = |x: f64| x as f32;
        [
            f(self.lr),
            f(self.decay),
            f(self.scale_m),
            f(self.scale_v),
            f(self.eps),
        ]
    }
}

/// AdamW's moments, a `(2, n)` f32 tensor (m, then v) updated in place from the gradient: the
/// first half of the step where the moments live on the parameter's device (CUDA), one launch.
pub(crate) struct AdamWMoments(pub AdamWStep);

/// AdamW's parameter update in place from the moments [`AdamWMoments`] moved: the second half.
pub(crate) struct AdamWApply(pub AdamWStep);

/// The `(m, v)` halves of a contiguous `(2, n)` f32 moments storage.
fn halves<'a>(mv: &'a [f32], l: &Layout, name: &str) -> Result<(&'a [f32], &'a [f32])> {
    let mv = contiguous(mv, l, name)?;
    Ok(mv.split_at(mv.len() / 2))
}

impl InplaceOp2 for AdamWMoments {
    fn name(&self) -> &'static str {
        "amp-adamw-moments"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let name = self.name();
        let (CpuStorage::F32(mv), Some((start, end))) = (dst, dst_l.contiguous_offsets()) else {
            candle_core::bail!("{name}: the moments must be contiguous f32")
        };
        let (m, v) = mv[start..end].split_at_mut((end - start) / 2);
        crate::kernels::elem::with_floats!(name, src, src_l, |g| {
            if g.len() != m.len() {
                candle_core::bail!("{name}: {} moments for {} gradients", m.len(), g.len())
            }
            let mut gf = vec![0f32; g.len()];
            Real::widen(g, &mut gf);
            moments_f32(&gf, m, v, &self.0);
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()> {
        cuda::adamw_moments(dst, dst_l, src, src_l, self.0.moment_consts())
    }
}

impl InplaceOp2 for AdamWApply {
    fn name(&self) -> &'static str {
        "amp-adamw-apply"
    }

    fn cpu_fwd(
        &self,
        dst: &mut CpuStorage,
        dst_l: &Layout,
        src: &CpuStorage,
        src_l: &Layout,
    ) -> Result<()> {
        let name = self.name();
        let CpuStorage::F32(mv) = src else {
            candle_core::bail!("{name}: the moments must be f32")
        };
        let (m, v) = halves(mv, src_l, name)?;
        let range = dst_l
            .contiguous_offsets()
            .ok_or_else(|| candle_core::Error::Msg(format!("{name}: parameter not contiguous")))?;
        if range.1 - range.0 != m.len() {
            candle_core::bail!(
                "{name}: a parameter of {} values for {} moments",
                range.1 - range.0,
                m.len()
            )
        }
        match dst {
            CpuStorage::F32(w) => apply_widened(&mut w[range.0..range.1], m, v, &self.0),
            CpuStorage::BF16(w) => apply_widened(&mut w[range.0..range.1], m, v, &self.0),
            CpuStorage::F16(w) => apply_widened(&mut w[range.0..range.1], m, v, &self.0),
            w => candle_core::bail!("{name}: an f32, bf16 or f16 parameter, got {:?}", w.dtype()),
        }
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        dst: &mut candle_core::CudaStorage,
        dst_l: &Layout,
        src: &candle_core::CudaStorage,
        src_l: &Layout,
    ) -> Result<()> {
        cuda::adamw_apply(dst, dst_l, src, src_l, self.0.apply_consts())
    }
}

impl Update<'_> {
    fn run<T: Real + Send + Sync>(&self, w: &mut [T], g: &[T]) -> Result<()> {
        if w.len() != g.len() {
            candle_core::bail!(
                "{}: parameter has {} elements, gradient {}",
                self.name(),
                w.len(),
                g.len()
            );
        }
        match (self.rule, self.moments.take()) {
            (Rule::Sgd { lr }, None) => sgd(w, g, lr),
            (Rule::AdamW(step), Some((m, v))) if m.len() == w.len() && v.len() == w.len() => {
                adamw(w, g, m, v, &step);
            }
            (rule, _) => candle_core::bail!(
                "{}: the moments do not match the rule {rule:?} or the parameter's length",
                self.name()
            ),
        }
        Ok(())
    }
}

/// `w -= lr * g`, the product rounded to f32 before the difference (as candle-nn's
/// `w.sub(&(g * lr))`, so an f32 parameter ends bit for bit where candle-nn's SGD puts it).
pub(crate) fn sgd<T: Real + Send + Sync>(w: &mut [T], g: &[T], lr: f32) {
    parallel::for_each_chunk_mut(w, CHUNK, |i, w| {
        runs(w, &g[i * CHUNK..][..w.len()], |w, g, _| {
            for (w, &g) in w.iter_mut().zip(g) {
                *w -= g * lr;
            }
        });
    });
}

/// One AdamW step over a parameter, its gradient and its moments (see [`Rule::AdamW`]).
pub(crate) fn adamw<T: Real + Send + Sync>(
    w: &mut [T],
    g: &[T],
    m: &mut [f32],
    v: &mut [f32],
    s: &AdamWStep,
) {
    // One task per chunk of all four slices (the moments are written too).
    let mut tasks: Vec<_> = w
        .chunks_mut(CHUNK)
        .zip(g.chunks(CHUNK))
        .zip(m.chunks_mut(CHUNK).zip(v.chunks_mut(CHUNK)))
        .collect();
    parallel::for_each_chunk_mut(&mut tasks, 1, |_, task| {
        for ((w, g), (m, v)) in task {
            runs(w, g, |w, g, start| {
                let (m, v) = (
                    &mut m[start..start + w.len()],
                    &mut v[start..start + w.len()],
                );
                adamw_f32(w, g, m, v, s);
            });
        }
    });
}

/// The AdamW element loop on f32 runs (see [`AdamWStep`]): each product and sum rounded to f32
/// as candle-nn's tensor ops round them (and `optim.cu`'s kernels).
fn adamw_f32(w: &mut [f32], g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamWStep) {
    moments_f32(g, m, v, s);
    apply_f32(w, m, v, s);
}

/// The moments' half of [`adamw_f32`].
fn moments_f32(g: &[f32], m: &mut [f32], v: &mut [f32], s: &AdamWStep) {
    let [beta1, one_minus_beta1, beta2, one_minus_beta2] = s.moment_consts();
    for ((&g, m), v) in g.iter().zip(m).zip(v) {
        *m = *m * beta1 + g * one_minus_beta1;
        *v = *v * beta2 + (g * g) * one_minus_beta2;
    }
}

/// [`apply_f32`] on a parameter of any float type, widened to f32 and rounded once.
fn apply_widened<T: Real>(w: &mut [T], m: &[f32], v: &[f32], s: &AdamWStep) {
    let mut wf = vec![0f32; w.len()];
    T::widen(w, &mut wf);
    apply_f32(&mut wf, m, v, s);
    T::narrow(&wf, w);
}

/// The parameter's half of [`adamw_f32`].
fn apply_f32(w: &mut [f32], m: &[f32], v: &[f32], s: &AdamWStep) {
    let [lr, decay, scale_m, scale_v, eps] = s.apply_consts();
    for ((w, &m), &v) in w.iter_mut().zip(m).zip(v) {
        let step = (m * scale_m) / ((v * scale_v).sqrt() + eps);
        *w = *w * decay - step * lr;
    }
}

/// Calls `f(w, g, start)` on consecutive runs of `w` and `g` (equal lengths) as f32, `start`
/// being the run's first index: the slices themselves for f32, stack blocks for the 16-bit
/// types, whose updated values are rounded once into `w`.
fn runs<T: Real>(w: &mut [T], g: &[T], mut f: impl FnMut(&mut [f32], &[f32], usize)) {
    if let (Some(wf), Some(gf)) = (as_f32_mut(w), as_f32(g)) {
        return f(wf, gf, 0);
    }
    let (mut ww, mut wg) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (i, (w, g)) in w.chunks_mut(BLOCK).zip(g.chunks(BLOCK)).enumerate() {
        let (ww, wg) = (&mut ww[..w.len()], &mut wg[..w.len()]);
        T::widen(w, ww);
        T::widen(g, wg);
        f(ww, wg, i * BLOCK);
        T::narrow(ww, w);
    }
}

#[cfg(test)]
mod tests {
    use half::bf16;

    use super::*;

    fn step(lr: f64, wd: f64, b1: f64, b2: f64, eps: f64, t: i32) -> AdamWStep {
        AdamWStep {
            lr,
            decay: 1.0 - lr * wd,
            beta1: b1,
            beta2: b2,
            scale_m: 1.0 / (1.0 - b1.powi(t)),
            scale_v: 1.0 / (1.0 - b2.powi(t)),
            eps,
        }
    }

    /// AdamW in f64 from the paper (bias-corrected moments): the independent reference.
    fn adamw_f64(w: &mut [f64], grads: &[Vec<f64>], lr: f64, wd: f64) {
        let (b1, b2, eps) = (0.9, 0.999, 1e-8);
        let (mut m, mut v) = (vec![0.0; w.len()], vec![0.0; w.len()]);
        for (t, g) in grads.iter().enumerate() {
            let t = (t + 1) as i32;
            for i in 0..w.len() {
                m[i] = b1 * m[i] + (1.0 - b1) * g[i];
                v[i] = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                let (mh, vh) = (m[i] / (1.0 - b1.powi(t)), v[i] / (1.0 - b2.powi(t)));
                w[i] = w[i] * (1.0 - lr * wd) - lr * mh / (vh.sqrt() + eps);
            }
        }
    }

    fn grads(n: usize, steps: usize) -> Vec<Vec<f64>> {
        (0..steps)
            .map(|s| {
                (0..n)
                    .map(|i| ((i * 7 + s * 13) % 23) as f64 / 11.0 - 1.0 + 1e-3 * i as f64)
                    .collect()
            })
            .collect()
    }

    /// The device path's two ops (the moments, then the parameter; run here on the CPU)
    /// against the one CPU pass: the same parameters and moments, bit for bit, over several
    /// steps, for f32 and bf16 parameters.
    #[test]
    fn adamw_moments_then_apply_match_the_one_pass() -> Result<()> {
        use candle_core::{DType, Device, Tensor};
        let n = 37;
        for dtype in [DType::F32, DType::BF16] {
            let w0: Vec<f32> = (0..n).map(|i| (i % 31) as f32 / 10.0 - 1.5).collect();
            let w = Tensor::new(w0.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
            let mv = Tensor::zeros((2, n), DType::F32, &Device::Cpu)?;
            let pass = w.to_dtype(dtype)?.copy()?;
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            for (t, g) in grads(n, 4).iter().enumerate() {
                let g = Tensor::new(g.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
                let s = step(1e-2, 0.1, 0.9, 0.999, 1e-8, t as i32 + 1);
                mv.inplace_op2(&g, &AdamWMoments(s))?;
                w.inplace_op2(&mv, &AdamWApply(s))?;
                let update = Update {
                    rule: Rule::AdamW(s),
                    moments: std::cell::Cell::new(Some((m.as_mut_slice(), v.as_mut_slice()))),
                };
                pass.inplace_op2(&g, &update)?;
            }
            let bits = |t: &Tensor| -> Result<Vec<u32>> {
                Ok(t.to_dtype(DType::F32)?
                    .to_vec1::<f32>()?
                    .iter()
                    .map(|x| x.to_bits())
                    .collect())
            };
            assert_eq!(bits(&w)?, bits(&pass)?, "{dtype:?}: parameters");
            assert_eq!(
                bits(&mv.get(0)?)?,
                m.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            assert_eq!(
                bits(&mv.get(1)?)?,
                v.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
            );
            assert_ne!(
                bits(&w)?,
                bits(&Tensor::new(w0.as_slice(), &Device::Cpu)?.to_dtype(dtype)?)?
            );
        }
        Ok(())
    }

    #[test]
    fn adamw_matches_the_f64_reference_serial_and_parallel() {
        for n in [5, 3 * CHUNK + 17] {
            let steps = 4;
            let gs = grads(n, steps);
            let mut reference: Vec<f64> = (0..n).map(|i| (i % 31) as f64 / 10.0 - 1.5).collect();
            let mut w: Vec<f32> = reference.iter().map(|&x| x as f32).collect();
            adamw_f64(&mut reference, &gs, 1e-2, 0.1);
            let (mut m, mut v) = (vec![0f32; n], vec![0f32; n]);
            for (t, g) in gs.iter().enumerate() {
                let g: Vec<f32> = g.iter().map(|&x| x as f32).collect();
                let s = step(1e-2, 0.1, 0.9, 0.999, 1e-8, t as i32 + 1);
                adamw(&mut w, &g, &mut m, &mut v, &s);
            }
            for (i, (&got, &want)) in w.iter().zip(&reference).enumerate() {
                // Four steps of size ~lr: f32 rounding of the order of 1e-7 relative.
                assert!(
                    (f64::from(got) - want).abs() <= 1e-6 * want.abs().max(1.0),
                    "n {n}, element {i}: {got} vs {want}"
                );
            }
        }
    }

    #[test]
    fn sgd_rounds_like_candle_nn_and_half_parameters_round_once() {
        let n = 2 * CHUNK + 3;
        let w0: Vec<f32> = (0..n).map(|i| (i % 97) as f32 / 7.0 - 5.0).collect();
        let g: Vec<f32> = (0..n).map(|i| (i % 89) as f32 / 3.0 - 13.0).collect();
        let mut w = w0.clone();
        sgd(&mut w, &g, 0.3);
        for i in 0..n {
            let product = g[i] * 0.3f32;
            assert_eq!(w[i].to_bits(), (w0[i] - product).to_bits(), "element {i}");
        }
        // bf16: the f32 result rounded once (not the product rounded to bf16 first).
        let mut wb: Vec<bf16> = w0.iter().map(|&x| bf16::from_f32(x)).collect();
        let gb: Vec<bf16> = g.iter().map(|&x| bf16::from_f32(x)).collect();
        let expected: Vec<bf16> = wb
            .iter()
            .zip(&gb)
            .map(|(w, g)| bf16::from_f32(w.to_f32() - g.to_f32() * 0.3))
            .collect();
        sgd(&mut wb, &gb, 0.3);
        assert_eq!(wb, expected);
    }
}
