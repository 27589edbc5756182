//! The kernels' element types and their one dtype dispatch: f32, f16 and bf16 read as f32 and
//! written rounded once.

use half::{bf16, f16};

/// Runs `$body` with `$xs` bound to the contiguous elements of an f32, f16 or bf16 CPU storage
/// (and `$dys` to those of a second storage of the same dtype), whatever the dtype: the one
/// dtype dispatch of the kernels. `$op` names the kernel in the errors. A body producing a
/// `Vec<T>` in the same dtype wraps it with `WithDType::to_cpu_storage_owned`.
macro_rules! with_floats {
    ($op:expr, $storage:expr, $layout:expr, |$xs:ident| $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32(v) => {
                let $xs = $crate::kernels::layout::contiguous(v, $layout, $op)?;
                $body
            }
            candle_core::CpuStorage::F16(v) => {
                let $xs = $crate::kernels::layout::contiguous(v, $layout, $op)?;
                $body
            }
            candle_core::CpuStorage::BF16(v) => {
                let $xs = $crate::kernels::layout::contiguous(v, $layout, $op)?;
                $body
            }
            other => candle_core::bail!(
                "{} kernel: expected f32, f16 or bf16, got {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(other)
            ),
        }
    };
    ($op:expr, $x:expr, $lx:expr, $dy:expr, $ldy:expr, |$xs:ident, $dys:ident| $body:expr) => {
        match ($x, $dy) {
            (candle_core::CpuStorage::F32(x), candle_core::CpuStorage::F32(dy)) => {
                let ($xs, $dys) = (
                    $crate::kernels::layout::contiguous(x, $lx, $op)?,
                    $crate::kernels::layout::contiguous(dy, $ldy, $op)?,
                );
                $body
            }
            (candle_core::CpuStorage::F16(x), candle_core::CpuStorage::F16(dy)) => {
                let ($xs, $dys) = (
                    $crate::kernels::layout::contiguous(x, $lx, $op)?,
                    $crate::kernels::layout::contiguous(dy, $ldy, $op)?,
                );
                $body
            }
            (candle_core::CpuStorage::BF16(x), candle_core::CpuStorage::BF16(dy)) => {
                let ($xs, $dys) = (
                    $crate::kernels::layout::contiguous(x, $lx, $op)?,
                    $crate::kernels::layout::contiguous(dy, $ldy, $op)?,
                );
                $body
            }
            (a, b) => candle_core::bail!(
                "{} kernel: expected two operands of one float dtype, got {:?} and {:?}",
                $op,
                candle_core::backend::BackendStorage::dtype(a),
                candle_core::backend::BackendStorage::dtype(b)
            ),
        }
    };
}

pub(crate) use with_floats;

/// A kernel element type whose arithmetic is done in f32: read widens, write rounds.
pub(crate) trait Real: candle_core::WithDType {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;

    /// `dst[i] = src[i].get()` over equal lengths, 16 at a time with AVX-512 for the 16-bit
    /// types (the scalar conversions of `half` cost more than the arithmetic they feed).
    fn widen(src: &[Self], dst: &mut [f32]) {
        convert_block(src, dst);
    }

    /// `dst[i] = Self::put(src[i])` over equal lengths, vectorised as [`Real::widen`].
    fn narrow(src: &[f32], dst: &mut [Self]) {
        convert_block(src, dst);
    }
}

impl Real for f32 {
    #[inline]
    fn get(self) -> f32 {
        self
    }
    #[inline]
    fn put(v: f32) -> Self {
        v
    }
    fn widen(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
    fn narrow(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Real for f16 {
    #[inline]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn put(v: f32) -> Self {
        f16::from_f32(v)
    }
}

impl Real for bf16 {
    #[inline]
    fn get(self) -> f32 {
        self.to_f32()
    }
    #[inline]
    fn put(v: f32) -> Self {
        bf16::from_f32(v)
    }
}

/// Whether a hyper-parameter given in f64 stays finite where the kernels apply it, in f32: a
/// learning rate of 1e39 is finite as an f64 and infinite as the f32 factor of the update.
pub(crate) fn finite_in_f32(v: f64) -> bool {
    #[allow(clippy::cast_possible_truncation)] // the rounding is what is checked
    let narrowed = v as f32;
    v.is_finite() && narrowed.is_finite()
}

/// The dtype composed paths compute a float dtype's values in: f64 for f64, f32 for every
/// other (the half types widened).
pub(crate) fn wide(dtype: candle_core::DType) -> candle_core::DType {
    if dtype == candle_core::DType::F64 {
        candle_core::DType::F64
    } else {
        candle_core::DType::F32
    }
}

/// Whether `t` is an f32, f16 or bf16 tensor on CPU: what every kernel here reads.
pub(crate) fn cpu_float(t: &candle_core::Tensor) -> bool {
    t.device().is_cpu() && float(t)
}

/// Whether `t` is an f32, f16 or bf16 tensor on a CUDA device (and the crate has its CUDA
/// kernels: feature `cuda`).
pub(crate) fn cuda_float(t: &candle_core::Tensor) -> bool {
    cfg!(feature = "cuda") && t.device().is_cuda() && float(t)
}

fn float(t: &candle_core::Tensor) -> bool {
    use candle_core::DType;
    matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// `xs` read as f32 slice when `T` is f32 (no copy), `None` for the 16-bit types.
pub(crate) fn as_f32<T: Real>(xs: &[T]) -> Option<&[f32]> {
    // SAFETY: `T` is f32 (its dtype says so), so the cast is the identity.
    (T::DTYPE == candle_core::DType::F32)
        .then(|| unsafe { std::slice::from_raw_parts(xs.as_ptr().cast(), xs.len()) })
}

/// `xs` as a mutable f32 slice when `T` is f32.
pub(crate) fn as_f32_mut<T: Real>(xs: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: as `as_f32`.
    (T::DTYPE == candle_core::DType::F32)
        .then(|| unsafe { std::slice::from_raw_parts_mut(xs.as_mut_ptr().cast(), xs.len()) })
}

/// `src` converted into `dst` (equal lengths) on this thread: 16 elements at a time where
/// `vector` handles the pair, scalar code for what is left.
pub(crate) fn convert_block<S: Real, D: Real>(src: &[S], dst: &mut [D]) {
    let done = vector::convert(src, dst);
    for (o, &v) in dst[done..].iter_mut().zip(&src[done..]) {
        *o = D::put(v.get());
    }
}

#[cfg(target_arch = "x86_64")]
mod vector {
    use std::any::TypeId;
    use std::arch::x86_64::{_mm512_loadu_ps, _mm512_storeu_ps};

    use crate::kernels::elem::Real;
    use crate::kernels::simd::{load16, store16};

    /// Converts the leading multiple of 16 elements with AVX-512 when the pair is f32 <-> a
    /// 16-bit type; returns how many it converted (0 otherwise, or without AVX-512).
    pub(super) fn convert<S: Real, D: Real>(src: &[S], dst: &mut [D]) -> usize {
        if !std::is_x86_feature_detected!("avx512f") {
            return 0;
        }
        let n = src.len().min(dst.len()) / 16 * 16;
        let half = |t: TypeId| {
            if t == TypeId::of::<half::bf16>() {
                Some(true)
            } else if t == TypeId::of::<half::f16>() {
                Some(false)
            } else {
                None
            }
        };
        let f32_id = TypeId::of::<f32>();
        match (TypeId::of::<S>(), TypeId::of::<D>()) {
            (s, d) if s == f32_id => {
                let Some(bf16) = half(d) else { return 0 };
                let (src, dst) = (src.as_ptr().cast::<f32>(), dst.as_mut_ptr().cast::<u16>());
                for i in (0..n).step_by(16) {
                    // SAFETY: S is f32 and D a 16-bit float (checked by TypeId), i + 16 <= n,
                    // and avx512f was detected.
                    unsafe { store16(dst.add(i), _mm512_loadu_ps(src.add(i)), bf16) };
                }
                n
            }
            (s, d) if d == f32_id => {
                let Some(bf16) = half(s) else { return 0 };
                let (src, dst) = (src.as_ptr().cast::<u16>(), dst.as_mut_ptr().cast::<f32>());
                for i in (0..n).step_by(16) {
                    // SAFETY: as above, the other way round.
                    unsafe { _mm512_storeu_ps(dst.add(i), load16(src.add(i), bf16)) };
                }
                n
            }
            _ => 0,
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod vector {
    use crate::kernels::elem::Real;

    pub(super) fn convert<S: Real, D: Real>(_src: &[S], _dst: &mut [D]) -> usize {
        0
    }
}
