//! Conversions between f32, bf16 and f16 on CPU: vectorised (AVX-512 where the CPU has it) and
//! split over the kernels' pool, as one op whose backward is the conversion back.
//!
//! candle converts element by element through `half` on one thread. A training step converts
//! every activation that changes precision and every weight once, forward and backward, so this
//! is on the hot path of every autocast region. Rounding is the same as `half`'s bit for bit
//! (to nearest, ties to even; NaN stays NaN): see [`crate::kernels::simd`].

use crate::kernels::layout::elements;

use crate::kernels::parallel;

use crate::kernels::elem::{convert_block, Real};
use candle_core::{
    backend::BackendStorage, CpuStorage, CustomOp1, DType, Layout, Result, Shape, Tensor,
};
use half::{bf16, f16};

/// `t` converted to `dtype` (differentiable): this op for f32/bf16/f16 on CPU, candle's
/// `to_dtype` otherwise.
pub(crate) fn to_dtype(t: &Tensor, dtype: DType) -> Result<Tensor> {
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    if t.device().is_cpu() && float(t.dtype()) && float(dtype) && t.dtype() != dtype {
        t.apply_op1(Convert(dtype))
    } else {
        t.to_dtype(dtype)
    }
}

/// Converts its input to the dtype it holds; its backward converts back.
pub(crate) struct Convert(pub DType);

/// Elements per task.
const CHUNK: usize = 1 << 15;

/// `src` converted into `dst`, chunk by chunk in parallel.
pub(crate) fn convert_into<S: Real + Sync, D: Real + Send>(src: &[S], dst: &mut [D]) {
    parallel::for_each_chunk_mut(dst, CHUNK, |i, d| {
        convert_block(&src[i * CHUNK..][..d.len()], d);
    });
}

/// `src` converted to `D`.
pub(crate) fn convert_slice<S: Real + Sync, D: Real + Send>(src: &[S]) -> Vec<D> {
    parallel::filled(src.len(), CHUNK, |i, d| {
        convert_block(&src[i * CHUNK..][..d.len()], d);
    })
}

fn convert_to<S: Real + Sync>(src: &[S], dtype: DType) -> Result<CpuStorage> {
    Ok(match dtype {
        DType::F32 => CpuStorage::F32(convert_slice(src)),
        DType::BF16 => CpuStorage::BF16(convert_slice::<S, bf16>(src)),
        DType::F16 => CpuStorage::F16(convert_slice::<S, f16>(src)),
        other => candle_core::bail!("convert kernel: unexpected target dtype {other:?}"),
    })
}

impl CustomOp1 for Convert {
    fn name(&self) -> &'static str {
        "amp-convert"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = match s {
            CpuStorage::F32(x) => convert_to(&elements(x, l), self.0)?,
            CpuStorage::BF16(x) => convert_to(&elements(x, l), self.0)?,
            CpuStorage::F16(x) => convert_to(&elements(x, l), self.0)?,
            other => candle_core::bail!("convert kernel: unexpected dtype {:?}", other.dtype()),
        };
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let back = Convert(arg.dtype());
        Ok(Some(grad.apply_op1_no_bwd(&back)?))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Var};

    use super::*;

    /// Bit-identical to candle's `to_dtype` for every pair (odd length, so the scalar tail
    /// runs too; a strided input), and the gradient is the conversion back.
    #[test]
    fn conversions_match_candle_bit_for_bit_and_differentiate() -> Result<()> {
        let dev = Device::Cpu;
        let mut v: Vec<f32> = (0..100_003)
            .map(|i| ((i as f32) * 0.37).sin() * 1e3)
            .collect();
        v.extend([f32::NAN, f32::INFINITY, -0.0, 1e-40, 70000.0]);
        let base = Tensor::from_vec(v, (100_008,), &dev)?;
        let dtypes = [DType::F32, DType::BF16, DType::F16];
        for from in dtypes {
            let x = base.to_dtype(from)?;
            for to in dtypes {
                let bits = |t: &Tensor| -> Result<Vec<u32>> {
                    Ok(t.to_dtype(DType::F32)?
                        .to_vec1::<f32>()?
                        .iter()
                        .map(|f| f.to_bits())
                        .collect())
                };
                assert_eq!(
                    bits(&to_dtype(&x, to)?)?,
                    bits(&x.to_dtype(to)?)?,
                    "{from:?} -> {to:?}"
                );
                let strided = x.reshape((4, 25_002))?.t()?;
                assert_eq!(
                    bits(&to_dtype(&strided, to)?.t()?.flatten_all()?)?,
                    bits(&x.to_dtype(to)?)?,
                    "strided {from:?} -> {to:?}"
                );
            }
        }
        let w = Var::from_tensor(&Tensor::new(&[1.5f32, -2.0, 3.0], &dev)?)?;
        let h = to_dtype(&w, DType::BF16)?;
        assert_eq!(h.dtype(), DType::BF16);
        let weights = Tensor::new(&[1f32, 2., 3.], &dev)?.to_dtype(DType::BF16)?;
        let grads = (h * weights)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(&w).unwrap();
        assert_eq!(g.dtype(), DType::F32);
        assert_eq!(g.to_vec1::<f32>()?, [1., 2., 3.]);
        Ok(())
    }
}
