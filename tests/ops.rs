//! Every typed op against an f32 reference, in each precision it runs in, on CPU (and, with the
//! `cuda` feature, on the first CUDA device: the `*_cuda` tests, which need a GPU).
//!
//! The reference is the same op in f32 on the *same* values (inputs rounded to the precision
//! under test, then widened), so the difference measures the op's own rounding. Tolerances, as a
//! fraction of the reference's largest magnitude:
//! - `F32`: 1e-6 (same arithmetic);
//! - `F16`: 4e-3 (unit roundoff 2^-11 ≈ 4.9e-4 per rounding, a few roundings per result);
//! - `BF16`: 3e-2 (unit roundoff 2^-8 ≈ 3.9e-3).
//!
//! Composite ops written here (layer/rms norm, smooth L1, BCE with logits, softmax) are checked
//! against hand-computed f64 values instead, so the test does not compare code with itself.

// Exact float equality is intended where the expected value is exactly representable.
#![allow(clippy::float_cmp)]

use candle_amp::nn::loss;
use candle_amp::{fp32, ops, Precision, Tensor, BF16, F16, F32};
use candle_core::{DType, Device, Result};

fn dev() -> Device {
    Device::Cpu
}

fn tolerance<P: Precision>() -> f32 {
    match P::DTYPE {
        DType::F32 => 1e-6,
        DType::F16 => 4e-3,
        _ => 3e-2,
    }
}

/// Asserts `got` (any precision) is within `P`'s tolerance of `reference` (f32).
fn assert_close<P: Precision, Q: Precision>(
    what: &str,
    got: &Tensor<Q>,
    reference: &candle_core::Tensor,
) -> Result<()> {
    assert_eq!(got.dims(), reference.dims(), "{what}: shape");
    let got = got.to_flat_vec::<f32>()?;
    let want = reference.flatten_all()?.to_vec1::<f32>()?;
    let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= tolerance::<P>() * scale,
        "{what} in {}: max error {worst} > {} * {scale}",
        P::NAME,
        tolerance::<P>()
    );
    Ok(())
}

/// A random f32 tensor and its rounding to `P`, widened back: the reference's input.
fn input<P: Precision>(dev: &Device, shape: &[usize]) -> Result<(Tensor<P>, candle_core::Tensor)> {
    let x = Tensor::<F32>::randn(0.0, 1.0, shape, dev)?.cast::<P>()?;
    let reference = x.cast::<F32>()?.into_candle();
    Ok((x, reference))
}

fn positive<P: Precision>(
    dev: &Device,
    shape: &[usize],
) -> Result<(Tensor<P>, candle_core::Tensor)> {
    let x = Tensor::<F32>::rand(0.5, 2.0, shape, dev)?.cast::<P>()?;
    let reference = x.cast::<F32>()?.into_candle();
    Ok((x, reference))
}

fn unary_and_shape_ops<P: Precision>(dev: &Device) -> Result<()> {
    let (x, r) = input::<P>(dev, &[4, 6])?;
    assert_close::<P, P>("relu", &x.relu()?, &r.relu()?)?;
    assert_close::<P, P>("gelu", &x.gelu()?, &r.gelu()?)?;
    assert_close::<P, P>("gelu_erf", &x.gelu_erf()?, &r.gelu_erf()?)?;
    assert_close::<P, P>("silu", &x.silu()?, &r.silu()?)?;
    assert_close::<P, P>("tanh", &x.tanh()?, &r.tanh()?)?;
    assert_close::<P, P>("sigmoid", &x.sigmoid()?, &candle_nn::ops::sigmoid(&r)?)?;
    assert_close::<P, P>("neg", &x.neg()?, &r.neg()?)?;
    assert_close::<P, P>("abs", &x.abs()?, &r.abs()?)?;
    assert_close::<P, P>("affine", &x.affine(2.0, -1.0)?, &r.affine(2.0, -1.0)?)?;
    assert_close::<P, P>("mul scalar", &(&x * 3.0)?, &(&r * 3.0)?)?;
    assert_close::<P, P>("div scalar", &(&x / 4.0)?, &(&r / 4.0)?)?;
    assert_close::<P, P>("sub scalar", &(&x - 1.5)?, &(&r - 1.5)?)?;
    let (p, rp) = positive::<P>(dev, &[4, 6])?;
    assert_close::<P, P>("sqrt", &p.sqrt()?, &rp.sqrt()?)?;

    assert_close::<P, P>("reshape", &x.reshape((6, 4))?, &r.reshape((6, 4))?)?;
    assert_close::<P, P>("transpose", &x.transpose(0, 1)?, &r.transpose(0, 1)?)?;
    assert_close::<P, P>("t", &x.t()?, &r.t()?)?;
    assert_close::<P, P>("narrow", &x.narrow(1, 2, 3)?, &r.narrow(1, 2, 3)?)?;
    let x4 = x.reshape((2, 2, 3, 2))?;
    let r4 = r.reshape((2, 2, 3, 2))?;
    assert_close::<P, P>("flatten", &x4.flatten(1, 2)?, &r4.flatten(1, 2)?)?;
    assert_close::<P, P>("flatten_all", &x4.flatten_all()?, &r4.flatten_all()?)?;
    assert_close::<P, P>("unsqueeze", &x.unsqueeze(0)?, &r.unsqueeze(0)?)?;
    assert_close::<P, P>("squeeze", &x.unsqueeze(0)?.squeeze(0)?, &r)?;
    assert_close::<P, P>("contiguous", &x.t()?.contiguous()?, &r.t()?.contiguous()?)?;
    assert_close::<P, P>(
        "permute",
        &x4.permute((3, 0, 2, 1))?,
        &r4.permute((3, 0, 2, 1))?,
    )?;
    let halves = x.chunk(2, 1)?;
    assert_close::<P, P>("chunk", &halves[1], &r.narrow(1, 3, 3)?)?;
    assert_close::<P, P>(
        "cat",
        &Tensor::cat(&[&x, &x], 0)?,
        &candle_core::Tensor::cat(&[&r, &r], 0)?,
    )?;
    assert_close::<P, P>(
        "stack",
        &Tensor::stack(&[&x, &x], 1)?,
        &candle_core::Tensor::stack(&[&r, &r], 1)?,
    )?;
    assert_close::<P, P>("max_keepdim", &x.max_keepdim(1)?, &r.max_keepdim(1)?)?;
    assert_close::<P, P>("min", &x.min(0)?, &r.min(0)?)?;
    assert_close::<P, P>("max_all", &x.max_all()?, &r.max_all()?)?;
    Ok(())
}

fn binary_ops<P: Precision>(dev: &Device) -> Result<()> {
    let (a, ra) = input::<P>(dev, &[3, 5])?;
    let (b, rb) = positive::<P>(dev, &[3, 5])?;
    let (row, rrow) = positive::<P>(dev, &[1, 5])?;
    assert_close::<P, P>("add", &a.add(&b)?, &ra.add(&rb)?)?;
    assert_close::<P, P>("sub", &(&a - &b)?, &(&ra - &rb)?)?;
    assert_close::<P, P>("mul", &(&a * &b)?, &(&ra * &rb)?)?;
    assert_close::<P, P>("div", &(&a / &b)?, &(&ra / &rb)?)?;
    assert_close::<P, P>("+", &(&a + &b)?, &(&ra + &rb)?)?;
    assert_close::<P, P>(
        "broadcast_add",
        &a.broadcast_add(&row)?,
        &ra.broadcast_add(&rrow)?,
    )?;
    assert_close::<P, P>(
        "broadcast_sub",
        &a.broadcast_sub(&row)?,
        &ra.broadcast_sub(&rrow)?,
    )?;
    assert_close::<P, P>(
        "broadcast_mul",
        &a.broadcast_mul(&row)?,
        &ra.broadcast_mul(&rrow)?,
    )?;
    assert_close::<P, P>(
        "broadcast_div",
        &a.broadcast_div(&row)?,
        &ra.broadcast_div(&rrow)?,
    )?;
    assert_close::<P, P>("maximum", &a.maximum(&b)?, &ra.maximum(&rb)?)?;
    assert_close::<P, P>("minimum", &a.minimum(&b)?, &ra.minimum(&rb)?)?;
    Ok(())
}

fn lower_precision_ops<P: Precision>(dev: &Device) -> Result<()> {
    let (a, ra) = input::<P>(dev, &[8, 16])?;
    let (b, rb) = input::<P>(dev, &[16, 4])?;
    assert_close::<P, P>("matmul", &a.matmul(&b)?, &ra.matmul(&rb)?)?;
    let (batched, rbatched) = input::<P>(dev, &[3, 8, 16])?;
    assert_close::<P, P>(
        "broadcast_matmul",
        &batched.broadcast_matmul(&b)?,
        &rbatched.broadcast_matmul(&rb)?,
    )?;

    let (x1, rx1) = input::<P>(dev, &[2, 4, 10])?;
    let (k1, rk1) = input::<P>(dev, &[6, 4, 3])?;
    assert_close::<P, P>(
        "conv1d",
        &x1.conv1d(&k1, 1, 1, 1, 1)?,
        &rx1.conv1d(&rk1, 1, 1, 1, 1)?,
    )?;
    let (kt1, rkt1) = input::<P>(dev, &[4, 3, 3])?;
    assert_close::<P, P>(
        "conv_transpose1d",
        &x1.conv_transpose1d(&kt1, 0, 0, 2, 1, 1)?,
        &rx1.conv_transpose1d(&rkt1, 0, 0, 2, 1, 1)?,
    )?;

    let (x2, rx2) = input::<P>(dev, &[2, 4, 8, 8])?;
    let (k2, rk2) = input::<P>(dev, &[6, 4, 3, 3])?;
    assert_close::<P, P>(
        "conv2d",
        &x2.conv2d(&k2, 1, 1, 1, 1)?,
        &rx2.conv2d(&rk2, 1, 1, 1, 1)?,
    )?;
    let (kg, rkg) = input::<P>(dev, &[6, 2, 3, 3])?;
    assert_close::<P, P>(
        "conv2d grouped, strided",
        &x2.conv2d(&kg, 1, 2, 1, 2)?,
        &rx2.conv2d(&rkg, 1, 2, 1, 2)?,
    )?;
    let (k11, rk11) = input::<P>(dev, &[6, 4, 1, 1])?;
    assert_close::<P, P>(
        "conv2d 1x1",
        &x2.conv2d(&k11, 0, 1, 1, 1)?,
        &rx2.conv2d(&rk11, 0, 1, 1, 1)?,
    )?;
    let (kt2, rkt2) = input::<P>(dev, &[4, 3, 3, 3])?;
    assert_close::<P, P>(
        "conv_transpose2d",
        &x2.conv_transpose2d(&kt2, 1, 0, 1, 1)?,
        &rx2.conv_transpose2d(&rkt2, 1, 0, 1, 1)?,
    )?;
    assert_close::<P, P>("max_pool2d", &x2.max_pool2d(2)?, &rx2.max_pool2d(2)?)?;
    assert_close::<P, P>("avg_pool2d", &x2.avg_pool2d(2)?, &rx2.avg_pool2d(2)?)?;
    assert_close::<P, P>(
        "max_pool2d_with_stride",
        &x2.max_pool2d_with_stride(3, 2)?,
        &rx2.max_pool2d_with_stride(3, 2)?,
    )?;
    assert_close::<P, P>(
        "avg_pool2d_with_stride",
        &x2.avg_pool2d_with_stride(3, 2)?,
        &rx2.avg_pool2d_with_stride(3, 2)?,
    )?;
    Ok(())
}

/// fp32-class ops from each input precision: f32 output, within `P`'s tolerance of the f32 op.
fn fp32_class_ops<P: Precision>(dev: &Device) -> Result<()> {
    let (x, r) = input::<P>(dev, &[4, 6])?;
    let (p, rp) = positive::<P>(dev, &[4, 6])?;
    let same = |t: &Tensor<F32>| assert_eq!(t.dtype(), DType::F32);
    let s = fp32::sum_keepdim(&x, 1)?;
    same(&s);
    // The sums' references in f64, rounded once: an f32 sum of values that cancel is itself
    // off by more than f32's tolerance of the (small) result.
    let r64 = r.to_dtype(DType::F64)?;
    let f32_of = |t: candle_core::Tensor| t.to_dtype(DType::F32);
    assert_close::<P, F32>("sum_keepdim", &s, &f32_of(r64.sum_keepdim(1)?)?)?;
    assert_close::<P, F32>("sum", &fp32::sum(&x, 0)?, &f32_of(r64.sum(0)?)?)?;
    assert_close::<P, F32>("sum_all", &fp32::sum_all(&x)?, &f32_of(r64.sum_all()?)?)?;
    assert_close::<P, F32>(
        "mean_keepdim",
        &fp32::mean_keepdim(&x, 0)?,
        &f32_of(r64.mean_keepdim(0)?)?,
    )?;
    assert_close::<P, F32>("mean", &fp32::mean(&x, 1)?, &f32_of(r64.mean(1)?)?)?;
    assert_close::<P, F32>("mean_all", &fp32::mean_all(&x)?, &f32_of(r64.mean_all()?)?)?;
    assert_close::<P, F32>("exp", &fp32::exp(&x)?, &r.exp()?)?;
    assert_close::<P, F32>("log", &fp32::log(&p)?, &rp.log()?)?;
    assert_close::<P, F32>("powf", &fp32::powf(&p, 1.5)?, &rp.powf(1.5)?)?;
    assert_close::<P, F32>("pow", &fp32::pow(&p, &p)?, &rp.pow(&rp)?)?;
    assert_close::<P, F32>("recip", &fp32::recip(&p)?, &rp.recip()?)?;
    assert_close::<P, F32>("sqr", &fp32::sqr(&x)?, &r.sqr()?)?;
    assert_close::<P, F32>(
        "log_sum_exp",
        &fp32::log_sum_exp(&x, 1)?,
        &r.log_sum_exp(1)?,
    )?;
    assert_close::<P, F32>("cumsum", &fp32::cumsum(&x, 1)?, &r.cumsum(1)?)?;
    assert_close::<P, F32>(
        "softmax",
        &fp32::softmax(&x, 1)?,
        &candle_nn::ops::softmax(&r, 1)?,
    )?;
    assert_close::<P, F32>(
        "log_softmax",
        &fp32::log_softmax(&x, 1)?,
        &candle_nn::ops::log_softmax(&r, 1)?,
    )?;
    let (t, rt) = input::<P>(dev, &[4, 6])?;
    assert_close::<P, F32>("mse", &fp32::mse(&x, &t)?, &(&r - &rt)?.sqr()?.mean_all()?)?;
    assert_close::<P, F32>("l1", &fp32::l1(&x, &t)?, &(&r - &rt)?.abs()?.mean_all()?)?;
    let ids = candle_core::Tensor::new(&[0u32, 5, 2, 3], dev)?;
    assert_close::<P, F32>(
        "cross_entropy",
        &fp32::cross_entropy(&x, &ids)?,
        &candle_nn::loss::cross_entropy(&r, &ids)?,
    )?;
    Ok(())
}

/// The activations' values and gradients against their f64 formulas on the same (rounded)
/// inputs, through the crate's own ops (on CUDA as well as CPU): computed in f32 and rounded
/// once, so within a few f32 ulps for f32 and one rounding of `P` for the half types. ReLU keeps
/// NaN on every device (candle's CUDA ReLU maps it to 0).
fn activation_values_and_gradients<P: Precision>(dev: &Device) -> Result<()> {
    type Act<P> = fn(&Tensor<P>) -> Result<Tensor<P>>;
    /// The f64 value and slope at x.
    type Formula = fn(f64) -> (f64, f64);
    let forms: [(&str, Act<P>, Formula); 4] = [
        ("gelu", Tensor::gelu, |x| {
            let c = (2.0 / std::f64::consts::PI).sqrt();
            let t = (c * (x + 0.044_715 * x * x * x)).tanh();
            let du = c * (1.0 + 3.0 * 0.044_715 * x * x);
            (
                0.5 * x * (1.0 + t),
                0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du,
            )
        }),
        ("gelu_erf", Tensor::gelu_erf, |x| {
            let cdf = 0.5 * candle_core::cpu::erf::erfc_f64(-x / 2f64.sqrt());
            let pdf = (-0.5 * x * x).exp() / (2.0 * std::f64::consts::PI).sqrt();
            (x * cdf, cdf + x * pdf)
        }),
        ("silu", Tensor::silu, |x| {
            let s = 1.0 / (1.0 + (-x).exp());
            (x * s, s * (1.0 + x * (1.0 - s)))
        }),
        ("relu", Tensor::relu, |x| {
            (x.max(0.0), if x > 0.0 { 1.0 } else { 0.0 })
        }),
    ];
    // Both tails, zero and values near it.
    let xs: Vec<f32> = (0..=96)
        .map(|i| -6.0 + 12.0 * i as f32 / 96.0)
        .chain([1e-3, -1e-3])
        .collect();
    let ws: Vec<f32> = (0..xs.len())
        .map(|i| 0.25 + (i % 7) as f32 * 0.125)
        .collect();
    let x = candle_core::Var::from_tensor(
        &candle_core::Tensor::new(xs.as_slice(), dev)?.to_dtype(P::DTYPE)?,
    )?;
    let w = candle_core::Tensor::new(ws.as_slice(), dev)?;
    let rounded = |t: &candle_core::Tensor| -> Result<Vec<f64>> {
        Ok(t.to_dtype(DType::F32)?
            .to_vec1::<f32>()?
            .into_iter()
            .map(f64::from)
            .collect())
    };
    let (xr, dy) = (rounded(x.as_tensor())?, rounded(&w.to_dtype(P::DTYPE)?)?);
    // One ulp of P (an f32 result a few f32 ulps off may round to either neighbour; f32
    // itself: the tails' exp amplifies its argument's rounding 2|u| times), below P's
    // smallest subnormal the value's underflow, and f32 arithmetic's cancellation where the
    // slope is a small difference of terms near 0.5 (GELU's below -0.5).
    let (rel, tiny) = match P::DTYPE {
        DType::F32 => (1e-5, 1e-40),
        DType::F16 => (2f64.powi(-10), 2f64.powi(-24)),
        _ => (2f64.powi(-7), 1e-38),
    };
    let cancel = 4.0 * f64::from(f32::EPSILON);
    for (name, act, formula) in forms {
        let t = Tensor::<P>::from_candle(x.as_tensor().clone())?;
        let y = act(&t)?;
        assert_eq!(y.dtype(), P::DTYPE, "{name}");
        let loss = (y.cast::<F32>()?.into_candle() * &w)?.sum_all()?;
        let grads = loss.backward()?;
        let dx = grads.get(x.as_tensor()).expect("a gradient for x");
        assert_eq!(dx.dtype(), P::DTYPE, "{name} gradient");
        let (values, dx) = (rounded(y.as_candle())?, rounded(dx)?);
        for i in 0..xr.len() {
            let (v, slope) = formula(xr[i]);
            let g = dy[i] * slope;
            for (what, got, want, terms) in [
                ("value", values[i], v, 0.0),
                ("gradient", dx[i], g, dy[i].abs()),
            ] {
                let tol = rel * want.abs() + cancel * terms + tiny;
                assert!(
                    (got - want).abs() <= tol,
                    "{name} {what} at {}: {got} vs {want} in {}",
                    xr[i],
                    P::NAME
                );
            }
        }
    }
    let nan = Tensor::<F32>::from_candle(candle_core::Tensor::new(&[f32::NAN, 1.0], dev)?)?
        .cast::<P>()?;
    assert!(
        nan.relu()?.to_flat_vec::<f32>()?[0].is_nan(),
        "relu keeps NaN in {}",
        P::NAME
    );
    Ok(())
}

/// SiLU far in its tails: the slope is about 0 below -85 (it was -inf: `x * exp(-x)`
/// overflowed) and 1 far above 0, the values about 0 and `x`.
fn silu_far_tails<P: Precision>(dev: &Device) -> Result<()> {
    let xs = [-90f32, -100.0, -1000.0, 90.0, 200.0];
    let x =
        candle_core::Var::from_tensor(&candle_core::Tensor::new(&xs, dev)?.to_dtype(P::DTYPE)?)?;
    let y = Tensor::<P>::from_candle(x.as_tensor().clone())?.silu()?;
    let grads = y.cast::<F32>()?.into_candle().sum_all()?.backward()?;
    let dx = grads
        .get(x.as_tensor())
        .expect("a gradient for x")
        .to_dtype(DType::F32)?
        .to_vec1::<f32>()?;
    let values = y.cast::<F32>()?.to_vec1::<f32>()?;
    for (i, &x) in xs.iter().enumerate() {
        let (want_value, want_slope) = if x < 0.0 { (0.0, 0.0) } else { (x, 1.0) };
        assert!(
            (values[i] - want_value).abs() <= 1e-30,
            "silu({x}) = {}",
            values[i]
        );
        assert!(
            (dx[i] - want_slope).abs() <= 1e-30,
            "silu'({x}) = {}",
            dx[i]
        );
    }
    Ok(())
}

macro_rules! per_precision {
    ($($name:ident => $check:ident),* $(,)?) => {$(
        mod $name {
            use super::*;
            #[test]
            fn f32() -> Result<()> {
                $check::<F32>(&dev())
            }
            #[test]
            fn f16() -> Result<()> {
                $check::<F16>(&dev())
            }
            #[test]
            fn bf16() -> Result<()> {
                $check::<BF16>(&dev())
            }
            #[cfg(feature = "cuda")]
            #[test]
            fn f32_cuda() -> Result<()> {
                $check::<F32>(&Device::new_cuda(0)?)
            }
            #[cfg(feature = "cuda")]
            #[test]
            fn f16_cuda() -> Result<()> {
                $check::<F16>(&Device::new_cuda(0)?)
            }
            #[cfg(feature = "cuda")]
            #[test]
            fn bf16_cuda() -> Result<()> {
                $check::<BF16>(&Device::new_cuda(0)?)
            }
        }
    )*};
}

per_precision! {
    unary_and_shape => unary_and_shape_ops,
    binary => binary_ops,
    lower_precision => lower_precision_ops,
    fp32_class => fp32_class_ops,
    activations => activation_values_and_gradients,
    silu_tails => silu_far_tails,
}

#[test]
fn f16_sum_of_100000_ones_is_exact() -> Result<()> {
    let ones = Tensor::<F16>::ones(100_000, &dev())?;
    // candle accumulates in f16: 2048 + 1 rounds back to 2048 (candle #3727).
    let naive = ones
        .as_candle()
        .sum_all()?
        .to_dtype(DType::F32)?
        .to_scalar::<f32>()?;
    assert_eq!(naive, 2048.0);
    assert_eq!(fp32::sum_all(&ones)?.to_scalar::<f32>()?, 100_000.0);
    assert_eq!(fp32::mean_all(&ones)?.to_scalar::<f32>()?, 1.0);
    let bf = Tensor::<BF16>::ones(100_000, &dev())?;
    assert_eq!(fp32::sum_all(&bf)?.to_scalar::<f32>()?, 100_000.0);
    Ok(())
}

#[test]
fn from_candle_checks_the_dtype() -> Result<()> {
    let t = candle_core::Tensor::ones(4, DType::F16, &dev())?;
    assert!(Tensor::<F16>::from_candle(t.clone()).is_ok());
    let err = Tensor::<F32>::from_candle(t).unwrap_err().to_string();
    assert!(err.contains("F32") && err.contains("F16"), "{err}");
    assert!(err.contains("use `Tensor<F16>`"), "{err}");
    // Integer tensors: the hint says where they belong, not which float type to pick.
    let ints = candle_core::Tensor::new(&[1u32, 2], &dev())?;
    let err = Tensor::<BF16>::from_candle(ints).unwrap_err().to_string();
    assert!(
        err.contains("got U32")
            && err.contains("keep integer tensors (token ids, masks) as `candle_core::Tensor`"),
        "{err}"
    );
    Ok(())
}

#[test]
fn constructors_and_readback() -> Result<()> {
    let d = dev();
    let x = Tensor::<F16>::new(&[[1f32, 2.], [3., 4.]], &d)?;
    assert_eq!(x.dtype(), DType::F16);
    assert_eq!(x.to_vec2::<f32>()?, vec![vec![1., 2.], vec![3., 4.]]);
    assert_eq!(x.shape().dims(), &[2, 2]);
    assert!(x.device().is_cpu());
    let y = Tensor::<BF16>::from_slice(&[1.5f64, -2.0, 0.25], 3, &d)?;
    assert_eq!(y.to_vec1::<f32>()?, vec![1.5, -2.0, 0.25]);
    let z = Tensor::<F32>::from_vec(vec![1u8, 2, 3, 4, 5, 6], (2, 3), &d)?;
    assert_eq!(z.to_vec2::<f32>()?[1], vec![4., 5., 6.]);
    assert_eq!(
        Tensor::<F16>::full(0.5, (2, 2), &d)?.to_flat_vec::<f32>()?,
        vec![0.5; 4]
    );
    assert_eq!(Tensor::<F32>::zeros(3, &d)?.to_vec1::<f32>()?, vec![0.0; 3]);
    assert_eq!(x.ones_like()?.to_flat_vec::<f32>()?, vec![1.0; 4]);
    assert_eq!(x.zeros_like()?.to_flat_vec::<f32>()?, vec![0.0; 4]);
    let r = Tensor::<BF16>::randn(0.0, 1.0, (64, 64), &d)?;
    let m = r.cast::<F32>()?.mean_all()?.to_scalar::<f32>()?;
    assert!(m.abs() < 0.1, "randn mean {m}");
    let u = Tensor::<F16>::rand(2.0, 3.0, 1000, &d)?.to_vec1::<f32>()?;
    assert!(u.iter().all(|v| (2.0..=3.0).contains(v)));
    assert_eq!(Tensor::<F32>::new(2.5f32, &d)?.to_scalar::<f32>()?, 2.5);
    Ok(())
}

#[test]
fn promotion_casts_to_the_widest_input() -> Result<()> {
    let h = Tensor::<F16>::new(&[1.0f32, 2.0], &dev())?;
    let f = Tensor::<F32>::new(&[0.5f32, 0.25], &dev())?;
    let (a, b) = h.promote_with(&f)?;
    assert_eq!((a.dtype(), b.dtype()), (DType::F32, DType::F32));
    assert_eq!((&a + &b)?.to_vec1::<f32>()?, vec![1.5, 2.25]);
    let (c, d) = h.promote_with(&h)?;
    assert_eq!((c.dtype(), d.dtype()), (DType::F16, DType::F16));
    Ok(())
}

// ---- Hand-computed expectations for the composite fp32-class ops. ----

fn close(got: f32, want: f64, tol: f64) {
    assert!(
        (f64::from(got) - want).abs() <= tol,
        "got {got}, want {want}"
    );
}

#[test]
fn softmax_and_log_softmax_by_hand() -> Result<()> {
    // softmax([0, ln 2, ln 5]) = [1, 2, 5] / 8
    let x = Tensor::<F32>::new(&[[0f32, 2f32.ln(), 5f32.ln()]], &dev())?;
    let s = ops::softmax(&x, 1)?.to_vec2::<f32>()?;
    for (got, want) in s[0].iter().zip([0.125, 0.25, 0.625]) {
        close(*got, want, 1e-6);
    }
    let ls = ops::log_softmax(&x, 1)?.to_vec2::<f32>()?;
    close(ls[0][2], (0.625f64).ln(), 1e-6);
    Ok(())
}

#[test]
fn norms_by_hand() -> Result<()> {
    // x = [1, 2, 3, 4]: mean 2.5, biased var 1.25, rms sqrt(7.5).
    let d = dev();
    let x = Tensor::<F32>::new(&[[1f32, 2., 3., 4.]], &d)?;
    let alpha = Tensor::<F32>::new(&[1f32, 2., 1., 1.], &d)?;
    let beta = Tensor::<F32>::new(&[0f32, 0., 0., 1.], &d)?;
    let eps = 1e-5f64;
    let ln = ops::layer_norm(&x, &alpha, &beta, eps as f32)?.to_vec2::<f32>()?;
    let sd = (1.25 + eps).sqrt();
    let want = [-1.5 / sd, 2.0 * -0.5 / sd, 0.5 / sd, 1.5 / sd + 1.0];
    for (got, want) in ln[0].iter().zip(want) {
        close(*got, want, 1e-5);
    }
    let rms = ops::rms_norm(&x, &alpha, eps as f32)?.to_vec2::<f32>()?;
    let r = (7.5 + eps).sqrt();
    for (got, want) in rms[0].iter().zip([1.0 / r, 4.0 / r, 3.0 / r, 4.0 / r]) {
        close(*got, want, 1e-5);
    }
    // From half inputs the same values come back in f32.
    let ln16 = fp32::layer_norm(&x.cast::<F16>()?, &alpha, Some(&beta), eps)?.to_vec2::<f32>()?;
    close(ln16[0][3], 1.5 / sd + 1.0, 1e-3);
    Ok(())
}

#[test]
fn losses_by_hand() -> Result<()> {
    let d = dev();
    let pred = Tensor::<F32>::new(&[0.0f32, 2.0, -1.0, 0.5], &d)?;
    let target = Tensor::<F32>::new(&[1.0f32, 0.0, 0.0, 1.0], &d)?;
    // diffs: -1, 2, -1, -0.5
    close(
        loss::mse(&pred, &target)?.to_scalar()?,
        (1.0 + 4.0 + 1.0 + 0.25) / 4.0,
        1e-6,
    );
    close(
        loss::l1(&pred, &target)?.to_scalar()?,
        (1.0 + 2.0 + 1.0 + 0.5) / 4.0,
        1e-6,
    );
    // smooth L1, beta 1: |d| >= 1 -> |d| - 0.5; 0.5 -> 0.5 * 0.25
    close(
        loss::smooth_l1(&pred, &target, 1.0)?.to_scalar()?,
        (0.5 + 1.5 + 0.5 + 0.125) / 4.0,
        1e-6,
    );
    close(
        loss::smooth_l1(&pred, &target, 0.0)?.to_scalar()?,
        4.5 / 4.0,
        1e-6,
    );
    assert!(loss::smooth_l1(&pred, &target, -1.0).is_err());
    // BCE with logits, PyTorch: mean(log(1 + e^x) - x t), for large logits stable.
    let bce = |x: f64, t: f64| (1.0 + x.exp()).ln() - x * t;
    let want = [(0.0, 1.0), (2.0, 0.0), (-1.0, 0.0), (0.5, 1.0)]
        .iter()
        .map(|&(x, t)| bce(x, t))
        .sum::<f64>()
        / 4.0;
    close(
        loss::binary_cross_entropy_with_logits(&pred, &target)?.to_scalar()?,
        want,
        1e-6,
    );
    let big = Tensor::<F32>::new(&[100.0f32, -100.0], &d)?;
    let t = Tensor::<F32>::new(&[0.0f32, 1.0], &d)?;
    // log(1 + e^100) - 0 = 100; log(1 + e^-100) + 100 = 100: finite where the naive form is inf.
    close(
        loss::binary_cross_entropy_with_logit(&big, &t)?.to_scalar()?,
        100.0,
        1e-4,
    );
    // Cross-entropy of uniform logits over 4 classes is ln 4; nll picks -logp.
    let logits = Tensor::<F32>::zeros((2, 4), &d)?;
    let ids = candle_core::Tensor::new(&[1u32, 3], &d)?;
    close(
        loss::cross_entropy(&logits, &ids)?.to_scalar()?,
        4f64.ln(),
        1e-6,
    );
    let logp = Tensor::<F32>::new(&[[-0.5f32, -1.0], [-2.0, -0.1]], &d)?;
    let ids = candle_core::Tensor::new(&[1u32, 0], &d)?;
    close(loss::nll(&logp, &ids)?.to_scalar()?, 1.5, 1e-6);
    Ok(())
}

#[test]
fn fp32_class_methods_on_f32() -> Result<()> {
    let x = Tensor::<F32>::new(&[[1f32, 2.], [3., 4.]], &dev())?;
    assert_eq!(x.sum_all()?.to_scalar::<f32>()?, 10.0);
    assert_eq!(
        x.sum_keepdim(1)?.to_vec2::<f32>()?,
        vec![vec![3.], vec![7.]]
    );
    assert_eq!(x.sum(0)?.to_vec1::<f32>()?, vec![4., 6.]);
    assert_eq!(x.mean_all()?.to_scalar::<f32>()?, 2.5);
    assert_eq!(x.mean(1)?.to_vec1::<f32>()?, vec![1.5, 3.5]);
    assert_eq!(x.mean_keepdim(0)?.to_vec2::<f32>()?, vec![vec![2., 3.]]);
    assert_eq!(x.recip()?.to_vec2::<f32>()?[1], vec![1. / 3., 0.25]);
    assert_eq!(x.powf(2.0)?.to_vec2::<f32>()?[1], vec![9., 16.]);
    assert_eq!(x.sqr()?.to_vec2::<f32>()?[1], vec![9., 16.]);
    assert_eq!(x.pow(&x.ones_like()?)?.to_vec2::<f32>()?[0], vec![1., 2.]);
    assert_eq!(x.cumsum(1)?.to_vec2::<f32>()?[1], vec![3., 7.]);
    close(x.exp()?.log()?.sum_all()?.to_scalar()?, 10.0, 1e-5);
    close(
        x.log_sum_exp(1)?.to_vec1::<f32>()?[0],
        (1f64.exp() + 2f64.exp()).ln(),
        1e-6,
    );
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn pow_and_lse_in_region(
    x: &Tensor<F32>,
    y: &Tensor<F32>,
    rows: &Tensor<F32>,
) -> Result<(Tensor<F32>, Tensor<F32>)> {
    Ok((x.pow(y)?, rows.log_sum_exp(1)?))
}

/// `pow` and `log_sum_exp` at the edges where candle's compositions (`exp(y * ln x)`, the shift
/// by an infinite maximum) give NaN: PyTorch's values (`torch.pow`, `torch.logsumexp`), on the
/// typed methods, the `fp32::` functions and in a region; and `pow`'s gradient at a negative
/// base, `y * x^(y - 1)`.
#[test]
fn pow_and_log_sum_exp_match_pytorch_at_the_edges() -> Result<()> {
    let nan = f32::NAN;
    let x = [-2f32, -3., -2., 0., 0., 0., 2., nan, 1., -2., 4.];
    let y = [3f32, 2., 0.5, 0., 2., -1., 0.5, 0., nan, -1., -0.5];
    let want = [
        -8f32,
        9.,
        nan,
        1.,
        0.,
        f32::INFINITY,
        2f32.sqrt(),
        1.,
        1.,
        -0.5,
        0.5,
    ];
    let same = |got: &[f32]| {
        got.iter()
            .zip(&want)
            .all(|(g, w)| g == w || (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * w.abs())
    };
    let (xt, yt) = (
        Tensor::<F32>::new(&x, &dev())?,
        Tensor::<F32>::new(&y, &dev())?,
    );
    let rows = Tensor::<F32>::new(
        &[
            [f32::NEG_INFINITY, f32::NEG_INFINITY],
            [f32::INFINITY, 1.],
            [1., 2.],
        ],
        &dev(),
    )?;
    let lse_want = [
        f32::NEG_INFINITY,
        f32::INFINITY,
        (1f32.exp() + 2f32.exp()).ln(),
    ];
    let (region_pow, region_lse) = pow_and_lse_in_region(&xt, &yt, &rows)?;
    for (how, got) in [
        ("method", xt.pow(&yt)?),
        ("fp32::pow", fp32::pow(&xt, &yt)?),
        ("fp32::broadcast_pow", fp32::broadcast_pow(&xt, &yt)?),
        ("region", region_pow),
    ] {
        let got = got.to_vec1::<f32>()?;
        assert!(same(&got), "{how}: {got:?} vs {want:?}");
    }
    for (how, got) in [
        ("method", rows.log_sum_exp(1)?),
        ("fp32::log_sum_exp", fp32::log_sum_exp(&rows, 1)?),
        ("region", region_lse),
    ] {
        let got = got.to_vec1::<f32>()?;
        assert_eq!(got[..2], lse_want[..2], "{how}");
        assert!((got[2] - lse_want[2]).abs() < 1e-6, "{how}: {got:?}");
    }
    // d/dx x^3 at -2 is 12, d/dx x^2 at -3 is -6.
    let base = candle_core::Var::new(&[-2f32, -3.], &dev())?;
    let exponent = candle_core::Tensor::new(&[3f32, 2.], &dev())?;
    let grads = fp32::pow(
        &Tensor::<F32>::from_candle(base.as_tensor().clone())?,
        &Tensor::<F32>::from_candle(exponent)?,
    )?
    .as_candle()
    .sum_all()?
    .backward()?;
    let dx = grads.get(&base).expect("a gradient").to_vec1::<f32>()?;
    assert!(
        (dx[0] - 12.0).abs() < 1e-5 && (dx[1] + 6.0).abs() < 1e-5,
        "{dx:?}"
    );
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn extrema_in_region(x: &Tensor<F32>, y: &Tensor<F32>) -> Result<Vec<Vec<f32>>> {
    Ok(vec![
        x.max_all()?.reshape(1)?.to_vec1::<f32>()?,
        x.min_all()?.reshape(1)?.to_vec1::<f32>()?,
        x.max(0)?.to_vec1::<f32>()?,
        x.min_keepdim(0)?.flatten_all()?.to_vec1::<f32>()?,
        x.maximum(y)?.flatten_all()?.to_vec1::<f32>()?,
        x.broadcast_minimum(y)?.flatten_all()?.to_vec1::<f32>()?,
        x.argmax(0)?.to_dtype(DType::F32)?.to_vec1::<f32>()?,
    ])
}

/// Maxima and minima propagate NaN, as PyTorch's (candle's `>` never picks a NaN: the maximum
/// of `[1, NaN, 0]` was 1), and `argmax` points at the first NaN; typed and in a region.
#[test]
fn extrema_propagate_nan_as_pytorch() -> Result<()> {
    let nan = f32::NAN;
    let x = Tensor::<F32>::new(&[[1f32, nan], [nan, 5.0], [0.0, 2.0]], &dev())?;
    let y = Tensor::<F32>::new(&[[2f32, 1.0], [1.0, 1.0], [nan, 1.0]], &dev())?;
    let same = |a: &[f32], b: &[f32]| {
        a.len() == b.len()
            && a.iter()
                .zip(b)
                .all(|(a, b)| a == b || (a.is_nan() && b.is_nan()))
    };
    let want: Vec<Vec<f32>> = vec![
        vec![nan],
        vec![nan],
        vec![nan, nan],
        vec![nan, nan],
        vec![2.0, nan, nan, 5.0, nan, 2.0],
        vec![1.0, nan, nan, 1.0, nan, 1.0],
        vec![1.0, 0.0],
    ];
    let typed: Vec<Vec<f32>> = vec![
        x.max_all()?.reshape(1)?.to_vec1()?,
        x.min_all()?.reshape(1)?.to_vec1()?,
        x.max(0)?.to_vec1()?,
        x.min_keepdim(0)?.flatten_all()?.to_vec1()?,
        x.maximum(&y)?.flatten_all()?.to_vec1()?,
        x.broadcast_minimum(&y)?.flatten_all()?.to_vec1()?,
        x.argmax(0)?.to_dtype(DType::F32)?.to_vec1()?,
    ];
    for (how, got) in [("typed", typed), ("region", extrema_in_region(&x, &y)?)] {
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(same(g, w), "{how} {i}: {g:?} vs {w:?}");
        }
    }
    // Without NaN, candle's values; the gradient of a maximum still reaches its argument.
    let v = candle_core::Var::new(&[3f32, 1.0, 2.0], &dev())?;
    let grads = Tensor::<F32>::from_candle(v.as_tensor().clone())?
        .max_all()?
        .into_candle()
        .backward()?;
    let g = grads.get(&v).expect("a gradient").to_vec1::<f32>()?;
    assert_eq!(g, [1.0, 0.0, 0.0]);
    Ok(())
}

/// The gradient of an extremum is PyTorch's: tied elements share it evenly (`torch.amax`;
/// candle gave each tie the whole gradient, `k` times it in all), a slice holding a NaN gets NaN
/// throughout (`torch.amax`; candle gave none), and an elementwise maximum passes it to both
/// operands where either is NaN (`torch.maximum`). Reference: torch 2.15 on the same inputs.
#[test]
fn extrema_share_their_gradient_as_pytorch() -> Result<()> {
    type Loss = fn(&Tensor<F32>) -> Result<candle_core::Tensor>;
    let nan = f32::NAN;
    let rows = [[1f32, 3., 3.], [2., nan, nan], [-0.0, 0.0, -1.0]];
    let same = |got: &[f32], want: &[f32]| {
        got.len() == want.len()
            && got
                .iter()
                .zip(want)
                .all(|(g, w)| (g.is_nan() && w.is_nan()) || g == w)
    };
    // (what, the loss of the typed tensor, then in a bf16 region, PyTorch's gradient)
    let cases: [(&str, Loss, Loss, [f32; 9]); 4] = [
        (
            "max over dim 1",
            |x| x.max(1)?.into_candle().sum_all(),
            |x| region_extremum(x, 0),
            [0., 0.5, 0.5, nan, nan, nan, 0.5, 0.5, 0.],
        ),
        (
            "min over dim 1, kept",
            |x| x.min_keepdim(1)?.into_candle().sum_all(),
            |x| region_extremum(x, 1),
            [1., 0., 0., nan, nan, nan, 0., 0., 1.],
        ),
        (
            "max of all",
            |x| Ok(x.max_all()?.into_candle()),
            |x| region_extremum(x, 2),
            [nan; 9],
        ),
        (
            "min over dim 0",
            |x| x.min(0)?.into_candle().sum_all(),
            |x| region_extremum(x, 3),
            [0., nan, nan, 0., nan, nan, 1., nan, nan],
        ),
    ];
    for (what, typed, region, want) in cases {
        for (how, loss) in [("typed", typed), ("region", region)] {
            let x = candle_core::Var::new(&rows, &dev())?;
            let grads = loss(&Tensor::from_candle(x.as_tensor().clone())?)?.backward()?;
            let got = grads.get(&x).expect("a gradient").flatten_all()?;
            let got = got.to_vec1::<f32>()?;
            assert!(same(&got, &want), "{what}, {how}: {got:?} vs {want:?}");
        }
    }
    // Without a NaN, the maximum of all shares among its ties; fp16 operands alike (each share
    // 1/3 rounded to fp16 once).
    let x = candle_core::Var::new(&[1f32, 3., 3., 3.], &dev())?;
    let x16 = Tensor::<F16>::from_candle(x.as_tensor().to_dtype(DType::F16)?)?;
    let grads = x16.max_all()?.into_candle().backward()?;
    let got = grads.get(&x).expect("a gradient").to_vec1::<f32>()?;
    let third = half::f16::from_f32(1.0 / 3.0).to_f32();
    assert_eq!(got, [0.0, third, third, third]);
    // Elementwise: a tie splits in halves; a NaN passes the gradient to both operands.
    let a = candle_core::Var::new(&[1f32, nan, 2.0], &dev())?;
    let b = candle_core::Var::new(&[1f32, 0.0, nan], &dev())?;
    let (ta, tb) = (
        Tensor::<F32>::from_candle(a.as_tensor().clone())?,
        Tensor::<F32>::from_candle(b.as_tensor().clone())?,
    );
    for (how, y) in [("maximum", ta.maximum(&tb)?), ("minimum", ta.minimum(&tb)?)] {
        let grads = y.into_candle().sum_all()?.backward()?;
        for v in [&a, &b] {
            let got = grads.get(v).expect("a gradient").to_vec1::<f32>()?;
            assert_eq!(got, [0.5, 1.0, 1.0], "{how}");
        }
    }
    Ok(())
}

/// Case `which` of [`extrema_share_their_gradient_as_pytorch`], written in a region.
#[candle_amp::autocast(bf16)]
fn region_extremum(x: &Tensor<F32>, which: usize) -> Result<candle_core::Tensor> {
    let y = match which {
        0 => x.max(1)?.sum_all()?,
        1 => x.min_keepdim(1)?.sum_all()?,
        2 => x.max_all()?,
        _ => x.min(0)?.sum_all()?,
    };
    Ok(y)
}

/// candle's shape and index methods, `clamp`, and scalars on the left, on typed tensors.
#[test]
fn scalars_on_the_left_shapes_and_indexing_as_candle() -> Result<()> {
    let x = Tensor::<F16>::new(&[[1f32, 2.], [4., 8.]], &Device::Cpu)?;
    assert_eq!((1.0 - &x)?.to_vec2::<f32>()?, [[0., -1.], [-3., -7.]]);
    assert_eq!(
        (0.5 + x.clone())?.to_vec2::<f32>()?,
        [[1.5, 2.5], [4.5, 8.5]]
    );
    let twice: Tensor<F16> = (2.0 * &x)?;
    assert_eq!(twice.to_vec2::<f32>()?, [[2., 4.], [8., 16.]]);
    // `s / x` is fp32-class (PyTorch's rdiv): on `Tensor<F32>`.
    let r: Tensor<F32> = (8.0 / &x.cast::<F32>()?)?;
    assert_eq!(r.to_vec2::<f32>()?, [[8., 4.], [2., 1.]]);
    assert_eq!(x.dims2()?, (2, 2));
    assert!(x.dims3().is_err());
    assert_eq!(x.i((1, 0))?.to_scalar::<f32>()?, 4.0);
    assert_eq!(x.i((.., 1))?.to_vec1::<f32>()?, [2., 8.]);
    assert_eq!(x.clamp(1.5, 5.0)?.to_vec2::<f32>()?, [[1.5, 2.], [4., 5.]]);
    Ok(())
}

/// Transposed convolutions of half operands sum in f32 and round once: a bf16 17x17 kernel of
/// ones over a 17x17 image of ones gives 289 taps at the centre (288 in bf16; adding each tap
/// into a bf16 output stops at 256), a 300-tap 1-D one 300; typed and in a region alike.
#[test]
fn half_transposed_convolutions_sum_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let img = Tensor::<F32>::ones((1, 1, 17, 17), &dev)?.cast::<BF16>()?;
    let y = img.conv_transpose2d(&img, 0, 0, 1, 1)?;
    assert_eq!(y.dtype(), DType::BF16);
    assert_eq!(y.to_flat_vec::<f32>()?[16 * 33 + 16], 288.0);
    let line = Tensor::<F32>::ones((1, 1, 300), &dev)?.cast::<BF16>()?;
    assert_eq!(
        line.conv_transpose1d(&line, 0, 0, 1, 1, 1)?
            .to_flat_vec::<f32>()?[299],
        300.0
    );
    assert_eq!(
        routed_transpose(&Tensor::<F32>::ones((1, 1, 300), &dev)?)?,
        300.0
    );
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn routed_transpose(x: &Tensor<F32>) -> Result<f32> {
    let y = x.conv_transpose1d(x, 0, 0, 1, 1, 1)?;
    assert_eq!(y.dtype(), DType::BF16);
    y.to_dtype(DType::F32)?
        .to_vec3::<f32>()
        .map(|v| v[0][0][299])
}

// ---- Cross-entropy with PyTorch's options. ----

/// `F.cross_entropy(x, y, weight, ignore_index, label_smoothing)`, mean reduction, in f64 by
/// hand from PyTorch's definition: both terms over the rows not ignored, divided by the sum of
/// their targets' weights (PyTorch's, except for the one case the test marks).
fn cross_entropy_f64(x: &[[f64; 3]], y: &[i64], w: [f64; 3], ignore: i64, s: f64) -> f64 {
    let (mut nll, mut smooth, mut denom) = (0.0, 0.0, 0.0);
    for (row, &t) in x.iter().zip(y) {
        if t == ignore {
            continue;
        }
        let lse = row.iter().map(|v| v.exp()).sum::<f64>().ln();
        let logp: Vec<f64> = row.iter().map(|v| v - lse).collect();
        let t = usize::try_from(t).unwrap();
        nll += -w[t] * logp[t];
        smooth += -(0..3).map(|c| w[c] * logp[c]).sum::<f64>();
        denom += w[t];
    }
    ((1.0 - s) * nll + s / 3.0 * smooth) / denom
}

#[candle_amp::autocast(bf16)]
fn cross_entropy_with_bf16(
    x: &Tensor<F32>,
    y: &candle_core::Tensor,
    o: &loss::CrossEntropy,
) -> Result<Tensor<F32>> {
    let logits = x.matmul(&x.t()?)?.narrow(1, 0, 3)?; // bf16
    assert_eq!(logits.dtype(), DType::BF16);
    Ok(loss::cross_entropy_with(&logits, y, o)?)
}

#[test]
fn cross_entropy_options_match_pytorchs_definition() -> Result<()> {
    let rows = [
        [0.5, -1.0, 2.0],
        [1.5, 0.25, -0.5],
        [0.0, 3.0, 1.0],
        [-2.0, 0.5, 0.75],
    ];
    let flat: Vec<f32> = rows.iter().flatten().map(|&v| v as f32).collect();
    let x = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(flat, (4, 3), &dev())?)?;
    let ids = [0i64, 2, -100, 1];
    let y = candle_core::Tensor::new(&ids, &dev())?;
    let w = [1.0, 2.0, 0.5];
    let weight = candle_core::Tensor::new(&[1f32, 2.0, 0.5], &dev())?;
    let all = [0i64, 2, 1, 1];
    let y_all = candle_core::Tensor::new(&all, &dev())?;
    let cases = [
        ("plain", &y_all, &all, [1.0; 3], None, 0.0, None),
        ("weights", &y_all, &all, w, Some(weight.clone()), 0.0, None),
        ("ignored", &y, &ids, [1.0; 3], None, 0.0, Some(-100)),
        ("smoothing", &y_all, &all, [1.0; 3], None, 0.1, None),
        (
            "all three",
            &y,
            &ids,
            w,
            Some(weight.clone()),
            0.1,
            Some(-100),
        ),
        // Here PyTorch averages the smoothing term over all four rows, the ignored one too
        // (diluting it by the padding); both terms are over the rows not ignored here.
        (
            "smoothing, ignored",
            &y,
            &ids,
            [1.0; 3],
            None,
            0.1,
            Some(-100),
        ),
    ];
    for (name, target, t, wv, weight, s, ignore) in cases {
        let o = loss::CrossEntropy {
            weight,
            ignore_index: ignore,
            label_smoothing: s,
        };
        let got = loss::cross_entropy_with(&x, target, &o)?.to_scalar::<f32>()?;
        let want = cross_entropy_f64(&rows, t, wv, ignore.unwrap_or(-1), s);
        assert!(
            (f64::from(got) - want).abs() < 1e-6,
            "{name}: {got} vs {want}"
        );
    }
    // No options: the plain loss.
    let plain = loss::cross_entropy(&x, &y_all)?.to_scalar::<f32>()?;
    let with = loss::cross_entropy_with(&x, &y_all, &loss::CrossEntropy::default())?;
    assert_eq!(with.to_scalar::<f32>()?, plain);
    // In a region: fp32-class, f32 from bf16 logits.
    let x8 = Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(
        (0..12).map(|i| i as f32 / 10.0).collect(),
        (3, 4),
        &dev(),
    )?)?;
    let y3 = candle_core::Tensor::new(&[0u32, 2, 1], &dev())?;
    let o = loss::CrossEntropy {
        label_smoothing: 0.2,
        ..Default::default()
    };
    assert_eq!(cross_entropy_with_bf16(&x8, &y3, &o)?.dtype(), DType::F32);
    // Bad arguments are errors naming them.
    let bad = |o: loss::CrossEntropy, y: &candle_core::Tensor| {
        loss::cross_entropy_with(&x, y, &o).unwrap_err().to_string()
    };
    let smoothing = loss::CrossEntropy {
        label_smoothing: 1.5,
        ..Default::default()
    };
    assert!(bad(smoothing, &y_all).contains("label_smoothing"));
    let out_of_range = candle_core::Tensor::new(&[0i64, 3, 1, 1], &dev())?;
    assert!(bad(loss::CrossEntropy::default(), &out_of_range).contains("0..3"));
    let short = loss::CrossEntropy {
        weight: Some(candle_core::Tensor::ones(2, DType::F32, &dev())?),
        ..Default::default()
    };
    assert!(bad(short, &y_all).contains("weight"));
    Ok(())
}

/// The op's gradient of a learned bias against the f64 reference `want`, on split heads and
/// packed, its operands in `P`.
fn learned_mask_gradient<P: Precision>(
    (q, k, v, qkv): (
        &candle_core::Tensor,
        &candle_core::Tensor,
        &candle_core::Tensor,
        &candle_core::Tensor,
    ),
    bias64: &candle_core::Tensor,
    dout: &candle_core::Tensor,
    want: &[f64],
) -> Result<()> {
    let tol = if P::DTYPE == DType::F32 { 1e-5 } else { 0.05 };
    let typed =
        |x: &candle_core::Tensor| Tensor::<F32>::from_candle(x.to_dtype(DType::F32)?)?.cast::<P>();
    for packed in [false, true] {
        let bias = candle_core::Var::from_tensor(&bias64.to_dtype(DType::F32)?)?;
        let options = ops::Attention {
            mask: Some(bias.as_tensor()),
            scale: Some(0.5),
            ..Default::default()
        };
        let y = if packed {
            // (1, t, h, d) back to (1, h, t, d).
            let y = ops::scaled_dot_product_attention_packed(&typed(qkv)?, &options)?;
            y.as_candle().transpose(1, 2)?
        } else {
            let y = ops::scaled_dot_product_attention_with(
                &typed(q)?,
                &typed(k)?,
                &typed(v)?,
                &options,
            )?;
            y.as_candle().clone()
        };
        let dout = dout.to_dtype(y.dtype())?;
        let grads = (y * dout)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let got = grads.get(bias.as_tensor());
        let got = got
            .expect("the mask's gradient")
            .flatten_all()?
            .to_vec1::<f32>()?;
        for (g, w) in got.iter().zip(want) {
            assert!(
                (f64::from(*g) - w).abs() <= tol * (1.0 + w.abs()),
                "{:?} packed {packed}: {g} vs {w}",
                P::DTYPE
            );
        }
    }
    Ok(())
}

/// A float mask that takes a gradient (a learned relative-position bias: T5's, Swin's) gets it,
/// as PyTorch's `attn_mask.grad`: the fused op gave it none without a word, while the composed
/// math (f64) gave one. The reference is the attention written out in f64, by candle's
/// backward; the op runs f32, bf16 and f16 operands, on split heads and packed.
#[test]
fn a_learned_attention_mask_gets_its_gradient() -> Result<()> {
    let (h, t, d) = (2, 5, 4);
    // Values in [-1, 1) from a multiplicative hash: the same on every machine.
    let values = |shape: &[usize], seed: u64| -> Result<candle_core::Tensor> {
        let n: usize = shape.iter().product();
        #[allow(clippy::cast_precision_loss)]
        let v: Vec<f64> = (0..n as u64)
            .map(|i| ((i * 2_654_435_761 + seed * 97) % 1000) as f64 / 500.0 - 1.0)
            .collect();
        candle_core::Tensor::from_vec(v, shape, &dev())
    };
    // One (1, t, 3, h, d) projection: the packed form's input, and q, k, v split from it.
    let qkv = values(&[1, t, 3, h, d], 1)?;
    let part = |i: usize| {
        qkv.narrow(2, i, 1)?
            .squeeze(2)?
            .transpose(1, 2)?
            .contiguous()
    };
    let (q, k, v) = (part(0)?, part(1)?, part(2)?);
    let bias64 = values(&[h, t, t], 2)?;
    let dout = values(&[1, h, t, d], 3)?;
    // The f64 reference: softmax(q k^T / 2 + bias) v, by candle's backward.
    let bias = candle_core::Var::from_tensor(&bias64)?;
    let s = (q.matmul(&k.t()?)? * 0.5)?.broadcast_add(bias.as_tensor())?;
    let y = candle_nn::ops::softmax(&s, candle_core::D::Minus1)?.matmul(&v)?;
    let grads = (y * &dout)?.sum_all()?.backward()?;
    let want = grads.get(bias.as_tensor()).expect("a gradient");
    let want = want.flatten_all()?.to_vec1::<f64>()?;
    let operands = (&q, &k, &v, &qkv);
    learned_mask_gradient::<F32>(operands, &bias64, &dout, &want)?;
    learned_mask_gradient::<BF16>(operands, &bias64, &dout, &want)?;
    learned_mask_gradient::<F16>(operands, &bias64, &dout, &want)
}

/// The rope tables may be typed tensors as well as candle's (a typed model builds them as
/// `Tensor<F32>`; they were rustc's bare "mismatched types"): the same rotation either way.
#[test]
fn rope_takes_typed_or_candle_tables() -> Result<()> {
    let x = Tensor::<F32>::randn(0.0, 1.0, (1, 2, 3, 4), &dev())?;
    let angles = Tensor::<F32>::randn(0.0, 1.0, (3, 2), &dev())?;
    let (cos, sin) = (angles.as_candle().cos()?, angles.as_candle().sin()?);
    let (typed_cos, typed_sin) = (
        Tensor::<F32>::from_candle(cos.clone())?,
        Tensor::<F32>::from_candle(sin.clone())?,
    );
    let candle = ops::rope(&x, &cos, &sin)?.to_flat_vec::<f32>()?;
    let typed = ops::rope(&x, &typed_cos, &typed_sin)?.to_flat_vec::<f32>()?;
    assert_eq!(candle, typed);
    let want = candle_nn::rotary_emb::rope(x.as_candle(), &cos, &sin)?;
    let want = want.flatten_all()?.to_vec1::<f32>()?;
    for (a, b) in candle.iter().zip(&want) {
        assert!((a - b).abs() <= 1e-6, "{a} vs {b}");
    }
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn huber_in_region(x: &Tensor<F32>, delta: f64) -> Result<Tensor<F32>> {
    let eye = candle_core::Tensor::eye(4, DType::F32, &dev())?;
    let h = x.matmul(&eye)?; // bf16
    let target = candle_core::Tensor::zeros((1, 4), DType::F32, &dev())?;
    Ok(candle_nn::loss::huber(&h, &target, delta)?)
}

/// candle-nn's `loss::huber` in a region is the fp32-class loss PyTorch's autocast runs
/// `huber_loss` as: computed in f32 from the bf16 values (it ran in bf16, the mean included,
/// 0.6% off), and a `delta` that is not positive is an error, as PyTorch's.
#[test]
fn huber_runs_in_f32_in_a_region() -> Result<()> {
    let values = [0.3f32, 1.7, -2.9, 0.05];
    let x = Tensor::<F32>::from_vec(values.to_vec(), (1, 4), &dev())?;
    let delta = 1.3;
    // By hand in f64, from the values rounded to bf16 as the matmul leaves them.
    let want: f64 = values
        .iter()
        .map(|&v| {
            let d = f64::from(half::bf16::from_f32(v).to_f32()).abs();
            if d < delta {
                0.5 * d * d
            } else {
                delta * (d - 0.5 * delta)
            }
        })
        .sum::<f64>()
        / 4.0;
    let got = huber_in_region(&x, delta)?;
    assert_eq!(got.dtype(), DType::F32);
    let got = f64::from(got.to_scalar::<f32>()?);
    assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    let typed = candle_amp::loss::huber(&x, &Tensor::<F32>::zeros((1, 4), &dev())?, delta)?;
    assert!(typed.to_scalar::<f32>()? > 0.0);
    for bad in [0.0, -1.0, f64::NAN] {
        let err = huber_in_region(&x, bad)
            .expect_err("delta must be > 0")
            .to_string();
        assert!(err.contains("delta must be finite and > 0"), "{err}");
    }
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn activation_in_region(
    x: &Tensor<F32>,
    act: &candle_nn::Activation,
    sigmoid: bool,
) -> Result<Vec<f32>> {
    let eye = candle_core::Tensor::eye(x.dim(1)?, DType::F32, &dev())?;
    let h = x.matmul(&eye)?; // bf16
    let y = if sigmoid {
        h.sigmoid()?
    } else {
        act.forward(&h)?
    };
    assert_eq!(y.dtype(), DType::BF16);
    Ok(y.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?)
}

/// candle-nn's activations without a kernel of candle-amp's, and `sigmoid`, on bf16 values in a
/// region are computed in f32 and rounded once, PyTorch's values: within half a bf16 ulp of the
/// exact value (candle's half arithmetic rounded after each step, 1 to 2 ulps off).
#[test]
fn half_activations_are_rounded_once() -> Result<()> {
    use candle_nn::Activation;
    type Exact = fn(f64) -> f64;
    #[allow(clippy::cast_precision_loss)]
    let values: Vec<f32> = (0..96).map(|i| (i as f32 - 48.0) / 11.0).collect();
    let x = Tensor::<F32>::from_vec(values.clone(), (1, 96), &dev())?;
    let inputs: Vec<f64> = values
        .iter()
        .map(|&v| f64::from(half::bf16::from_f32(v).to_f32()))
        .collect();
    let cases: [(&str, Activation, Exact); 6] = [
        ("sigmoid", Activation::Sigmoid, |x| 1.0 / (1.0 + (-x).exp())),
        ("hard_sigmoid", Activation::HardSigmoid, |x| {
            ((x + 3.0) / 6.0).clamp(0.0, 1.0)
        }),
        ("swish", Activation::Swish, |x| x / (1.0 + (-x).exp())),
        ("mish", Activation::Mish, |x| x * x.exp().ln_1p().tanh()),
        ("hard_swish", Activation::HardSwish, |x| {
            x * ((x + 3.0) / 6.0).clamp(0.0, 1.0)
        }),
        ("leaky_relu", Activation::LeakyRelu(0.1), |x| {
            if x >= 0.0 {
                x
            } else {
                0.1 * x
            }
        }),
    ];
    let check = |name: &str, got: &[f32], exact: &dyn Fn(f64) -> f64| {
        for (g, &x) in got.iter().zip(&inputs) {
            let want = exact(x);
            // Half a bf16 ulp of the result (8 bits of mantissa), and f32's own error.
            let ulp = if want == 0.0 {
                0.0
            } else {
                2f64.powi(want.abs().log2().floor() as i32 - 7)
            };
            let err = (f64::from(*g) - want).abs();
            assert!(
                err <= 0.5 * ulp + 1e-6 * want.abs() + 1e-30,
                "{name}({x}) = {g}, exact {want}"
            );
        }
    };
    for (name, act, exact) in cases {
        check(name, &activation_in_region(&x, &act, false)?, &exact);
    }
    check(
        "h.sigmoid()",
        &activation_in_region(&x, &Activation::Relu, true)?,
        &|x| 1.0 / (1.0 + (-x).exp()),
    );
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn mean_in_region(x: &Tensor<F16>) -> Result<Tensor<F32>> {
    Ok(x.mean_all()?)
}

/// Sums and means over millions of values keep f32's precision: a cross-entropy over 2^20 rows
/// of four equal logits is `ln 4` (candle's f32 sum made it 1.38663), and the mean of 4e6 f16
/// values of 0.1 is their value (it was 2e-4 to 1.7e-3 off), typed, through `fp32::` and routed.
#[test]
fn large_sums_and_means_keep_f32_precision() -> Result<()> {
    let rows = 1 << 20;
    let logits = Tensor::<F32>::zeros((rows, 4), &dev())?;
    let ids = candle_core::Tensor::zeros(rows, DType::U32, &dev())?;
    let ce = f64::from(loss::cross_entropy(&logits, &ids)?.to_scalar::<f32>()?);
    assert!((ce - 4f64.ln()).abs() <= 1e-6, "{ce}");
    let tenth = half::f16::from_f32(0.1);
    let x = Tensor::<F16>::from_vec(vec![tenth; 4_000_000], 4_000_000, &dev())?;
    let want = f64::from(tenth.to_f32());
    for (what, mean) in [
        ("fp32::mean_all", fp32::mean_all(&x)?),
        ("typed mean_all", x.cast::<F32>()?.mean_all()?),
        (
            "fp32::mean",
            fp32::mean(&x.reshape((2_000, 2_000))?, 1)?.max(0)?,
        ),
    ] {
        let got = f64::from(mean.to_scalar::<f32>()?);
        assert!((got - want).abs() <= 1e-6 * want, "{what}: {got} vs {want}");
    }
    Ok(())
}
