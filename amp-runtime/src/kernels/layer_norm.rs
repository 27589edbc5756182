//! Layer norm and RMS norm over the last dimension on CPU and CUDA in f32 as one op each with
//! its own backward (CUDA: `cuda/layer_norm.cu`, the same arithmetic).
//!
//! The differentiable composition (`composite::layer_norm`) is nine graph nodes (two means, a
//! subtraction, a square, an add, a square root, a division, the scale and the shift), each a
//! full pass and a buffer the backward keeps. This op is one node: forward, per row,
//! `y = (x - mean) / sqrt(var + eps) * w + b` (biased variance); backward, with
//! `xhat = (x - mean) * rstd` and `g = dy * w`,
//! `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dw = sum over rows of dy * xhat`,
//! `db = sum over rows of dy` (PyTorch's `native_layer_norm_backward`), in one pass over the
//! rows. RMS norm is the same op without the centring (`mean` taken as 0, no shift, and no
//! `mean(g)` term in `dx`): `y = x / sqrt(mean(x^2) + eps) * w`, where its composition was six
//! nodes.

use crate::kernels::elem::with_floats;
use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::{offer, wanted};
use crate::kernels::parallel;
use candle_core::{CpuStorage, CustomOp3, DType, Layout, Result, Shape, Tensor};

/// `layer_norm(x, w, b)` in f32 through this op when it applies (an f32, f16 or bf16 input on
/// CPU or CUDA, read as it is; f32 scale and shift of the last dimension's length on its
/// device); `None` otherwise.
pub(crate) fn layer_norm(
    x: &Tensor,
    w: &Tensor,
    b: Option<&Tensor>,
    eps: f64,
) -> Result<Option<Tensor>> {
    norm(x, w, b, eps, false)
}

/// `rms_norm(x, w)` in f32 through this op when it applies (as [`layer_norm`]); `None`
/// otherwise.
pub(crate) fn rms_norm(x: &Tensor, w: &Tensor, eps: f64) -> Result<Option<Tensor>> {
    norm(x, w, None, eps, true)
}

fn norm(x: &Tensor, w: &Tensor, b: Option<&Tensor>, eps: f64, rms: bool) -> Result<Option<Tensor>> {
    let n = x.dims().last().copied().unwrap_or(0);
    let fits = |t: &Tensor| {
        t.dtype() == DType::F32 && t.dims() == [n] && t.device().same_device(x.device())
    };
    let float = crate::kernels::elem::cpu_float(x) || crate::kernels::elem::cuda_float(x);
    if !(float && fits(w) && b.is_none_or(fits)) || n == 0 {
        return Ok(None);
    }
    let b = match b {
        Some(b) => b.clone(),
        None => w.zeros_like()?,
    };
    #[allow(clippy::cast_possible_truncation)] // an epsilon, well inside f32
    let op = LayerNorm {
        eps: eps as f32,
        rms,
    };
    x.contiguous()?
        .apply_op3(&w.contiguous()?, &b.contiguous()?, op)
        .map(Some)
}

/// Rows per parallel task: about 32K elements each.
fn rows_per_task(n: usize) -> usize {
    ((1 << 15) / n.max(1)).max(1)
}

/// Mean (0 for RMS norm) and `1 / sqrt(var + eps)` of a row, eight partial sums per pass.
/// A row of finite values whose sums overflow f32 (deviations past ~1.8e19, reachable from bf16
/// activations) takes its moments in f64: in f32 the variance is inf, `1 / sqrt(inf)` is 0, and
/// every output would be the shift with a zero gradient, finite, so that nothing downstream
/// (the gradient scaler included) would see it. PyTorch gives NaN there; the f64 moments give
/// the normalised values.
fn moments(x: &[f32], eps: f32, rms: bool) -> (f32, f32) {
    #[allow(clippy::cast_precision_loss)] // a row length
    let n = x.len() as f32;
    let mean = if rms { 0.0 } else { lane_sum(x, |v| v) / n };
    let var = lane_sum(x, |v| (v - mean) * (v - mean)) / n;
    if (mean.is_finite() && var.is_finite()) || x.iter().any(|v| !v.is_finite()) {
        return (mean, 1.0 / (var + eps).sqrt());
    }
    #[allow(clippy::cast_precision_loss)] // a row length
    let n = x.len() as f64;
    let mean = if rms {
        0.0
    } else {
        x.iter().map(|&v| f64::from(v)).sum::<f64>() / n
    };
    let var = x
        .iter()
        .map(|&v| (f64::from(v) - mean).powi(2))
        .sum::<f64>()
        / n;
    #[allow(clippy::cast_possible_truncation)] // the mean of f32 values, the f32 reciprocal
    (mean as f32, (1.0 / (var + f64::from(eps)).sqrt()) as f32)
}

/// The sum of `f(v)` over `x` in eight lanes (lane `l` adds the elements at `l` mod 8), the
/// lanes added last. `f` is a type parameter, not a `&dyn Fn`: the loop inlines it and
/// vectorises (through a `dyn` it was an indirect call per element).
fn lane_sum(x: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0f32; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for chunk in chunks {
        for (lane, &v) in lanes.iter_mut().zip(chunk) {
            *lane += f(v);
        }
    }
    for (lane, &v) in lanes.iter_mut().zip(rest) {
        *lane += f(v);
    }
    lanes.iter().sum()
}

fn f32s<'a>(s: &'a CpuStorage, l: &Layout, what: &str) -> Result<&'a [f32]> {
    match s {
        CpuStorage::F32(v) => crate::kernels::layout::contiguous(v, l, what),
        _ => candle_core::bail!("{what} kernel: expected f32"),
    }
}

struct LayerNorm {
    eps: f32,
    /// RMS norm: no centring.
    rms: bool,
}

impl LayerNorm {
    /// `y = (x - mean) * rstd * w + b` per row of `x` (any float dtype), in f32.
    fn forward<T: Real + Sync>(&self, x: &[T], w: &[f32], b: &[f32]) -> Vec<f32> {
        let n = w.len();
        let chunk = rows_per_task(n) * n;
        parallel::filled(x.len(), chunk, |i, y| {
            let x = &x[i * chunk..][..y.len()];
            let mut row = vec![0f32; n];
            for (y, x) in y.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
                T::widen(x, &mut row);
                let (mean, rstd) = moments(&row, self.eps, self.rms);
                for (((y, &x), &w), &b) in y.iter_mut().zip(&row).zip(w).zip(b) {
                    *y = (x - mean) * rstd * w + b;
                }
            }
        })
    }
}

impl CustomOp3 for LayerNorm {
    fn name(&self) -> &'static str {
        if self.rms {
            "amp-rms-norm"
        } else {
            "amp-layer-norm"
        }
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sb: &CpuStorage,
        lb: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (w, b) = (f32s(sw, lw, "layer norm")?, f32s(sb, lb, "layer norm")?);
        let y = with_floats!("layer norm", sx, lx, |x| self.forward(x, w, b));
        Ok((CpuStorage::F32(y), lx.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sb: &candle_core::CudaStorage,
        lb: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::layer_norm::forward((sx, lx), (sw, lw), (sb, lb), self.eps, self.rms)
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        dy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let n = w.elem_count();
        let rows = x.elem_count() / n;
        // One pass gives all three; each is returned only if wanted.
        let grad = LayerNormGrad {
            eps: self.eps,
            rms: self.rms,
        };
        let grads = x.apply_op3_no_bwd(w, &dy.contiguous()?, &grad)?;
        let dx = wanted(x, || {
            crate::kernels::convert::to_dtype(
                &grads.narrow(0, 0, rows * n)?.reshape(x.shape())?,
                x.dtype(),
            )
        })?;
        let dw = offer(w, || grads.narrow(0, rows * n, n))?;
        let db = offer(b, || grads.narrow(0, rows * n + n, n))?;
        Ok((dx, dw, db))
    }
}

/// `(x, w, dy) -> [dx, dw, db]`, flat, in f32 (`x` in any float dtype).
struct LayerNormGrad {
    eps: f32,
    rms: bool,
}

impl LayerNormGrad {
    fn backward<T: Real + Sync>(&self, x: &[T], w: &[f32], dy: &[f32]) -> Vec<f32> {
        let n = w.len();
        let mut dx = vec![0f32; x.len()];
        let chunk = rows_per_task(n) * n;
        // Each task: its rows' dx, and its partial dw and db.
        let partials: Vec<(Vec<f32>, Vec<f32>)> =
            parallel::map_chunks_mut(&mut dx, chunk, |i, dx| {
                let (x, dy) = (&x[i * chunk..][..dx.len()], &dy[i * chunk..][..dx.len()]);
                let (mut dw, mut db) = (vec![0f32; n], vec![0f32; n]);
                let (mut row, mut xhat) = (vec![0f32; n], vec![0f32; n]);
                #[allow(clippy::cast_precision_loss)] // a row length
                let nf = n as f32;
                for ((dx, x), dy) in dx
                    .chunks_exact_mut(n)
                    .zip(x.chunks_exact(n))
                    .zip(dy.chunks_exact(n))
                {
                    T::widen(x, &mut row);
                    let (mean, rstd) = moments(&row, self.eps, self.rms);
                    let (mut mean_g, mut mean_gx) = (0f32, 0f32);
                    for j in 0..n {
                        xhat[j] = (row[j] - mean) * rstd;
                        let g = dy[j] * w[j];
                        mean_g += g;
                        mean_gx += g * xhat[j];
                        dw[j] += dy[j] * xhat[j];
                        db[j] += dy[j];
                    }
                    let mean_g = if self.rms { 0.0 } else { mean_g / nf };
                    let mean_gx = mean_gx / nf;
                    for j in 0..n {
                        dx[j] = rstd * (dy[j] * w[j] - mean_g - xhat[j] * mean_gx);
                    }
                }
                (dw, db)
            });
        let (mut dw, mut db) = (vec![0f32; n], vec![0f32; n]);
        for (pw, pb) in partials {
            for j in 0..n {
                dw[j] += pw[j];
                db[j] += pb[j];
            }
        }
        dx.extend(dw);
        dx.extend(db);
        dx
    }
}

impl CustomOp3 for LayerNormGrad {
    fn name(&self) -> &'static str {
        "amp-layer-norm-grad"
    }

    fn cpu_fwd(
        &self,
        sx: &CpuStorage,
        lx: &Layout,
        sw: &CpuStorage,
        lw: &Layout,
        sdy: &CpuStorage,
        ldy: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (w, dy) = (
            f32s(sw, lw, "layer norm backward")?,
            f32s(sdy, ldy, "layer norm backward")?,
        );
        let out = with_floats!("layer norm backward", sx, lx, |x| self.backward(x, w, dy));
        let len = out.len();
        Ok((CpuStorage::F32(out), Shape::from(len)))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        sx: &candle_core::CudaStorage,
        lx: &Layout,
        sw: &candle_core::CudaStorage,
        lw: &Layout,
        sdy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::layer_norm::backward(
            (sx, lx),
            (sw, lw),
            (sdy, ldy),
            self.eps,
            self.rms,
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        crate::kernels::testing::max_abs_diff(a, b).expect("comparable tensors")
    }

    /// The textbook layer norm (RMS norm with `rms`: no centring) from candle ops (eps 1e-5),
    /// differentiated by candle.
    fn composed(x: &Tensor, w: &Tensor, b: Option<&Tensor>, rms: bool) -> Result<Tensor> {
        let centered = if rms {
            x.clone()
        } else {
            x.broadcast_sub(&x.mean_keepdim(candle_core::D::Minus1)?)?
        };
        let var = centered.sqr()?.mean_keepdim(candle_core::D::Minus1)?;
        let y = centered
            .broadcast_div(&(var + 1e-5)?.sqrt()?)?
            .broadcast_mul(w)?;
        match b {
            Some(b) => y.broadcast_add(b),
            None => Ok(y),
        }
    }

    /// Output and the three gradients against the differentiable composition (candle autograd),
    /// with and without a shift, for rows shorter and longer than a task's share, from a
    /// strided input; RMS norm the same way (no shift).
    #[test]
    fn matches_the_composition_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        let cases = [(3, 5, true), (70, 700, true), (4, 9, false)];
        let dtypes = [DType::F32, DType::F16, DType::BF16];
        for (((rows, n, shifted), dtype), rms) in cases
            .into_iter()
            .flat_map(|c| dtypes.map(|d| (c, d)))
            .flat_map(|c| [(c, false), (c, true)])
        {
            let shifted = shifted && !rms;
            // The half input's values, also as the f64 reference's input: only the fused op's
            // f32 arithmetic differs, and the rounding of dx to the input's dtype.
            // Fixed inputs (candle's CPU generator cannot be seeded).
            #[allow(clippy::cast_precision_loss)] // indices well inside f32's exact range
            let wave = |len: usize, f: f32, a: f32, b: f32| -> Result<Tensor> {
                let v: Vec<f32> = (0..len).map(|i| a * (i as f32 * f).sin() + b).collect();
                Tensor::from_vec(v, len, &dev)
            };
            let x = (wave(rows * n, 0.37, 2.0, 0.5)?.reshape((n, rows))?.t()?).to_dtype(dtype)?;
            let w = Var::from_tensor(&wave(n, 0.7, 0.3, 1.0)?)?;
            let b = Var::from_tensor(&wave(n, 0.9, 0.3, 0.0)?)?;
            let up = wave(rows * n, 0.11, 1.0, 0.0)?.reshape((rows, n))?;
            let bias = shifted.then(|| b.as_tensor());
            let run = |fused: bool| -> Result<(Tensor, Tensor, Tensor, Option<Tensor>)> {
                let xv = Var::from_tensor(&x)?;
                let y = if fused && rms {
                    rms_norm(xv.as_tensor(), w.as_tensor(), 1e-5)?.expect("applies")
                } else if fused {
                    layer_norm(xv.as_tensor(), w.as_tensor(), bias, 1e-5)?.expect("applies")
                } else {
                    let f64s = |t: &Tensor| t.to_dtype(DType::F64);
                    let bias = bias.map(f64s).transpose()?;
                    let x = f64s(xv.as_tensor())?;
                    composed(&x, &f64s(w.as_tensor())?, bias.as_ref(), rms)?.to_dtype(DType::F32)?
                };
                let grads = (&y * &up)?.sum_all()?.backward()?;
                let g = |t: &Tensor| grads.get(t).cloned();
                Ok((
                    y,
                    g(xv.as_tensor()).expect("dx"),
                    g(w.as_tensor()).expect("dw"),
                    g(b.as_tensor()),
                ))
            };
            let (y, dx, dw, db) = run(true)?;
            let (ry, rdx, rdw, rdb) = run(false)?;
            let case = format!("({rows}, {n}) {dtype:?} rms {rms}");
            assert_eq!((y.dtype(), dx.dtype()), (DType::F32, dtype), "{case}");
            assert!(max_diff(&y, &ry) < 1e-5, "{case}: y");
            // dx is rounded to the input's dtype once (|dx| of a few units here).
            let tol = match dtype {
                DType::F32 => 1e-4,
                DType::F16 => 1e-2,
                _ => 8e-2,
            };
            assert!(max_diff(&dx, &rdx) < tol, "{case}: dx");
            let scale = rdw.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
            assert!(max_diff(&dw, &rdw) < 1e-4 * scale, "{case}: dw");
            if shifted {
                let (db, rdb) = (db.expect("db"), rdb.expect("db"));
                let scale = rdb.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
                assert!(max_diff(&db, &rdb) < 1e-4 * scale, "{case}: db");
            }
        }
        Ok(())
    }
}
