//! `relu` on CPU as one op with a one-pass backward.
//!
//! candle's relu backward builds `grad * (x >= 0)` from four ops (a zeros tensor, a comparison,
//! a dtype conversion and a product), each a full pass and a fresh buffer. This op computes
//! `max(x, 0)` and, backward, `grad` where the result is positive and zero elsewhere, one pass
//! each (PyTorch's `threshold_backward`). A NaN input stays NaN, as in PyTorch (candle's relu
//! maps it to 0, which would hide an overflow from the GradScaler and the overflow locator).

use super::{zip_map, Real};
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

/// `relu` of `x`: through this op for a float tensor on CPU, candle's elsewhere.
pub(crate) fn relu(x: &Tensor) -> Result<Tensor> {
    if super::cpu_float(x) {
        x.contiguous()?.apply_op1(Relu)
    } else {
        x.relu()
    }
}

fn relu_of<T: Real + Send + Sync>(x: &[T]) -> Vec<T> {
    // `x < 0` is false for NaN, which passes through.
    zip_map(x, x, |v, _| if v < 0.0 { 0.0 } else { v })
}

fn relu_grad<T: Real + Send + Sync>(y: &[T], g: &[T]) -> Vec<T> {
    zip_map(y, g, |y, g| if y > 0.0 { g } else { 0.0 })
}

struct Relu;

impl CustomOp1 for Relu {
    fn name(&self) -> &'static str {
        "amp-relu"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let out = with_floats!("relu", s, l, |x| WithDType::to_cpu_storage_owned(relu_of(
            x
        )));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, _arg: &Tensor, res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(res.apply_op2_no_bwd(&grad.contiguous()?, &ReluGrad)?))
    }
}

/// `(result, grad) -> grad where result > 0, else 0`.
struct ReluGrad;

impl CustomOp2 for ReluGrad {
    fn name(&self) -> &'static str {
        "amp-relu-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let out = with_floats!("relu grad", s1, l1, s2, l2, |y, g| {
            WithDType::to_cpu_storage_owned(relu_grad(y, g))
        });
        Ok((out, l1.shape().clone()))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// Values and gradients against candle's relu in every dtype; NaN stays NaN.
    #[test]
    fn relu_matches_candle_and_keeps_nan() -> Result<()> {
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let x = Tensor::new(&[-2f32, -0.5, 0.0, 0.25, 3.0], &Device::Cpu)?.to_dtype(dtype)?;
            let v = Var::from_tensor(&x)?;
            let y = relu(&v)?;
            let w = Tensor::new(&[1f32, 2., 3., 4., 5.], &Device::Cpu)?.to_dtype(dtype)?;
            let grads = (&y * &w)?.sum_all()?.backward()?;
            let want = x.relu()?;
            assert_eq!(
                y.to_dtype(DType::F32)?.to_vec1::<f32>()?,
                want.to_dtype(DType::F32)?.to_vec1::<f32>()?
            );
            // d/dx sum(w * relu(x)) = w where x > 0.
            let g = grads
                .get(&v)
                .unwrap()
                .to_dtype(DType::F32)?
                .to_vec1::<f32>()?;
            assert_eq!(g, [0., 0., 0., 4., 5.], "{dtype:?}");
            let nan = Tensor::new(&[f32::NAN, -1.0], &Device::Cpu)?.to_dtype(dtype)?;
            let r = relu(&nan)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            assert!(r[0].is_nan() && r[1] == 0.0, "{dtype:?}: {r:?}");
        }
        Ok(())
    }
}
