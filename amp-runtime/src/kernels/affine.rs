//! `x * mul + add` on CPU: candle's `affine`, and with it a tensor's `* f64`, `/ f64`, `+ f64`
//! and `- f64`, in and out of regions. One parallel pass; half tensors are widened to f32, and
//! the result is rounded once.
//!
//! candle's CPU `affine` first rounds `mul` and `add` to the tensor's dtype, then computes in
//! that dtype, rounding after the product and again after the sum, on one thread: a bf16
//! attention score scaled by `1 / sqrt(48)` was multiplied by 0.14453125, 0.13% off, and in a
//! bf16 GPT block 256 wide, that scaling (forward, and the same map in its backward) was an
//! eighth of the training step. PyTorch keeps the scalar in f32 and rounds once, as here. An
//! f32 tensor gets candle's arithmetic to the bit (`x * mul + add` in f32, not fused), except
//! that a pure scaling (`add` -0.0) keeps the sign of a zero product, as PyTorch's `x * s` does.
//! A division by a scalar is a quotient of its own ([`div_scalar`]), not a product by the
//! reciprocal.

use crate::kernels::elem::with_floats;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

use crate::kernels::widen::zip_map;

use crate::kernels::elem::Real;

/// `x * mul + add`: through this op for a float tensor on CPU, candle's `affine` elsewhere.
pub(crate) fn affine(x: &Tensor, mul: f64, add: f64) -> Result<Tensor> {
    if crate::kernels::elem::cpu_float(x) {
        x.contiguous()?.apply_op1(Affine { mul, add })
    } else {
        x.affine(mul, add)
    }
}

#[derive(Clone, Copy)]
struct Affine {
    mul: f64,
    add: f64,
}

impl Affine {
    fn values<T: Real + Send + Sync>(self, x: &[T]) -> Vec<T> {
        let (mul, add) = (self.mul as f32, self.add as f32);
        // A pure scaling is written with `add` -0.0, the sum's neutral element: `x * mul`
        // keeps a zero product's sign, as PyTorch's `x * s`; `x + 0.0` (add +0.0) turns -0.0
        // into +0.0, as PyTorch's does.
        if add == 0.0 && add.is_sign_negative() {
            zip_map(x, x, |x, _| x * mul)
        } else {
            zip_map(x, x, |x, _| x * mul + add)
        }
    }
}

/// `x / divisor`, the quotient itself rather than the product by the reciprocal: `1 / 1e-39`
/// is inf in f32, so `1e-39 / 1e-39` became inf (PyTorch: 1), and `x / 3` was off by an ulp
/// for a third of the values. On CPU one op, in f32 and rounded once; elsewhere candle's
/// division by an f32 scalar tensor, on an f32 copy of a half `x`. Its backward is
/// `grad / divisor`, the same map.
pub(crate) fn div_scalar(x: &Tensor, divisor: f64) -> Result<Tensor> {
    if crate::kernels::elem::cpu_float(x) {
        x.contiguous()?.apply_op1(Quotient(divisor))
    } else {
        let wide = crate::kernels::elem::wide(x.dtype());
        let d = Tensor::new(divisor, x.device())?.to_dtype(wide)?;
        x.to_dtype(wide)?.broadcast_div(&d)?.to_dtype(x.dtype())
    }
}

/// `numerator / x` in f32 (an f32 result, PyTorch's fp32-class `rdiv`), the quotient itself:
/// `numerator * (1 / x)` made `1e-39 / 1e-39` inf and was an ulp off for a third of the values.
/// candle's division of the numerator (a scalar) by `x`'s f32 values, with candle's gradient.
pub(crate) fn rdiv_scalar(numerator: f64, x: &Tensor) -> Result<Tensor> {
    let x = crate::kernels::convert::to_dtype(x, candle_core::DType::F32)?;
    Tensor::new(numerator as f32, x.device())?.broadcast_div(&x)
}

#[derive(Clone, Copy)]
struct Quotient(f64);

impl CustomOp1 for Quotient {
    fn name(&self) -> &'static str {
        "amp-div-scalar"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let d = self.0 as f32;
        let out = with_floats!("div_scalar", s, l, |x| WithDType::to_cpu_storage_owned(
            zip_map(x, x, |x, _| x / d)
        ));
        Ok((out, l.shape().clone()))
    }

    /// `grad / divisor` (the op runs on CPU only, and its gradient is on CPU too).
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        grad.contiguous()?.apply_op1_no_bwd(self).map(Some)
    }
}

impl CustomOp1 for Affine {
    fn name(&self) -> &'static str {
        "amp-affine"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let op = *self;
        let out = with_floats!("affine", s, l, |x| WithDType::to_cpu_storage_owned(
            op.values(x)
        ));
        Ok((out, l.shape().clone()))
    }

    /// `grad * mul`, by the same map.
    fn bwd(&self, _arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let scale = Self {
            mul: self.mul,
            add: -0.0,
        };
        let grad = if crate::kernels::elem::cpu_float(grad) {
            grad.contiguous()?.apply_op1_no_bwd(&scale)?
        } else {
            grad.affine(self.mul, -0.0)?
        };
        Ok(Some(grad))
    }
}

/// `x * keep * scale`, `keep` a u8 mask of `x`'s shape (dropout's): through this op for a float
/// tensor on CPU, each kept value scaled in f32 and rounded once, each dropped one multiplied by
/// 0 (NaN stays NaN), and no gradient for the mask; elsewhere candle's ops, as candle-nn's
/// `dropout` computes it but in f32 and rounded once (in a half dtype the scale itself would be
/// rounded: 1 / 0.9 to 1.109375 in bf16).
pub(crate) fn masked_scale(x: &Tensor, keep: &Tensor, scale: f64) -> Result<Tensor> {
    use candle_core::DType;
    if crate::kernels::elem::cpu_float(x) && keep.dtype() == DType::U8 && keep.shape() == x.shape()
    {
        x.contiguous()?
            .apply_op2(&keep.contiguous()?, MaskedScale(scale))
    } else if x.dtype() == DType::F32 {
        x * (keep.to_dtype(DType::F32)? * scale)?
    } else {
        (x.to_dtype(DType::F32)? * (keep.to_dtype(DType::F32)? * scale)?)?.to_dtype(x.dtype())
    }
}

/// `(x, keep) -> x * keep * scale`; its backward is the same map of the gradient.
#[derive(Clone, Copy)]
struct MaskedScale(f64);

impl CustomOp2 for MaskedScale {
    fn name(&self) -> &'static str {
        "amp-masked-scale"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        fn run<T: Real + Send + Sync>(x: &[T], keep: &[u8], scale: f32) -> Vec<T> {
            crate::kernels::parallel::filled(x.len(), MASK_CHUNK, |i, out| {
                let start = i * MASK_CHUNK;
                let (x, keep) = (&x[start..][..out.len()], &keep[start..][..out.len()]);
                // Blocks of one widened run each, so that the mask lines up with the run.
                let blocks = x
                    .chunks(crate::kernels::widen::BLOCK)
                    .zip(keep.chunks(crate::kernels::widen::BLOCK));
                for ((x, keep), out) in blocks.zip(out.chunks_mut(crate::kernels::widen::BLOCK)) {
                    crate::kernels::widen::map_widened(x, out, |x, o| {
                        for ((o, &x), &k) in o.iter_mut().zip(x).zip(keep) {
                            // A dropped value times 0, as PyTorch's `x * mask * scale`: an
                            // infinity or a NaN there still shows as NaN, not as a clean zero.
                            *o = x * if k == 0 { 0.0 } else { scale };
                        }
                    });
                }
            })
        }
        let CpuStorage::U8(keep) = s2 else {
            candle_core::bail!(
                "masked scale kernel: the mask must be u8, got {:?}",
                s2.dtype()
            );
        };
        let keep = crate::kernels::layout::contiguous(keep, l2, "masked scale")?;
        let scale = self.0 as f32;
        let out = with_floats!("masked scale", s1, l1, |x| WithDType::to_cpu_storage_owned(
            run(x, keep, scale)
        ));
        Ok((out, l1.shape().clone()))
    }

    fn bwd(
        &self,
        x: &Tensor,
        keep: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let grad_x = crate::kernels::leaf_grads::wanted(x, || {
            if crate::kernels::elem::cpu_float(grad) {
                grad.contiguous()?.apply_op2_no_bwd(keep, self)
            } else {
                grad * (keep.to_dtype(grad.dtype())? * self.0)?
            }
        })?;
        Ok((grad_x, None))
    }
}

/// Elements per task of [`MaskedScale`].
const MASK_CHUNK: usize = 1 << 14;

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// Inputs spread over several binades, both signs, and zeros of both signs.
    fn inputs() -> Vec<f32> {
        let mut v: Vec<f32> = (0..2000)
            .map(|i| ((i * 7919) % 4001) as f32 / 97.0 - 20.6)
            .collect();
        v.extend([0.0, -0.0, 1.0, 3.0, -1e-3]);
        v
    }

    /// Every value within half an ulp of the tensor's dtype (plus f32 rounding) of the exact
    /// `x * mul + add` of the rounded input, in every float dtype; the gradient of the sum is
    /// `mul` everywhere.
    #[test]
    fn affine_rounds_once_from_the_exact_value_and_differentiates() -> Result<()> {
        let dev = Device::Cpu;
        let mul = 1.0 / 48f64.sqrt();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            // Significant bits of the dtype.
            let bits = match dtype {
                DType::F32 => 24,
                DType::F16 => 11,
                _ => 8,
            };
            for add in [-0.0, 0.0, 0.75] {
                let x = Tensor::new(inputs(), &dev)?.to_dtype(dtype)?;
                let got = affine(&x, mul, add)?;
                assert_eq!(got.dtype(), dtype);
                let xs = x.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                let ys = got.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                for (x, y) in xs.iter().zip(&ys) {
                    let exact = x * mul + add;
                    // Half an ulp at the exact value, plus the f32 roundings before it (of
                    // `mul`, the product and the sum).
                    let binade = exact.abs().max(1e-30).log2().floor() as i32;
                    let f32_error = (2.0 * (x * mul).abs() + exact.abs()) * 2f64.powi(-24);
                    let bound = 2f64.powi(binade - bits) + f32_error + 1e-12;
                    assert!(
                        (y - exact).abs() <= bound,
                        "{dtype:?} {x} * {mul} + {add}: {y}, exact {exact}"
                    );
                }
                if add == 0.0 {
                    // -0.0 * mul keeps its sign (a pure scaling, `add` -0.0); -0.0 * mul + 0.0
                    // is +0.0, as IEEE's sum.
                    let last_zero = ys[xs.len() - 4];
                    assert!(last_zero == 0.0);
                    assert_eq!(last_zero.is_sign_negative(), add.is_sign_negative());
                }
                let var = Var::from_tensor(&x)?;
                let grads = affine(var.as_tensor(), mul, add)?
                    .to_dtype(DType::F32)?
                    .sum_all()?
                    .backward()?;
                let g = grads.get(var.as_tensor()).expect("a gradient");
                assert_eq!(g.dtype(), dtype);
                let want = Tensor::new(mul as f32, &dev)?
                    .to_dtype(dtype)?
                    .to_dtype(DType::F32)?;
                let want = want.to_scalar::<f32>()?;
                for v in g.to_dtype(DType::F32)?.to_vec1::<f32>()? {
                    assert_eq!(v.to_bits(), want.to_bits(), "{dtype:?} gradient");
                }
            }
        }
        Ok(())
    }

    /// Dropout's scaling: kept values times `1 / (1 - p)` in f32, rounded once (candle-nn's
    /// rounds the scale to bf16 first: 1.109375 for 1 / 0.9), dropped ones 0; the gradient is
    /// the same map of the incoming gradient, and the mask gets none.
    #[test]
    fn masked_scale_rounds_once_and_passes_the_gradient_where_kept() -> Result<()> {
        let dev = Device::Cpu;
        let scale = 1.0 / 0.9;
        let mut xs: Vec<f32> = (0..3000).map(|i| (i as f32 * 0.731).sin() * 3.0).collect();
        let keep: Vec<u8> = (0..3000).map(|i| u8::from(i % 7 != 3)).collect();
        // Non-finite values where dropped (index 3) and kept (index 4).
        (xs[3], xs[4]) = (f32::NAN, f32::INFINITY);
        let x = Var::from_tensor(&Tensor::new(xs, &dev)?.to_dtype(DType::BF16)?)?;
        let mask = Tensor::new(keep.clone(), &dev)?;
        let y = masked_scale(x.as_tensor(), &mask, scale)?;
        assert_eq!(y.dtype(), DType::BF16);
        let xv = x.as_tensor().to_vec1::<half::bf16>()?;
        let want: Vec<half::bf16> = xv
            .iter()
            .zip(&keep)
            .map(|(v, &k)| {
                let factor = if k == 0 { 0.0 } else { scale as f32 };
                half::bf16::from_f32(v.to_f32() * factor)
            })
            .collect();
        let got = y.to_vec1::<half::bf16>()?;
        let bits = |v: &[half::bf16]| v.iter().map(|b| b.to_bits()).collect::<Vec<_>>();
        assert!(
            got[3].is_nan() && got[4].is_infinite(),
            "{} {}",
            got[3],
            got[4]
        );
        assert_eq!(bits(&got), bits(&want));
        let candle = candle_nn_like(x.as_tensor(), &mask, scale)?.to_vec1::<half::bf16>()?;
        assert_ne!(bits(&candle), bits(&want), "candle-nn's arithmetic");
        let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads
            .get(x.as_tensor())
            .expect("x's gradient")
            .to_vec1::<half::bf16>()?;
        let one = half::bf16::from_f32(scale as f32);
        for (g, &k) in g.iter().zip(&keep) {
            assert_eq!(g.to_bits(), if k == 0 { 0 } else { one.to_bits() });
        }
        assert!(grads.get(&mask).is_none());
        Ok(())
    }

    /// candle-nn's `dropout` after its random mask: the mask in `x`'s dtype times the scale.
    fn candle_nn_like(x: &Tensor, keep: &Tensor, scale: f64) -> Result<Tensor> {
        x * (keep.to_dtype(x.dtype())?.affine(scale, 0.0))?
    }

    /// A strided input is read in its logical order.
    #[test]
    fn affine_of_a_transposed_view() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::arange(0f32, 6., &dev)?
            .reshape((2, 3))?
            .to_dtype(DType::BF16)?
            .t()?;
        let y = affine(&x, 2.0, 1.0)?
            .to_dtype(DType::F32)?
            .to_vec2::<f32>()?;
        assert_eq!(y, [[1.0, 7.0], [3.0, 9.0], [5.0, 11.0]]);
        Ok(())
    }
}
