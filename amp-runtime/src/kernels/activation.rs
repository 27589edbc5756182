//! The activations on CPU and CUDA, GELU (the tanh approximation, candle's `gelu` and PyTorch's
//! `approximate="tanh"`; the erf form, candle's `gelu_erf` and PyTorch's default), SiLU and
//! ReLU, as one op each with a one-pass backward.
//!
//! ReLU keeps NaN, as PyTorch does (candle's maps it to 0, which would hide an overflow from the
//! GradScaler and the overflow locator); its gradient passes where the input is positive
//! (PyTorch's `threshold_backward`), one pass where candle's backward is four ops.
//!
//! candle computes them on half tensors in half arithmetic, rounding after every step of the
//! formula (its bf16 `gelu` is `0.5 * v * (1 + tanh(..))` on `bf16` values), and differentiates
//! them through compositions of element-wise ops (eight to ten for GELU), each a full pass over
//! the tensor and a fresh buffer, in the tensor's dtype: in a bf16 transformer block that
//! backward was the largest single cost of the training step. Here the input is read as it is,
//! widened to f32 16 values at a time, the value or the slope computed in f32 and rounded once,
//! as PyTorch's CPU kernels do for half tensors; the backward reads the saved input and the
//! gradient in one pass.

use crate::kernels::elem::with_floats;
use candle_core::{
    CpuStorage, CustomOp1, CustomOp2, DType, Layout, Result, Shape, Tensor, WithDType,
};

use crate::kernels::widen::zip_map;

use crate::kernels::elem::Real;

/// `sqrt(2 / pi)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;
/// The cubic coefficient of the tanh approximation.
const CUBIC: f32 = 0.044_715;

/// GELU, tanh approximation: through this op for a float tensor on CPU or CUDA, candle's elsewhere.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Tanh)
}

/// GELU, erf form: through this op for a float tensor on CPU or CUDA, candle's elsewhere.
pub(crate) fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Erf)
}

/// SiLU, `x * sigmoid(x)`: through this op for a float tensor on CPU or CUDA, candle's elsewhere.
pub(crate) fn silu(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Silu)
}

/// ReLU, NaN kept: through this op for a float tensor on CPU or CUDA, candle's elsewhere.
pub(crate) fn relu(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Relu)
}

/// `grad` where `y = relu(x)` is positive or NaN, 0 elsewhere: ReLU's backward from its output
/// (`y` is positive or NaN exactly where `x` is), as PyTorch's `threshold_backward`, for an op
/// that ends in a ReLU and keeps only its output. CPU or CUDA, f32, f16 or bf16, `y` contiguous.
pub(crate) fn relu_grad_from_output(y: &Tensor, grad: &Tensor) -> Result<Tensor> {
    y.apply_op2_no_bwd(&grad.contiguous()?, &ActivationGrad(Form::Relu))
}

/// Whether the op runs `x`: an f32, f16 or bf16 tensor on CPU, or (feature `cuda`) on CUDA.
fn supported(x: &Tensor) -> bool {
    use crate::kernels::elem::{cpu_float, cuda_float};
    cpu_float(x) || cuda_float(x)
}

/// `form` of `x`: one op for a float tensor on CPU or CUDA, candle's elsewhere.
pub(crate) fn apply(x: &Tensor, form: Form) -> Result<Tensor> {
    if supported(x) {
        x.contiguous()?.apply_op1(Activation(form))
    } else {
        match form {
            Form::Tanh => x.gelu(),
            Form::Erf => x.gelu_erf(),
            Form::Silu => x.silu(),
            Form::Relu => x.relu(),
        }
    }
}

/// `f` of a half `x` computed in f32 and rounded once, as PyTorch computes an activation (in
/// f32, its opmath type); of an f32 or f64 `x` as it is. For the activations without a kernel
/// here (`sigmoid`, candle-nn's `Activation::{Swish, Mish, HardSwish, LeakyRelu, ..}`): candle
/// computes a half one in half arithmetic, rounding after each step (1 to 2 ulps off), and
/// differentiates it there.
pub(crate) fn in_f32(x: &Tensor, f: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
    match x.dtype() {
        DType::F16 | DType::BF16 => {
            let wide = crate::kernels::convert::to_dtype(x, DType::F32)?;
            crate::kernels::convert::to_dtype(&f(&wide)?, x.dtype())
        }
        _ => f(x),
    }
}

/// Which activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Form {
    /// GELU, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Tanh,
    /// GELU, `0.5 x (1 + erf(x / sqrt(2)))`.
    Erf,
    /// SiLU, `x / (1 + exp(-x))`.
    Silu,
    /// ReLU, `max(x, 0)` with NaN kept.
    Relu,
}

impl Form {
    /// The form's code in `activation.cu`.
    #[cfg(feature = "cuda")]
    fn cuda_code(self) -> i32 {
        match self {
            Form::Tanh => 0,
            Form::Erf => 1,
            Form::Silu => 2,
            Form::Relu => 3,
        }
    }

    /// The activation of every element of `x`. Each form gets its own loop, so that the
    /// branch-free formulas below vectorise.
    pub(crate) fn values<T: Real + Send + Sync>(self, x: &[T]) -> Vec<T> {
        match self {
            Self::Tanh => zip_map(x, x, |x, _| 0.5 * x * tanh_sides(gelu_arg(x)).0),
            Self::Erf => zip_map(x, x, |x, _| x * normal_cdf(x)),
            Self::Silu => zip_map(x, x, |x, _| x / (1.0 + exp(-x))),
            // `x < 0` is false for NaN, which passes through.
            Self::Relu => zip_map(x, x, |x, _| if x < 0.0 { 0.0 } else { x }),
        }
    }

    /// `grad * f'(x)` elementwise.
    fn grads<T: Real + Send + Sync>(self, x: &[T], grad: &[T]) -> Vec<T> {
        match self {
            Self::Tanh => zip_map(x, grad, |x, g| {
                let (plus, minus) = tanh_sides(gelu_arg(x));
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * x * x);
                g * (0.5 * plus + 0.5 * x * plus * minus * du)
            }),
            Self::Erf => zip_map(x, grad, |x, g| {
                g * (normal_cdf(x) + x * INV_SQRT_2PI * exp(-0.5 * x * x))
            }),
            Self::Silu => zip_map(x, grad, |x, g| {
                // s = sigmoid(x) and 1 - s = sigmoid(-x), each from its own exp: no
                // cancellation where s is near 1, and no overflow where x is very negative
                // (`x * exp(-x)` was -inf below about -85, the gradient with it).
                let s = 1.0 / (1.0 + exp(-x));
                let one_minus_s = 1.0 / (1.0 + exp(x));
                g * s * (1.0 + x * one_minus_s)
            }),
            // PyTorch's: the gradient passes where the output (NaN here) is not <= 0.
            Self::Relu => zip_map(x, grad, |x, g| if x <= 0.0 { 0.0 } else { g }),
        }
    }
}

/// The argument of the tanh approximation's `tanh`.
#[inline]
fn gelu_arg(x: f32) -> f32 {
    SQRT_2_OVER_PI * x * (1.0 + CUBIC * x * x)
}

/// `e^x` without a branch or a library call, so that element loops vectorise: `2^n * p(r)`
/// with `n` the nearest integer to `x / ln 2`, `r = x - n ln 2` (in two parts, |r| <= ln2 / 2)
/// and `p` the degree-7 Taylor polynomial (truncation below 5e-9 relative), within a few ulp
/// of the exact value, for `x` in [-87, 88], where `2^n` is a normal f32. Outside it, as the
/// library's `expf` (and CUDA's, which the GPU kernels use): 0 below -87 (the exact value is
/// below 1.7e-38, subnormal from -87.34), `e^88` up to 88.72 and infinity above, where f32
/// overflows. So `silu(-inf)` is `-inf / inf`, NaN, as PyTorch's, and not `-inf / 1.6e38`.
/// NaN stays NaN.
#[inline]
pub(crate) fn exp(x: f32) -> f32 {
    /// 1.5 * 2^23: adding and subtracting it rounds an f32 below 2^22 to the nearest integer.
    const ROUND: f32 = 12_582_912.0;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    /// `ROUND`'s bits: an f32 `ROUND + n` has the bits `ROUND_BITS + n` for |n| < 2^22.
    const ROUND_BITS: u32 = 0x4B40_0000;
    /// `ln(f32::MAX)`: `e^x` overflows above it.
    const OVERFLOW: f32 = 88.722_84;
    let given = x;
    let x = x.clamp(-87.0, 88.0);
    let shifted = x * std::f32::consts::LOG2_E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r / 5040.0))))));
    // `n` is an integer in [-126, 127]: 2^n is the normal f32 with biased exponent n + 127,
    // which integer arithmetic on `shifted`'s bits gives without a float-to-int conversion (a
    // saturating `as i32` does not vectorise: it cost a scalar conversion and an insert per
    // element). For NaN the bits are garbage and `p` is NaN, so the product is NaN.
    let biased = shifted.to_bits().wrapping_sub(ROUND_BITS).wrapping_add(127);
    let value = p * f32::from_bits(biased << 23);
    // Selects, not branches: the loops still vectorise.
    let value = if given < -87.0 { 0.0 } else { value };
    if given > OVERFLOW {
        f32::INFINITY
    } else {
        value
    }
}

/// `(1 + tanh u, 1 - tanh u)`, each without cancellation: with `e = exp(-2|u|)` they are
/// `2 / (1 + e)` and `2 e / (1 + e)`, the smaller one on the side of `u`'s sign. GELU's
/// negative tail and its slope are such small differences.
#[inline]
fn tanh_sides(u: f32) -> (f32, f32) {
    let e = exp(-2.0 * u.abs());
    let d = 1.0 / (1.0 + e);
    let (large, small) = (2.0 * d, 2.0 * e * d);
    if u < 0.0 {
        (small, large)
    } else {
        (large, small)
    }
}

/// The standard normal CDF `0.5 erfc(-x / sqrt(2))`, with `erfc` of Numerical Recipes'
/// Chebyshev fit (relative error below 1.2e-7 for every argument), so the negative tail keeps
/// its relative accuracy.
#[inline]
fn normal_cdf(x: f32) -> f32 {
    let z = (x * std::f32::consts::FRAC_1_SQRT_2).abs();
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -1.265_512_2
        + t * (1.000_023_7
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_204
                                + t * (1.488_515_9 + t * (-0.822_152_2 + t * 0.170_872_77))))))));
    let half_erfc = 0.5 * t * exp(poly - z * z);
    if x < 0.0 {
        half_erfc
    } else {
        1.0 - half_erfc
    }
}

struct Activation(Form);

impl CustomOp1 for Activation {
    fn name(&self) -> &'static str {
        "amp-activation"
    }

    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> Result<(CpuStorage, Shape)> {
        let form = self.0;
        let out = with_floats!("activation", s, l, |x| WithDType::to_cpu_storage_owned(
            form.values(x)
        ));
        Ok((out, l.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        l: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::activation::run(self.0.cuda_code(), s, l, None)
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(input_grad(arg, grad, self.0)?))
    }
}

/// `grad * f'(x)`, elementwise, for `x` and `grad` of one float dtype on CPU or CUDA (`x` the
/// activation's input): the backward of [`apply`], for an op that keeps the input itself.
pub(crate) fn input_grad(x: &Tensor, grad: &Tensor, form: Form) -> Result<Tensor> {
    x.contiguous()?
        .apply_op2_no_bwd(&grad.contiguous()?, &ActivationGrad(form))
}

/// `(x, grad) -> grad * f'(x)`.
struct ActivationGrad(Form);

impl CustomOp2 for ActivationGrad {
    fn name(&self) -> &'static str {
        "amp-activation-grad"
    }

    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let form = self.0;
        let out = with_floats!("activation grad", s1, l1, s2, l2, |x, g| {
            WithDType::to_cpu_storage_owned(form.grads(x, g))
        });
        Ok((out, l1.shape().clone()))
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        crate::kernels::cuda::activation::run(self.0.cuda_code(), s1, l1, Some((s2, l2)))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};

    use super::*;

    /// The f64 activation and its slope, from the formulas, for the reference.
    fn reference(form: Form, x: f64) -> (f64, f64) {
        match form {
            Form::Tanh => {
                let c = (2.0 / std::f64::consts::PI).sqrt();
                // 1 + tanh u and 1 - tanh u in forms that do not cancel in the tails.
                let u = c * (x + 0.044_715 * x * x * x);
                let (plus, minus) = (
                    2.0 / (1.0 + (-2.0 * u).exp()),
                    2.0 / (1.0 + (2.0 * u).exp()),
                );
                let du = c * (1.0 + 3.0 * 0.044_715 * x * x);
                (0.5 * x * plus, 0.5 * plus + 0.5 * x * plus * minus * du)
            }
            Form::Erf => {
                let cdf = 0.5 * candle_core::cpu::erf::erfc_f64(-x / 2f64.sqrt());
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (x * cdf, cdf + x * pdf)
            }
            Form::Silu => {
                let s = 1.0 / (1.0 + (-x).exp());
                (x * s, s * (1.0 + x * (1.0 - s)))
            }
            Form::Relu => (x.max(0.0), if x > 0.0 { 1.0 } else { 0.0 }),
        }
    }

    /// Values and gradients in every dtype against the f64 formulas on the same (rounded)
    /// inputs: within f32 rounding for f32, half an ulp of the half type plus that for f16 and
    /// bf16 (computed in f32, rounded once); and the f32 values against candle's own op.
    #[test]
    fn activations_match_f64_formulas_in_every_dtype() -> Result<()> {
        let xs: Vec<f32> = (0..401).map(|i| (i as f32 - 200.0) * 0.03).collect();
        for form in [Form::Tanh, Form::Erf, Form::Silu, Form::Relu] {
            for dtype in [DType::F32, DType::F16, DType::BF16] {
                let x = Tensor::new(xs.as_slice(), &Device::Cpu)?.to_dtype(dtype)?;
                let v = Var::from_tensor(&x)?;
                let y = apply(&v, form)?;
                assert_eq!(y.dtype(), dtype);
                let w = Tensor::new(&[1.5f32], &Device::Cpu)?
                    .to_dtype(dtype)?
                    .broadcast_as(x.shape())?;
                let grads = (&y * &w)?.sum_all()?.backward()?;
                let g = grads.get(&v).expect("gradient of x");
                let rel = match dtype {
                    DType::F32 => 2e-6,
                    DType::F16 => 1e-3,
                    _ => 8e-3,
                };
                let x64 = x.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                let y64 = y.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                let g64 = g.to_dtype(DType::F64)?.to_vec1::<f64>()?;
                for ((&x, &y), &g) in x64.iter().zip(&y64).zip(&g64) {
                    let (want_y, want_s) = reference(form, x);
                    let want_g = 1.5 * want_s;
                    assert!(
                        (y - want_y).abs() <= rel * want_y.abs() + 1e-6,
                        "{form:?} {dtype:?} f({x}) = {y}, want {want_y}"
                    );
                    assert!(
                        (g - want_g).abs() <= rel * want_g.abs() + 1e-6,
                        "{form:?} {dtype:?} f'({x}) * 1.5 = {g}, want {want_g}"
                    );
                }
            }
            // The negative tails, where the values are small differences: relative accuracy
            // (within 1e-4: the f32 inputs alone, amplified by the exponential, account for up
            // to 2e-5 at x = -8; a cancelling formula is wrong by 100% or more there).
            let tail: Vec<f32> = (0..50).map(|i| -3.0 - i as f32 * 0.1).collect();
            let x = Var::new(tail.as_slice(), &Device::Cpu)?;
            let y = apply(&x, form)?;
            let g = y.sum_all()?.backward()?;
            let g = g.get(&x).expect("gradient of x").to_vec1::<f32>()?;
            for ((&x, y), g) in tail.iter().zip(y.to_vec1::<f32>()?).zip(g) {
                let (want_y, want_g) = reference(form, f64::from(x));
                let close =
                    |got: f32, want: f64| (f64::from(got) - want).abs() <= 1e-4 * want.abs();
                assert!(
                    close(y, want_y),
                    "{form:?} tail f({x}) = {y}, want {want_y}"
                );
                assert!(
                    close(g, want_g),
                    "{form:?} tail f'({x}) = {g}, want {want_g}"
                );
            }
            // NaN stays NaN; far out, the limits.
            let far = Tensor::new(&[f32::NAN, 100.0, -100.0], &Device::Cpu)?;
            let y = apply(&far, form)?.to_vec1::<f32>()?;
            assert!(y[0].is_nan(), "{form:?}: {y:?}");
            assert!(
                (y[1] - 100.0).abs() < 1e-4 && y[2].abs() < 1e-30,
                "{form:?}: {y:?}"
            );
            let x = Tensor::new(xs.as_slice(), &Device::Cpu)?;
            let theirs = match form {
                Form::Tanh => x.gelu()?,
                Form::Erf => x.gelu_erf()?,
                Form::Silu => x.silu()?,
                Form::Relu => x.relu()?,
            };
            let diff = (apply(&x, form)? - theirs)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "{form:?}: {diff} from candle's f32 op");
        }
        Ok(())
    }

    /// The branch-free `exp` over its whole range (every 1/1024 from -87 to 88): within 4 ulp
    /// of the exact value; NaN stays NaN, the clamped ends give the normal extremes.
    #[test]
    fn exp_is_within_a_few_ulp_and_keeps_nan() {
        for i in -87 * 1024..=88 * 1024 {
            let x = i as f32 / 1024.0;
            let (got, want) = (exp(x), f64::from(x).exp());
            let ulp = f64::from(f32::from_bits((want as f32).to_bits() + 1) - want as f32);
            assert!(
                (f64::from(got) - want).abs() <= 4.0 * ulp,
                "exp({x}) = {got}, exact {want}"
            );
        }
        assert!(exp(f32::NAN).is_nan());
        // Beyond f32's normal range, `expf`'s values: 0 and infinity.
        for (x, want) in [
            (-1000.0, 0.0),
            (-87.5, 0.0),
            (f32::NEG_INFINITY, 0.0),
            (88.8, f32::INFINITY),
            (f32::INFINITY, f32::INFINITY),
        ] {
            assert_eq!(exp(x).to_bits(), want.to_bits(), "exp({x})");
        }
        assert!(exp(88.5) > 1e38 && exp(88.5).is_finite());
    }

    /// At the ends of f32, PyTorch's values and gradients (torch 2.15, f32) at `-inf`, `inf`,
    /// -100 and NaN, with one exception: GELU (erf) of `inf` is `inf`, where PyTorch's is NaN.
    #[test]
    fn activations_at_infinities_are_pytorch_s() -> Result<()> {
        let nan = f32::NAN;
        let inf = f32::INFINITY;
        let x = [-inf, inf, -100.0, nan];
        let cases = [
            (Form::Silu, [nan, inf, -0.0, nan], [nan, nan, -0.0, nan]),
            (Form::Erf, [nan, inf, -0.0, nan], [nan, nan, 0.0, nan]),
            (Form::Tanh, [nan, inf, -0.0, nan], [nan, nan, 0.0, nan]),
            (Form::Relu, [0.0, inf, 0.0, nan], [0.0, 1.0, 0.0, 1.0]),
        ];
        let same = |got: &[f32], want: &[f32]| {
            got.iter().zip(want).all(|(g, w)| {
                (g.is_nan() && w.is_nan()) || g.total_cmp(w).is_eq() || g.abs() + w.abs() == 0.0
            })
        };
        for (form, value, grad) in cases {
            let v = Var::new(&x, &Device::Cpu)?;
            let y = apply(&v, form)?;
            let g = y.sum_all()?.backward()?.get(&v).unwrap().to_vec1::<f32>()?;
            let y = y.to_vec1::<f32>()?;
            assert!(same(&y, &value), "{form:?}: {y:?} vs {value:?}");
            assert!(same(&g, &grad), "{form:?} gradient: {g:?} vs {grad:?}");
        }
        Ok(())
    }

    /// ReLU against candle's in every dtype, gradients exactly; NaN stays NaN (candle's gives 0).
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
