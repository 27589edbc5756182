//! Pooling against candle's ops and hand-computed windows.

use candle_core::{DType, Device, Var};
use half::bf16;

use super::*;

/// Forward against candle's max pool; the gradient against a hand computation: each
/// output's gradient lands on its window's maximum (PyTorch's rule; candle's own backward
/// divides it by the window's area, so it is no reference here).
#[test]
fn max_pool_matches_candle_and_a_hand_computation() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::randn(0f32, 1.0, (2, 3, 6, 6), &dev)?;
    let p = Pool2d {
        kernel: (2, 2),
        stride: (2, 2),
        padding: 0,
    };
    let y = max_pool2d(&x, p)?;
    let want = x.max_pool2d(2)?;
    assert_eq!(
        y.flatten_all()?.to_vec1::<f32>()?,
        want.flatten_all()?.to_vec1::<f32>()?
    );
    let w = Tensor::randn(0f32, 1.0, y.shape(), &dev)?;
    let g = (&y * &w)?.sum_all()?.backward()?;
    let g = g.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?;
    let (xs, ws) = (
        x.flatten_all()?.to_vec1::<f32>()?,
        w.flatten_all()?.to_vec1::<f32>()?,
    );
    let mut expected = vec![0f32; xs.len()];
    for plane in 0..6 {
        for oy in 0..3 {
            for ox in 0..3 {
                let at = (0..4)
                    .map(|k| plane * 36 + (2 * oy + k / 2) * 6 + 2 * ox + k % 2)
                    .max_by(|&a, &b| xs[a].total_cmp(&xs[b]))
                    .unwrap();
                expected[at] += ws[plane * 9 + oy * 3 + ox];
            }
        }
    }
    assert_eq!(g, expected);

    // 4x4 plane 0..16, 3x3 window, stride 2, padding 1: outputs 2x2 at the maxima 5, 7, 13,
    // 15 (row-major values), each gradient to its own maximum.
    let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let x = Var::from_tensor(&Tensor::from_vec(v, (1, 1, 4, 4), &dev)?)?;
    let p = Pool2d {
        kernel: (3, 3),
        stride: (2, 2),
        padding: 1,
    };
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let xd = x.to_dtype(dtype)?;
        let y = max_pool2d(&xd, p)?;
        assert_eq!(
            y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?,
            [5., 7., 13., 15.]
        );
    }
    let y = max_pool2d(&x, p)?;
    let g = y.sum_all()?.backward()?;
    let mut want = vec![0f32; 16];
    for at in [5, 7, 13, 15] {
        want[at] = 1.0;
    }
    assert_eq!(g.get(&x).unwrap().flatten_all()?.to_vec1::<f32>()?, want);
    Ok(())
}

/// Ties go to the window's first maximum and a NaN wins (PyTorch's rules), in a half dtype:
/// one 2x2 window of `[3, 3, 1, 3]` sends its gradient to position 0, one of `[1, NaN, 5,
/// NaN]` outputs NaN and sends its gradient to the first NaN; all -inf gives -inf.
#[test]
fn ties_go_to_the_first_maximum_and_nan_wins() -> Result<()> {
    let dev = Device::Cpu;
    let inf = f32::INFINITY;
    #[rustfmt::skip]
    let v = [3., 3., 1., f32::NAN, -inf, -inf,
             1., 3., 5., f32::NAN, -inf, -inf];
    let x = Tensor::from_vec(v.to_vec(), (1, 1, 2, 6), &dev)?.to_dtype(DType::BF16)?;
    let x = Var::from_tensor(&x)?;
    let p = Pool2d {
        kernel: (2, 2),
        stride: (2, 2),
        padding: 0,
    };
    let y = max_pool2d(x.as_tensor(), p)?;
    let y = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    assert_eq!(y[0].to_bits(), 3f32.to_bits());
    assert!(y[1].is_nan());
    assert_eq!(y[2].to_bits(), (-inf).to_bits());
    let grads = max_pool2d(x.as_tensor(), p)?
        .to_dtype(DType::F32)?
        .sum_all()?
        .backward()?;
    let g = grads.get(x.as_tensor()).expect("a gradient");
    let g = g.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
    #[rustfmt::skip]
    let want = [1., 0., 0., 1., 1., 0.,
                0., 0., 0., 0., 0., 0.];
    assert_eq!(g, want);
    Ok(())
}

/// A bf16 3x3 average of 1 and eight 2^-8 is the exact mean rounded once (0.1145..);
/// candle's sums in bf16, where each 1 + 2^-8 rounds back to 1, and multiplies by 1/9
/// rounded to bf16: 0.111328125, six bf16 ulps low.
#[test]
fn an_average_rounds_once_from_the_exact_mean() -> Result<()> {
    let mut v = vec![2f32.powi(-8); 9];
    v[0] = 1.0;
    let x = Tensor::from_vec(v, (1, 1, 3, 3), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let got = avg_pool2d(&x, Pool2d::tiling((3, 3)))?
        .flatten_all()?
        .to_vec1::<bf16>()?;
    let exact = (1.0 + 8.0 / 256.0) / 9.0;
    assert_eq!(got, [bf16::from_f64(exact)]);
    let candle = x.avg_pool2d(3)?.flatten_all()?.to_vec1::<bf16>()?;
    assert_eq!(candle, [bf16::from_f32(0.111_328_125)]);
    Ok(())
}

/// A padding of more than half the window is an error, as in PyTorch (such windows could
/// hold nothing but padding); half is allowed.
#[test]
fn padding_beyond_half_the_window_is_an_error() -> Result<()> {
    let x = Tensor::zeros((1, 1, 5, 5), DType::F32, &Device::Cpu)?;
    let pool = |kernel, padding| Pool2d {
        kernel,
        stride: (1, 1),
        padding,
    };
    let err = max_pool2d(&x, pool((3, 3), 2)).unwrap_err().to_string();
    assert!(err.contains("more than half"), "{err}");
    assert!(
        max_pool2d(&x, pool((3, 4), 2)).is_err(),
        "checked per dimension"
    );
    assert_eq!(max_pool2d(&x, pool((3, 3), 1))?.dims(), [1, 1, 5, 5]);
    assert_eq!(max_pool2d(&x, pool((4, 4), 2))?.dims(), [1, 1, 6, 6]);
    Ok(())
}

/// Off the CPU the pools are compositions of candle ops; run on CPU they must agree with
/// this module's ops (which the property tests check against pools by hand). Inputs are
/// quarters in [-2, 2] (many tied maxima) and output gradients small integers, so every
/// sum is exact: the max pool and its gradient agree to the bit, ties included (the first
/// maximum gets the gradient in both); the average pool within one rounding of its dtype.
#[test]
fn composed_pools_agree_with_the_cpu_ops() -> Result<()> {
    let dev = Device::Cpu;
    let geometries = [
        ((2, 2), (2, 2), 0),
        ((3, 3), (2, 2), 1),
        ((3, 2), (1, 2), 1),
        ((2, 3), (3, 1), 0),
    ];
    let bits = |t: &Tensor| -> Result<Vec<u32>> {
        let v = t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        Ok(v.iter().map(|x| x.to_bits()).collect())
    };
    for (kernel, stride, padding) in geometries {
        let p = Pool2d {
            kernel,
            stride,
            padding,
        };
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            let quarters = (Tensor::randn(0f32, 1.0, (2, 3, 7, 9), &dev)? * 4.0)?
                .round()?
                .clamp(-8f32, 8f32)?;
            let x = Var::from_tensor(&(quarters / 4.0)?.to_dtype(dtype)?)?;
            let max = [max_pool2d(&x, p)?, max_pool2d_composed(&x, p)?];
            let avg = [avg_pool2d(&x, p)?, avg_pool2d_composed(&x, p)?];
            assert_eq!(bits(&max[0])?, bits(&max[1])?, "{p:?} {dtype:?}");
            let w = (Tensor::randn(0f32, 1.0, max[0].shape(), &dev)? * 2.0)?
                .round()?
                .to_dtype(dtype)?;
            let grad = |y: &Tensor| -> Result<Tensor> {
                let g = (y * &w)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
                Ok(g.get(&x).expect("a gradient").clone())
            };
            let (g_op, g_composed) = (grad(&max[0])?, grad(&max[1])?);
            assert_eq!(bits(&g_op)?, bits(&g_composed)?, "{p:?} {dtype:?}");
            let eps = match dtype {
                DType::F32 => 1e-6,
                DType::F16 => 1e-3,
                _ => 8e-3,
            };
            let close = |a: &Tensor, b: &Tensor| -> Result<()> {
                let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
                let worst = (&a - &b)?.abs()?.max_all()?.to_scalar::<f32>()?;
                let scale = a.abs()?.max_all()?.to_scalar::<f32>()?.max(1.0);
                assert!(worst <= eps * scale, "{p:?} {dtype:?}: {worst}");
                Ok(())
            };
            close(&avg[0], &avg[1])?;
            close(&grad(&avg[0])?, &grad(&avg[1])?)?;
        }
    }
    Ok(())
}

/// Where overlapping windows share their maximum, its gradient is their sum rounded once,
/// by both paths: 1 + 8 * 2^-8 is 1.03125 in bf16, where adding 2^-8 to 1 one at a time in
/// bf16 stays at 1. (candle's CPU backward happens to add the small terms first, so on CPU
/// this does not tell the composed pool's f32 widening from none; off the CPU the order is
/// the device's.)
#[test]
fn overlapping_max_gradients_add_in_f32() -> Result<()> {
    let mut v = vec![0f32; 25];
    v[12] = 10.0; // the centre of a 5x5 plane: the maximum of all nine 3x3 windows
    let x = Tensor::from_vec(v, (1, 1, 5, 5), &Device::Cpu)?.to_dtype(DType::BF16)?;
    let x = Var::from_tensor(&x)?;
    let p = Pool2d {
        kernel: (3, 3),
        stride: (1, 1),
        padding: 0,
    };
    // The 1 first or last among the windows, whichever order the backward adds them in.
    for big in [0, 8] {
        let mut w = vec![2f32.powi(-8); 9];
        w[big] = 1.0;
        let w = Tensor::from_vec(w, (1, 1, 3, 3), &Device::Cpu)?.to_dtype(DType::BF16)?;
        for y in [max_pool2d(&x, p)?, max_pool2d_composed(&x, p)?] {
            let grads = (y * &w)?.to_dtype(DType::F32)?.sum_all()?.backward()?;
            let g = grads.get(&x).expect("a gradient").to_dtype(DType::F32)?;
            let at_max = g.flatten_all()?.to_vec1::<f32>()?[12];
            assert_eq!(at_max.to_bits(), 1.031_25f32.to_bits(), "{big}");
        }
    }
    Ok(())
}

/// A window holding a NaN pools to NaN off the CPU too (candle's argmax skips a NaN).
#[test]
fn a_composed_max_pool_propagates_nan() -> Result<()> {
    let v = [1f32, f32::NAN, 2., 3., 4., 5., 6., 7.];
    let x = Tensor::from_vec(v.to_vec(), (1, 1, 2, 4), &Device::Cpu)?;
    let y = max_pool2d_composed(&x, Pool2d::tiling((2, 2)))?;
    let y = y.flatten_all()?.to_vec1::<f32>()?;
    assert!(y[0].is_nan());
    assert_eq!(y[1].to_bits(), 7f32.to_bits());
    Ok(())
}
