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
