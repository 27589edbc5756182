//! Property tests of candle-amp's CPU GEMM and GEMM convolution, through the typed API, against
//! candle's f32 kernels on the same (half-representable) values: odd sizes (1, 7, 17, up to
//! 1000+ in a dimension), transposed and strided operands, batches and broadcast batches,
//! padding, stride, dilation and groups.
//!
//! Both sides accumulate in f32 on identical inputs, so they differ by summation order (a few
//! f32 ulps of the sum of |products|) and by the half output's one rounding (half an ulp of the
//! result: 2^-9 relative in bf16, 2^-12 in f16).

use candle_amp::{Precision, Tensor, BF16, F16, F32};
use candle_core::{DType, Device, IndexOp, Result};
use proptest::prelude::*;

fn dev() -> Device {
    Device::Cpu
}

/// Deterministic values in [-1, 1) from a seed, already rounded to `P`.
fn values<P: Precision>(dims: &[usize], seed: u32) -> Result<Tensor<P>> {
    let n: usize = dims.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|i| ((i as f32) * 0.618_034 + seed as f32 * 1.7).sin())
        .collect();
    Tensor::<F32>::from_candle(candle_core::Tensor::from_vec(v, dims, &dev())?)?.cast::<P>()
}

/// `|got - want| <= rel * |want| + k * 2^-20 * max|want|` elementwise, in f32.
fn assert_close(got: &candle_core::Tensor, want: &candle_core::Tensor, rel: f32, k: usize) {
    let got = got.to_dtype(DType::F32).unwrap().flatten_all().unwrap();
    let want = want.flatten_all().unwrap();
    let (g, w) = (
        got.to_vec1::<f32>().unwrap(),
        want.to_vec1::<f32>().unwrap(),
    );
    let scale = w.iter().fold(1f32, |m, v| m.max(v.abs()));
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let bound = rel * b.abs() + (k as f32) * 2f32.powi(-20) * scale;
        assert!(
            (a - b).abs() <= bound,
            "element {i}: {a} vs {b} (bound {bound})"
        );
    }
}

/// The relative rounding of one output in `P`: half an ulp.
fn half_ulp<P: Precision>() -> f32 {
    match P::DTYPE {
        DType::BF16 => 2f32.powi(-8),
        DType::F16 => 2f32.powi(-11),
        _ => 0.0,
    }
}

/// `a (m, k) * b (k, n)` in `P` through candle-amp, against candle's f32 matmul, with `b` given
/// as stored (`transpose_b`: stored `(n, k)` and viewed transposed) and `a` a strided row
/// window of a wider tensor (`a_stride_pad` extra columns).
fn matmul_case<P: Precision>(
    (m, n, k): (usize, usize, usize),
    transpose_b: bool,
    a_stride_pad: usize,
) -> Result<()> {
    let wide = values::<P>(&[m, k + a_stride_pad], 1)?;
    let a = wide.narrow(1, a_stride_pad, k)?;
    let b = if transpose_b {
        values::<P>(&[n, k], 2)?.t()?
    } else {
        values::<P>(&[k, n], 2)?
    };
    let got = a.matmul(&b)?;
    let want = a
        .cast::<F32>()?
        .as_candle()
        .contiguous()?
        .matmul(&b.cast::<F32>()?.as_candle().contiguous()?)?;
    assert_close(got.as_candle(), &want, half_ulp::<P>(), k);
    Ok(())
}

fn dim() -> impl Strategy<Value = usize> {
    prop_oneof![
        Just(1usize),
        Just(7),
        Just(17),
        Just(33),
        2usize..70,
        Just(1031)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn matmul_matches_f32_in_both_half_types(
        (m, n, k) in (dim(), dim(), dim()).prop_filter("keep it quick", |(m, n, k)| m * n * k <= 1 << 21),
        transpose_b in any::<bool>(),
        pad in 0usize..3,
    ) {
        matmul_case::<BF16>((m, n, k), transpose_b, pad).unwrap();
        matmul_case::<F16>((m, n, k), transpose_b, pad).unwrap();
    }

    #[test]
    fn batched_and_broadcast_matmul_match_f32(
        batch in 1usize..5,
        (m, n, k) in (1usize..40, 1usize..40, 1usize..80),
    ) {
        let a = values::<BF16>(&[batch, m, k], 3).unwrap();
        let b = values::<BF16>(&[k, n], 4).unwrap();
        let got = a.broadcast_matmul(&b).unwrap();
        let want = a.cast::<F32>().unwrap().as_candle()
            .broadcast_matmul(b.cast::<F32>().unwrap().as_candle()).unwrap();
        assert_close(got.as_candle(), &want, half_ulp::<BF16>(), k);
        // One batch item against its own 2-D product.
        let one = a.i(batch - 1).unwrap().matmul(&b).unwrap();
        assert_close(one.as_candle(), &want.i(batch - 1).unwrap(), half_ulp::<BF16>(), k);
    }

    #[test]
    fn conv2d_matches_candles_f32_conv2d(
        (c_in_g, c_out_g, groups) in (1usize..5, 1usize..5, 1usize..3),
        (h, w) in (1usize..12, 1usize..12),
        kernel in 1usize..4,
        (padding, stride, dilation) in (0usize..3, 1usize..3, 1usize..3),
        batch in 1usize..4,
    ) {
        let span = dilation * (kernel - 1) + 1;
        prop_assume!(h + 2 * padding >= span && w + 2 * padding >= span);
        let (c_in, c_out) = (c_in_g * groups, c_out_g * groups);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let x = values::<F32>(&[batch, c_in, h, w], 5).unwrap();
            let k = values::<F32>(&[c_out, c_in_g, kernel, kernel], 6).unwrap();
            let (got, rel) = match dtype {
                DType::BF16 => (x.cast::<BF16>().unwrap().conv2d(&k.cast::<BF16>().unwrap(), padding, stride, dilation, groups).unwrap().cast::<F32>().unwrap(), half_ulp::<BF16>()),
                DType::F16 => (x.cast::<F16>().unwrap().conv2d(&k.cast::<F16>().unwrap(), padding, stride, dilation, groups).unwrap().cast::<F32>().unwrap(), half_ulp::<F16>()),
                _ => (x.conv2d(&k, padding, stride, dilation, groups).unwrap(), 0.0),
            };
            // The reference on the same rounded values.
            let round = |t: &Tensor<F32>| t.as_candle().to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let want = round(&x).conv2d(&round(&k), padding, stride, dilation, groups).unwrap();
            assert_close(got.as_candle(), &want, rel, c_in_g * kernel * kernel);
        }
    }
}
