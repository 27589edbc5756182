//! The GEMM convolution against candle's f32 conv2d and an f64 reference.

use super::*;
use candle_core::{Device, Var};

use crate::kernels::testing::max_abs_diff;

/// Forward and both gradients of every dtype against candle's f32 conv2d on the same
/// (half-representable) values, for 1x1, strided, padded, dilated and grouped shapes.
#[test]
fn gemm_conv2d_matches_candles_f32_conv2d() -> Result<()> {
    // bf16 rounds to 2^-8 relative, f16 to 2^-11; f32 differs only in summation order.
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        conv_cases(dtype, tol)?;
    }
    Ok(())
}

fn conv_cases(dtype: DType, tol: f32) -> Result<()> {
    let pointwise = Conv2dParams {
        padding: 0,
        stride: 1,
        dilation: 1,
        groups: 1,
    };
    for (p, (c_in, c_out), ks) in [
        (pointwise, (5, 7), 1),
        (
            Conv2dParams {
                stride: 2,
                ..pointwise
            },
            (3, 4),
            1,
        ),
        // ResNet's stem: 7x7, stride 2, padding 3.
        (
            Conv2dParams {
                padding: 3,
                stride: 2,
                ..pointwise
            },
            (2, 3),
            7,
        ),
    ] {
        conv_case(dtype, tol, p, c_in, c_out, ks)?;
    }
    for (p, (c_in, c_out)) in [
        (
            Conv2dParams {
                padding: 1,
                stride: 1,
                dilation: 1,
                groups: 1,
            },
            (3, 4),
        ),
        (
            Conv2dParams {
                padding: 0,
                stride: 2,
                dilation: 1,
                groups: 1,
            },
            (3, 5),
        ),
        (
            Conv2dParams {
                padding: 1,
                stride: 2,
                dilation: 1,
                groups: 1,
            },
            (3, 4),
        ),
        (
            Conv2dParams {
                padding: 2,
                stride: 1,
                dilation: 2,
                groups: 1,
            },
            (2, 3),
        ),
        (
            Conv2dParams {
                padding: 1,
                stride: 1,
                dilation: 1,
                groups: 2,
            },
            (4, 6),
        ),
    ] {
        conv_case(dtype, tol, p, c_in, c_out, 3)?;
    }
    // 40 images of 4x4 (16 pixels): several images per GEMM, in two chunks.
    let padded = Conv2dParams {
        padding: 1,
        ..pointwise
    };
    conv_case_sized(dtype, tol, padded, (3, 5, 3), (40, 4))?;
    // A 1x1 image under a dilated 3x3 kernel padded by 2: kernel columns whose every output
    // reads padding only (their run of inside columns is empty).
    let dilated = Conv2dParams {
        padding: 2,
        dilation: 2,
        ..pointwise
    };
    conv_case_sized(dtype, tol, dilated, (1, 1, 3), (1, 1))?;
    Ok(())
}

/// One shape, without and with a bias (the bias gradient checked too).
fn conv_case(
    dtype: DType,
    tol: f32,
    p: Conv2dParams,
    c_in: usize,
    c_out: usize,
    ks: usize,
) -> Result<()> {
    conv_case_sized(dtype, tol, p, (c_in, c_out, ks), (3, 9))
}

/// `batch` images of `side x side`.
fn conv_case_sized(
    dtype: DType,
    tol: f32,
    p: Conv2dParams,
    (c_in, c_out, ks): (usize, usize, usize),
    (batch, side): (usize, usize),
) -> Result<()> {
    let dev = Device::Cpu;
    let var = |t: &Tensor| candle_core::Var::from_tensor(t);
    let x = Tensor::randn(0f32, 1., (batch, c_in, side, side), &dev)?.to_dtype(dtype)?;
    let k = Tensor::randn(0f32, 1., (c_out, c_in / p.groups, ks, ks), &dev)?.to_dtype(dtype)?;
    let b = Tensor::randn(0f32, 1., c_out, &dev)?.to_dtype(dtype)?;
    let scale = |t: &Tensor| -> Result<f32> { t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
    for with_bias in [false, true] {
        let (xv, kv, bv) = (var(&x)?, var(&k)?, var(&b)?);
        let y = conv2d(&xv, &kv, with_bias.then_some(bv.as_tensor()), p)?;
        assert_eq!(y.dtype(), dtype);
        let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;

        let up = |t: &Tensor| var(&t.to_dtype(DType::F32)?);
        let (x32, k32, b32) = (up(&x)?, up(&k)?, up(&b)?);
        let mut y32 = x32.conv2d(&k32, p.padding, p.stride, p.dilation, p.groups)?;
        if with_bias {
            y32 = y32.broadcast_add(&b32.reshape((1, (), 1, 1))?)?;
        }
        // The f32 reference squares its own f32 output; the half path squares its rounded
        // output, so gradients agree to the rounding of y.
        let grads32 = y32.sqr()?.sum_all()?.backward()?;
        let what = format!("{dtype:?} {p:?} bias={with_bias}");
        assert!(
            max_abs_diff(&y, &y32)? <= tol * scale(&y32)?,
            "{what} forward"
        );
        let mut pairs = vec![("x", &xv, &x32), ("k", &kv, &k32)];
        if with_bias {
            pairs.push(("bias", &bv, &b32));
        }
        for (name, v, v32) in pairs {
            let (g, g32) = (grads.get(v).unwrap(), grads32.get(v32).unwrap());
            assert_eq!(g.dtype(), dtype, "{what} grad {name}");
            assert!(
                max_abs_diff(g, g32)? <= tol * scale(g32)?,
                "{what} grad {name}"
            );
        }
    }
    Ok(())
}

/// A half input with f32 master kernel and bias: the forward equals the conv of the masters
/// rounded to half, the input gradient is half, the masters' gradients are f32 and match the
/// f32 reference on the rounded values.
#[test]
#[allow(clippy::float_cmp)] // the same rounded operands, the same kernel: bit for bit
fn f32_masters_round_inside_and_get_f32_gradients() -> Result<()> {
    let dev = Device::Cpu;
    let p = Conv2dParams {
        padding: 1,
        stride: 2,
        dilation: 1,
        groups: 1,
    };
    for (dtype, tol) in [(DType::BF16, 2e-2), (DType::F16, 4e-3)] {
        let x = candle_core::Var::from_tensor(
            &Tensor::randn(0f32, 1., (3, 4, 7, 7), &dev)?.to_dtype(dtype)?,
        )?;
        let k = candle_core::Var::randn(0f32, 1., (5, 4, 3, 3), &dev)?;
        let b = candle_core::Var::randn(0f32, 1., 5, &dev)?;
        let y = conv2d(&x, &k, Some(&b), p)?;
        assert_eq!(y.dtype(), dtype);
        let rounded = conv2d(&x, &k.to_dtype(dtype)?, Some(&b.to_dtype(dtype)?), p)?;
        assert_eq!(
            max_abs_diff(&y, &rounded)?,
            0.0,
            "{dtype:?}: the cast a region inserts"
        );
        let grads = y.to_dtype(DType::F32)?.sqr()?.sum_all()?.backward()?;
        let up =
            |t: &Tensor| candle_core::Var::from_tensor(&t.to_dtype(dtype)?.to_dtype(DType::F32)?);
        let (x32, k32, b32) = (up(&x)?, up(&k)?, up(&b)?);
        let y32 = x32
            .conv2d(&k32, p.padding, p.stride, p.dilation, p.groups)?
            .broadcast_add(&b32.reshape((1, (), 1, 1))?)?;
        let grads32 = y32.sqr()?.sum_all()?.backward()?;
        let scale =
            |t: &Tensor| -> Result<f32> { t.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>() };
        assert_eq!(grads.get(&x).unwrap().dtype(), dtype);
        for (v, v32, name) in [(&k, &k32, "kernel"), (&b, &b32, "bias")] {
            let (g, g32) = (grads.get(v).unwrap(), grads32.get(v32).unwrap());
            assert_eq!(g.dtype(), DType::F32, "{name}: an f32 master's gradient");
            assert!(
                max_abs_diff(g, g32)? <= tol * scale(g32)?,
                "{dtype:?} {name}"
            );
        }
    }
    Ok(())
}

/// The pointwise op (the off-CPU path of a 1x1 conv) against candle's conv2d and a
/// broadcast bias add, values and every gradient, in f32 on CPU where both run.
#[test]
fn a_pointwise_product_is_the_1x1_convolution() -> Result<()> {
    let dev = Device::Cpu;
    let p = Conv2dParams {
        padding: 0,
        stride: 1,
        dilation: 1,
        groups: 1,
    };
    let worst =
        |a: &Tensor, b: &Tensor| -> Result<f32> { (a - b)?.abs()?.max_all()?.to_scalar::<f32>() };
    for batch in [1, 3] {
        let x = Var::randn(0f32, 1.0, (batch, 5, 4, 6), &dev)?;
        let k = Var::randn(0f32, 1.0, (7, 5, 1, 1), &dev)?;
        assert!(pointwise(&x, &k, p));
        assert!(!pointwise(&x, &k, Conv2dParams { stride: 2, ..p }));
        let bias = Var::randn(0f32, 1.0, 7, &dev)?;
        let ours = pointwise_product(&x, &k, Some(&bias))?;
        let theirs = x
            .conv2d(&k, 0, 1, 1, 1)?
            .broadcast_add(&bias.reshape((1, 7, 1, 1))?)?;
        let w = Tensor::randn(0f32, 1.0, theirs.shape(), &dev)?;
        let grads = |y: &Tensor| (y * &w)?.sum_all()?.backward();
        let (g_ours, g_theirs) = (grads(&ours)?, grads(&theirs)?);
        assert!(worst(&ours, &theirs)? < 1e-5, "batch {batch}");
        let no_bias = pointwise_product(&x, &k, None)?;
        assert!(
            worst(&no_bias, &x.conv2d(&k, 0, 1, 1, 1)?)? < 1e-5,
            "batch {batch}"
        );
        for v in [&x, &k, &bias] {
            let (a, b) = (g_ours.get(v).unwrap(), g_theirs.get(v).unwrap());
            assert_eq!(a.dims(), v.dims());
            assert!(worst(a, b)? < 1e-4, "batch {batch}");
        }
    }
    Ok(())
}

/// The weight gradient of a pointwise conv sums over the batch in f32, rounded once: 300
/// images of ones give exactly 300 in bf16, where a sum in bf16 sticks at 256 (256 + 1
/// rounds back to 256).
#[test]
fn a_pointwise_weight_gradient_sums_the_batch_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let x = Tensor::ones((300, 1, 1, 1), DType::BF16, &dev)?;
    let k = Var::ones((1, 1, 1, 1), DType::BF16, &dev)?;
    let grads = pointwise_product(&x, &k, None)?.sum_all()?.backward()?;
    let g = grads.get(&k).expect("a gradient").to_dtype(DType::F32)?;
    assert_eq!(g.flatten_all()?.to_vec1::<f32>()?, [300.0]);
    // So does the f32 bias's, with the bias in the op.
    let bias = Var::zeros(1, DType::F32, &dev)?;
    let y = pointwise_product(&x, &k, Some(&bias))?;
    assert_eq!(y.dtype(), DType::BF16);
    let grads = y.to_dtype(DType::F32)?.sum_all()?.backward()?;
    let g = grads.get(&bias).expect("a gradient");
    assert_eq!(g.to_vec1::<f32>()?, [300.0]);
    Ok(())
}
