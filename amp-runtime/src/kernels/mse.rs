//! Mean squared error on CPU as one fp32-class op that reads its prediction and target in f32,
//! f16 or bf16, each as it is.
//!
//! The composition (subtract, square, mean) is three graph nodes and full-size buffers, and
//! under autocast a half prediction first becomes an f32 copy. This op widens both operands
//! block by block, sums `(x - t)^2` in f32 lanes per run (f64 across runs) and returns the f32
//! mean. Backward, `dx = 2 (x - t) / n * dy` and `dt = -dx`, each in one pass from both operands
//! as they are, computed in f32 and rounded once to its operand's dtype (as the cast nodes'
//! backward would), and only for an operand that wants one (a target from the data does not).

use crate::kernels::elem::with_floats;
use crate::kernels::elem::Real;
use crate::kernels::leaf_grads::wanted;
use crate::kernels::parallel;
use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor};

/// `mean((inp - target)^2)` in f32 through this op, when both are float tensors of one shape
/// on CPU; `None` otherwise.
pub(crate) fn mse(inp: &Tensor, target: &Tensor) -> Result<Option<Tensor>> {
    if !(crate::kernels::elem::cpu_float(inp) && crate::kernels::elem::cpu_float(target))
        || inp.shape() != target.shape()
    {
        return Ok(None);
    }
    inp.contiguous()?
        .apply_op2(&target.contiguous()?, Mse)
        .map(Some)
}

/// Elements per parallel task.
const CHUNK: usize = 1 << 15;

/// The sum of `(x - t)^2`, both widened to f32 a block at a time.
fn squared_error<T: Real + Sync, U: Real + Sync>(xs: &[T], ts: &[U]) -> f64 {
    parallel::map_indices(xs.len().div_ceil(CHUNK), |i| {
        let end = ((i + 1) * CHUNK).min(xs.len());
        let (xs, ts) = (&xs[i * CHUNK..end], &ts[i * CHUNK..end]);
        let mut total = 0f64;
        crate::kernels::widen::widened2(xs, ts, |x, t| {
            total += crate::kernels::widen::lane_sums2(x, t, |x, t| ((x - t) * (x - t), 0.0)).0;
        });
        total
    })
    .iter()
    .sum()
}

struct Mse;

impl CustomOp2 for Mse {
    fn name(&self) -> &'static str {
        "amp-mse"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let sum = with_floats!("mse", x, lx, |xs| with_floats!("mse", t, lt, |ts| {
            squared_error(xs, ts)
        }));
        #[allow(clippy::cast_precision_loss)] // an element count
        let mean = sum / lx.shape().elem_count() as f64;
        Ok((CpuStorage::F32(vec![mean as f32]), Shape::from(())))
    }

    fn bwd(
        &self,
        x: &Tensor,
        t: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[allow(clippy::cast_precision_loss)] // an element count
        let scale = 2.0 / x.elem_count().max(1) as f64 * f64::from(grad.to_scalar::<f32>()?);
        #[allow(clippy::cast_possible_truncation)] // the factor is applied in f32
        let grad_of = |operand: &Tensor, scale: f64| {
            let out = operand.dtype();
            wanted(operand, || {
                x.apply_op2_no_bwd(t, &ScaledDiff(scale as f32, out))
            })
        };
        Ok((grad_of(x, scale)?, grad_of(t, -scale)?))
    }
}

/// `(x, t) -> (x - t) * .0`, computed in f32 from both operands as they are and rounded once to
/// the dtype `.1`: the gradient of the prediction (the factor `2 dy / n`) or of the target (its
/// negation), in one parallel pass.
struct ScaledDiff(f32, DType);

/// `(x - t) * scale` into `out`, a block of f32 values at a time.
fn scaled_diff<T: Real + Sync, U: Real + Sync, O: Real + Send>(
    xs: &[T],
    ts: &[U],
    scale: f32,
) -> Vec<O> {
    const BLOCK: usize = 1024;
    parallel::filled(xs.len(), CHUNK, |i, out| {
        let (xs, ts) = (&xs[i * CHUNK..][..out.len()], &ts[i * CHUNK..][..out.len()]);
        let mut done = 0;
        let mut diff = [0f32; BLOCK];
        crate::kernels::widen::widened2(xs, ts, |xs, ts| {
            for (xs, ts) in xs.chunks(BLOCK).zip(ts.chunks(BLOCK)) {
                let diff = &mut diff[..xs.len()];
                for ((d, &x), &t) in diff.iter_mut().zip(xs).zip(ts) {
                    *d = (x - t) * scale;
                }
                crate::kernels::elem::convert_block(diff, &mut out[done..done + xs.len()]);
                done += xs.len();
            }
        });
    })
}

impl CustomOp2 for ScaledDiff {
    fn name(&self) -> &'static str {
        "amp-mse-grad"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        t: &CpuStorage,
        lt: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let ScaledDiff(scale, out) = *self;
        let grad = with_floats!("mse grad", x, lx, |xs| with_floats!(
            "mse grad",
            t,
            lt,
            |ts| {
                match out {
                    DType::F32 => CpuStorage::F32(scaled_diff(xs, ts, scale)),
                    DType::F16 => CpuStorage::F16(scaled_diff(xs, ts, scale)),
                    DType::BF16 => CpuStorage::BF16(scaled_diff(xs, ts, scale)),
                    other => candle_core::bail!("mse grad: unexpected dtype {other:?}"),
                }
            }
        ));
        Ok((grad, lx.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// Value and both gradients against the f64 composition, for every pair of dtypes, from the
    /// same (rounded) values: f32 within 1e-6 relative, each gradient within one rounding of
    /// its operand's dtype.
    #[test]
    fn matches_the_f64_composition_in_every_dtype_pair() -> Result<()> {
        let dev = Device::Cpu;
        // Fixed values (candle's CPU generator cannot be seeded), an odd length.
        #[allow(clippy::cast_precision_loss)] // small indices
        let wave = |f: f32, a: f32| -> Result<Tensor> {
            let v: Vec<f32> = (0..100_003).map(|i| a * (i as f32 * f).sin()).collect();
            Tensor::from_vec(v, 100_003, &dev)
        };
        let (x0, t0) = (wave(0.37, 3.0)?, wave(0.11, 2.0)?);
        let dtypes = [DType::F32, DType::F16, DType::BF16];
        for dx_type in dtypes {
            for dt_type in dtypes {
                let x = Var::from_tensor(&x0.to_dtype(dx_type)?)?;
                let t = Var::from_tensor(&t0.to_dtype(dt_type)?)?;
                let loss = mse(x.as_tensor(), t.as_tensor())?.expect("supported");
                assert_eq!(loss.dtype(), DType::F32);
                let grads = (&loss * 3.0)?.backward()?;
                let (gx, gt) = (grads.get(&x).expect("dx"), grads.get(&t).expect("dt"));
                assert_eq!((gx.dtype(), gt.dtype()), (dx_type, dt_type));

                let rx = Var::from_tensor(&x.to_dtype(DType::F64)?)?;
                let rt = Var::from_tensor(&t.to_dtype(DType::F64)?)?;
                let rloss = (rx.as_tensor() - rt.as_tensor())?.sqr()?.mean_all()?;
                let rgrads = (&rloss * 3.0)?.backward()?;
                let want = rloss.to_scalar::<f64>()?;
                let got = f64::from(loss.to_scalar::<f32>()?);
                assert!(
                    (got - want).abs() <= 1e-6 * want,
                    "{dx_type:?}/{dt_type:?}: {got} vs {want}"
                );
                for (g, r, d) in [
                    (gx, rgrads.get(&rx).expect("dx"), dx_type),
                    (gt, rgrads.get(&rt).expect("dt"), dt_type),
                ] {
                    let tol = match d {
                        DType::F32 => 1e-6,
                        DType::F16 => 1e-3,
                        _ => 8e-3,
                    };
                    let scale = crate::kernels::testing::max_abs(r)?;
                    let diff = crate::kernels::testing::max_abs_diff(g, r)?;
                    assert!(
                        diff <= tol * scale,
                        "{dx_type:?}/{dt_type:?}: off by {diff} of {scale}"
                    );
                }
            }
        }
        Ok(())
    }
}
