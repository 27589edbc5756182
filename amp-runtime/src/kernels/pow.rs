//! `x ^ y` elementwise on CPU, the values and gradients of PyTorch's `pow` with a tensor
//! exponent.
//!
//! candle's `pow` is `exp(y * ln x)`: NaN for a negative base, `x^0` of 0, inf or NaN not 1,
//! `(-2)^31` 896 off, and its gradient at a zero base NaN (`0 * inf`), so `relu(h)^2` made
//! every gradient NaN and an fp16 scaler skip every step. Here the values are `powf` in f32
//! (IEEE `pow`: `(-2)^3 = -8`, `x^0 = 1`, `(-0)^-1 = -inf`, `(-1)^inf = 1`), rounded once to
//! the operands' dtype; the gradients are PyTorch's formulas: `dx = dy * y * x^(y - 1)`, 0
//! where `y` is 0, and `dy_exp = dy * x^y * ln x`, 0 where `x` is 0 and `y >= 0`.

use candle_core::{CpuStorage, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType};

use crate::kernels::elem::Real;
use crate::kernels::layout::contiguous;
use crate::kernels::widen::zip_map;

/// The op on two float CPU tensors of one shape and dtype; `None` for any other pair (the
/// caller composes candle's ops).
pub(crate) fn pow(x: &Tensor, y: &Tensor) -> Result<Option<Tensor>> {
    let fits =
        crate::kernels::elem::cpu_float(x) && x.dtype() == y.dtype() && x.shape() == y.shape();
    if !fits {
        return Ok(None);
    }
    x.contiguous()?.apply_op2(&y.contiguous()?, Pow).map(Some)
}

/// `x ^ e` for a scalar exponent (candle's `powf`, on any device), its gradient PyTorch's at
/// `e = 0`: 0 everywhere, where candle's `e * x^(e - 1)` is `0 * inf` (NaN) at a zero,
/// subnormal or NaN base. Other exponents keep candle's gradient, which is PyTorch's there.
pub(crate) fn powf(x: &Tensor, e: f64) -> Result<Tensor> {
    if e != 0.0 || !x.dtype().is_float() {
        return x.powf(e);
    }
    let value = x.detach().powf(e)?;
    crate::kernels::custom_grad::with_gradient(x, value, |x, _| x.zeros_like())
}

struct Pow;

impl CustomOp2 for Pow {
    fn name(&self) -> &'static str {
        "amp-pow"
    }

    fn cpu_fwd(
        &self,
        x: &CpuStorage,
        lx: &Layout,
        y: &CpuStorage,
        ly: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Real + Send + Sync>(
            (x, lx): (&[T], &Layout),
            (y, ly): (&[T], &Layout),
        ) -> Result<CpuStorage> {
            let x = contiguous(x, lx, "pow")?;
            let y = contiguous(y, ly, "pow")?;
            Ok(WithDType::to_cpu_storage_owned(zip_map(x, y, f32::powf)))
        }
        let out = match (x, y) {
            (CpuStorage::F32(a), CpuStorage::F32(b)) => run((a, lx), (b, ly))?,
            (CpuStorage::F16(a), CpuStorage::F16(b)) => run((a, lx), (b, ly))?,
            (CpuStorage::BF16(a), CpuStorage::BF16(b)) => run((a, lx), (b, ly))?,
            _ => candle_core::bail!("pow kernel: two f32, f16 or bf16 operands of one dtype"),
        };
        Ok((out, lx.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        y: &Tensor,
        res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let f32s = |t: &Tensor| t.detach().to_dtype(DType::F32);
        let (xf, yf, g) = (f32s(x)?, f32s(y)?, f32s(grad)?);
        let zeros = xf.zeros_like()?;
        let dx = crate::kernels::leaf_grads::wanted(x, || {
            let lower = xf.apply_op2_no_bwd(&(&yf - 1.0)?, &Pow)?;
            let dx = ((&g * &yf)? * lower)?;
            yf.eq(0.0)?.where_cond(&zeros, &dx)?.to_dtype(x.dtype())
        })?;
        let dy = crate::kernels::leaf_grads::wanted(y, || {
            let dy = ((&g * f32s(res)?)? * xf.log()?)?;
            let flat = (xf.eq(0.0)? * yf.ge(0.0)?)?;
            flat.where_cond(&zeros, &dy)?.to_dtype(y.dtype())
        })?;
        Ok((dx, dy))
    }
}
