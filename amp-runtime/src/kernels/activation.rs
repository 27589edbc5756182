//! The smooth activations on CPU, GELU (the tanh approximation, candle's `gelu` and PyTorch's
//! `approximate="tanh"`; the erf form, candle's `gelu_erf` and PyTorch's default) and SiLU, as one
//! op each with a one-pass backward.
//!
//! candle computes them on half tensors in half arithmetic, rounding after every step of the
//! formula (its bf16 `gelu` is `0.5 * v * (1 + tanh(..))` on `bf16` values), and differentiates
//! them through compositions of element-wise ops (eight to ten for GELU), each a full pass over
//! the tensor and a fresh buffer, in the tensor's dtype: in a bf16 transformer block that
//! backward was the largest single cost of the training step. Here the input is read as it is,
//! widened to f32 16 values at a time, the value or the slope computed in f32 and rounded once,
//! as PyTorch's CPU kernels do for half tensors; the backward reads the saved input and the
//! gradient in one pass.

use candle_core::{CpuStorage, CustomOp1, CustomOp2, Layout, Result, Shape, Tensor, WithDType};

use super::zip_map;

/// `sqrt(2 / pi)`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// `1 / sqrt(2 pi)`.
const INV_SQRT_2PI: f32 = 0.398_942_3;
/// The cubic coefficient of the tanh approximation.
const CUBIC: f32 = 0.044_715;

/// GELU, tanh approximation: through this op for a float tensor on CPU, candle's elsewhere.
pub(crate) fn gelu(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Tanh)
}

/// GELU, erf form: through this op for a float tensor on CPU, candle's elsewhere.
pub(crate) fn gelu_erf(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Erf)
}

/// SiLU, `x * sigmoid(x)`: through this op for a float tensor on CPU, candle's elsewhere.
pub(crate) fn silu(x: &Tensor) -> Result<Tensor> {
    apply(x, Form::Silu)
}

fn apply(x: &Tensor, form: Form) -> Result<Tensor> {
    if super::cpu_float(x) {
        x.contiguous()?.apply_op1(Activation(form))
    } else {
        match form {
            Form::Tanh => x.gelu(),
            Form::Erf => x.gelu_erf(),
            Form::Silu => x.silu(),
        }
    }
}

/// Which activation.
#[derive(Clone, Copy, Debug)]
enum Form {
    /// GELU, `0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))`.
    Tanh,
    /// GELU, `0.5 x (1 + erf(x / sqrt(2)))`.
    Erf,
    /// SiLU, `x / (1 + exp(-x))`.
    Silu,
}

impl Form {
    fn value(self, x: f32) -> f32 {
        match self {
            Self::Tanh => 0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (1.0 + CUBIC * x * x)).tanh()),
            Self::Erf => {
                0.5 * x
                    * (1.0 + candle_core::cpu::erf::erf_f32(x * std::f32::consts::FRAC_1_SQRT_2))
            }
            Self::Silu => x / (1.0 + (-x).exp()),
        }
    }

    /// `d value / dx`.
    fn slope(self, x: f32) -> f32 {
        match self {
            Self::Tanh => {
                let t = (SQRT_2_OVER_PI * x * (1.0 + CUBIC * x * x)).tanh();
                let du = SQRT_2_OVER_PI * (1.0 + 3.0 * CUBIC * x * x);
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
            }
            Self::Erf => {
                let cdf = 0.5
                    * (1.0 + candle_core::cpu::erf::erf_f32(x * std::f32::consts::FRAC_1_SQRT_2));
                cdf + x * INV_SQRT_2PI * (-0.5 * x * x).exp()
            }
            Self::Silu => {
                let s = 1.0 / (1.0 + (-x).exp());
                s * (1.0 + x * (1.0 - s))
            }
        }
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
            zip_map(x, x, |v, _| form.value(v))
        ));
        Ok((out, l.shape().clone()))
    }

    fn bwd(&self, arg: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(arg.apply_op2_no_bwd(
            &grad.contiguous()?,
            &ActivationGrad(self.0),
        )?))
    }
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
            WithDType::to_cpu_storage_owned(zip_map(x, g, |x, g| g * form.slope(x)))
        });
        Ok((out, l1.shape().clone()))
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
                let t = (c * (x + 0.044_715 * x * x * x)).tanh();
                let du = c * (1.0 + 3.0 * 0.044_715 * x * x);
                (
                    0.5 * x * (1.0 + t),
                    0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
                )
            }
            Form::Erf => {
                let cdf = 0.5 * (1.0 + candle_core::cpu::erf::erf_f64(x / 2f64.sqrt()));
                let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
                (x * cdf, cdf + x * pdf)
            }
            Form::Silu => {
                let s = 1.0 / (1.0 + (-x).exp());
                (x * s, s * (1.0 + x * (1.0 - s)))
            }
        }
    }

    /// Values and gradients in every dtype against the f64 formulas on the same (rounded)
    /// inputs: within f32 rounding for f32, half an ulp of the half type plus that for f16 and
    /// bf16 (computed in f32, rounded once); and the f32 values against candle's own op.
    #[test]
    fn activations_match_f64_formulas_in_every_dtype() -> Result<()> {
        let xs: Vec<f32> = (0..401).map(|i| (i as f32 - 200.0) * 0.03).collect();
        for form in [Form::Tanh, Form::Erf, Form::Silu] {
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
            let x = Tensor::new(xs.as_slice(), &Device::Cpu)?;
            let theirs = match form {
                Form::Tanh => x.gelu()?,
                Form::Erf => x.gelu_erf()?,
                Form::Silu => x.silu()?,
            };
            let diff = (apply(&x, form)? - theirs)?
                .abs()?
                .max_all()?
                .to_scalar::<f32>()?;
            assert!(diff <= 1e-6, "{form:?}: {diff} from candle's f32 op");
        }
        Ok(())
    }
}
