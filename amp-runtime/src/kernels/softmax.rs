//! Softmax and log-softmax over the last dimension on CPU as one fp32-class op each that reads
//! f32, f16 or bf16.
//!
//! candle-nn's differentiable `softmax` is five graph nodes (max, subtract, exp, sum, divide),
//! each a full pass and a fresh buffer, and under autocast a half input first becomes an f32
//! copy (a sixth); its `log_softmax` is as many. This op widens each row while it reads it,
//! computes `exp(x - max) / sum` (or `x - max - ln(sum)`) in f32 and writes the f32 result: one
//! node, one pass. Backward, `dx = y * (dy - sum(dy * y))` for softmax (its Jacobian applied to
//! `dy`) and `dx = dy - exp(y) * sum(dy)` for log-softmax, in f32, rounded once to the input's
//! dtype, which is what the cast node's backward would do.

use crate::kernels::elem::with_floats;
use crate::kernels::parallel;

use crate::kernels::elem::Real;
use candle_core::{CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor, D};

/// Whether the op runs `x`: an f32, f16 or bf16 tensor on CPU, or (feature `cuda`) on CUDA.
fn supported(x: &Tensor) -> bool {
    use crate::kernels::elem::{cpu_float, cuda_float};
    cpu_float(x) || cuda_float(x)
}

/// Softmax of `x` over its last dimension, in f32: through this op for a float tensor on CPU or
/// CUDA, candle-nn's composition (after an f32 cast) elsewhere.
pub(crate) fn softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if supported(x) {
        x.contiguous()?.apply_op1(SoftmaxLastDim { log: false })
    } else {
        candle_nn::ops::softmax(&x.to_dtype(DType::F32)?, D::Minus1)
    }
}

/// Log-softmax of `x` over its last dimension, in f32 (as [`softmax_last_dim`]).
pub(crate) fn log_softmax_last_dim(x: &Tensor) -> Result<Tensor> {
    if supported(x) {
        x.contiguous()?.apply_op1(SoftmaxLastDim { log: true })
    } else {
        candle_nn::ops::log_softmax(&x.to_dtype(DType::F32)?, D::Minus1)
    }
}

/// Rows per parallel task: about 64K elements each.
fn rows_per_task(n: usize) -> usize {
    ((1 << 16) / n.max(1)).max(1)
}

/// `exp(x - max) / sum` (with `log`: `x - max - ln(sum)`) of each row of length `n`, widened
/// to f32 as it is read.
fn softmax_rows<T: Real + Sync>(x: &[T], n: usize, log: bool) -> Vec<f32> {
    if n == 0 {
        return vec![0f32; x.len()];
    }
    let chunk = rows_per_task(n) * n;
    parallel::filled(x.len(), chunk, |i, out| {
        let x = &x[i * chunk..][..out.len()];
        for (y, x) in out.chunks_exact_mut(n).zip(x.chunks_exact(n)) {
            T::widen(x, y);
            let max = y.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            // Eight partial sums: a long row's rounding error grows with its length over
            // eight, not its whole length.
            let mut lanes = [0f32; 8];
            for (i, v) in y.iter_mut().enumerate() {
                *v -= max;
                let e = v.exp();
                lanes[i % 8] += e;
                if !log {
                    *v = e;
                }
            }
            let sum: f32 = lanes.iter().sum();
            if log {
                let log_sum = sum.ln();
                for v in y.iter_mut() {
                    *v -= log_sum;
                }
            } else {
                for v in y.iter_mut() {
                    *v /= sum;
                }
            }
        }
    })
}

/// Softmax, or log-softmax with `log`, over the last dimension.
struct SoftmaxLastDim {
    log: bool,
}

impl CustomOp1 for SoftmaxLastDim {
    fn name(&self) -> &'static str {
        if self.log {
            "amp-log-softmax-last-dim"
        } else {
            "amp-softmax-last-dim"
        }
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let n = l.shape().dims().last().copied().unwrap_or(1);
        let y = with_floats!("softmax", s, l, |x| softmax_rows(x, n, self.log));
        Ok((CpuStorage::F32(y), l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::softmax::forward(s, l, self.log)
    }

    fn bwd(&self, arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        // On CUDA one kernel (`softmax.cu`); on CPU candle ops in f32, then the cast.
        #[cfg(feature = "cuda")]
        if res.device().is_cuda() {
            let op = SoftmaxGrad {
                log: self.log,
                dtype: arg.dtype(),
            };
            return Ok(Some(
                res.contiguous()?
                    .apply_op2_no_bwd(&grad.contiguous()?, &op)?,
            ));
        }
        let dx = if self.log {
            (grad - res.exp()?.broadcast_mul(&grad.sum_keepdim(D::Minus1)?)?)?
        } else {
            let gy = (grad * res)?;
            (&gy - res.broadcast_mul(&gy.sum_keepdim(D::Minus1)?)?)?
        };
        Ok(Some(crate::kernels::convert::to_dtype(&dx, arg.dtype())?))
    }
}

/// The backward on CUDA: `(y, dy) -> dx` in the input's dtype (`softmax.cu`).
#[cfg(feature = "cuda")]
struct SoftmaxGrad {
    log: bool,
    dtype: DType,
}

#[cfg(feature = "cuda")]
impl candle_core::CustomOp2 for SoftmaxGrad {
    fn name(&self) -> &'static str {
        "amp-softmax-grad"
    }

    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        candle_core::bail!("the softmax gradient kernel runs on CUDA (the CPU's is candle ops)")
    }

    fn cuda_fwd(
        &self,
        y: &candle_core::CudaStorage,
        ly: &Layout,
        dy: &candle_core::CudaStorage,
        ldy: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::softmax::backward((y, ly), (dy, ldy), self.dtype, self.log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
        crate::kernels::testing::max_abs_diff(a, b).expect("comparable tensors")
    }

    /// Softmax and log-softmax, forward and gradient, against candle-nn's compositions in f64
    /// (its f32 one is itself off by more than this op over a row of 70,000), for every input
    /// dtype, a row longer than a
    /// task's share and a strided (transposed) input, each from the same (rounded) input values:
    /// f32 within 1e-5 of the gradient's scale (1.4e-6 measured), f16 2e-3 (5e-4), bf16 1.6e-2
    /// (3e-3), the gradient's one rounding to the input's dtype.
    #[test]
    fn matches_candle_nns_composition_forward_and_backward() -> Result<()> {
        let dev = Device::Cpu;
        for (shape, transpose) in [((3, 5), false), ((4, 70_000), false), ((6, 9), true)] {
            // Fixed inputs (candle's CPU generator cannot be seeded): logits in about [-2, 4],
            // upstream gradients in [-1, 1].
            let count = shape.0 * shape.1;
            #[allow(clippy::cast_precision_loss)] // indices well inside f32's exact range
            let wave = |f: f32, a: f32, b: f32| -> Result<Tensor> {
                let v: Vec<f32> = (0..count).map(|i| a * (i as f32 * f).sin() + b).collect();
                Tensor::from_vec(v, shape, &dev)
            };
            let x = wave(0.37, 3.0, 1.0)?;
            let x = if transpose { x.t()? } else { x };
            let w = wave(0.11, 1.0, 0.0)?.reshape(x.dims())?;
            for (dtype, log) in [DType::F32, DType::F16, DType::BF16]
                .into_iter()
                .flat_map(|d| [(d, false), (d, true)])
            {
                let input = Var::from_tensor(&x.to_dtype(dtype)?)?;
                let y = if log {
                    log_softmax_last_dim(input.as_tensor())?
                } else {
                    softmax_last_dim(input.as_tensor())?
                };
                assert_eq!(y.dtype(), DType::F32);
                let grads = (&y * &w)?.sum_all()?.backward()?;
                let dx = grads.get(input.as_tensor()).expect("a gradient");
                assert_eq!(dx.dtype(), dtype);

                // The reference in f64, from the same (rounded) input values.
                let reference = Var::from_tensor(&input.as_tensor().to_dtype(DType::F64)?)?;
                let ry = if log {
                    candle_nn::ops::log_softmax(reference.as_tensor(), D::Minus1)?
                } else {
                    candle_nn::ops::softmax(reference.as_tensor(), D::Minus1)?
                };
                let rgrads = (&ry * &w.to_dtype(DType::F64)?)?.sum_all()?.backward()?;
                let rdx = rgrads.get(reference.as_tensor()).expect("a gradient");
                // f32 against f64: rounding relative to the largest probability (or
                // log-probability).
                let top = crate::kernels::testing::max_abs(&ry)?;
                let d = max_diff(&y, &ry);
                assert!(
                    d <= 1e-5 * top,
                    "{dtype:?} log={log} {shape:?}: forward off by {d}"
                );
                let tol = match dtype {
                    DType::F32 => 1e-5,
                    DType::F16 => 2e-3,
                    _ => 1.6e-2,
                };
                let scale = crate::kernels::testing::max_abs(rdx)?;
                let d = max_diff(dx, rdx);
                assert!(
                    d <= tol * scale,
                    "{dtype:?} log={log} {shape:?}: gradient off by {d} of {scale}"
                );
            }
        }
        Ok(())
    }
}
