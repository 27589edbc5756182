//! Comparisons the kernels' unit tests measure errors with.

/// The largest `|t|`, read as f32: the scale the kernels' tests measure errors against.
pub(crate) fn max_abs(t: &candle_core::Tensor) -> candle_core::Result<f32> {
    t.abs()?
        .max_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_scalar()
}

/// The largest `|a - b|`, both read as f32: the kernels' tests compare against candle's ops.
pub(crate) fn max_abs_diff(
    a: &candle_core::Tensor,
    b: &candle_core::Tensor,
) -> candle_core::Result<f32> {
    use candle_core::DType;
    (a.to_dtype(DType::F32)? - b.to_dtype(DType::F32)?)?
        .abs()?
        .flatten_all()?
        .max(0)?
        .to_scalar()
}

/// Deterministic pseudo-random values in [-1, 1) (a 64-bit LCG): the kernels' test inputs.
pub(crate) fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            ((s >> 40) as f32 / (1u64 << 23) as f32) - 1.0
        })
        .collect()
}
