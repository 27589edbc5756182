//! Kernels: the CPU compute of the lower-precision ops, the half-precision paths candle 0.11
//! lacks, and the gradient scaler's fused pass.
//!
//! - `gemm`: a packed, cache-blocked GEMM with f32 accumulation for f32, bf16 and f16
//!   (`vdpbf16ps` for bf16 on AVX512-BF16, AVX-512 FMA or portable f32 otherwise).
//! - `matmul`: half `matmul`/`broadcast_matmul` and `Linear`'s half product on f32 masters, on
//!   that GEMM, forward and backward.
//! - `conv2d`: conv2d on CPU as GEMMs (im2col/col2im, none for 1x1), bias fused, every dtype.
//! - `convert`: vectorised f32 <-> half conversions.
//! - `activation`: GELU (tanh and erf), SiLU and ReLU, each one op computed in f32 with a
//!   one-pass backward.
//! - `optim`: the in-place update passes of `crate::optim`'s SGD and AdamW.
//! - `embedding`: the lookup of an f32 table, its backward writing the table's gradient once.
//! - `leaf_grads`: the variables' gradients the ops hand to the scaler's backward directly,
//!   sparing candle's zeros-and-add per gradient.
//! - `parallel`: the pool every parallel kernel runs on (candle's own).
//! - `softmax`, `layer_norm`: fp32-class ops that read half inputs as they are, compute in f32,
//!   and have their own backward.
//! - this module: `Real`, the element types, and the widened passes through which the
//!   element-wise kernels read and write half values 16 at a time (`map_widened`).
//! - `pool`: max and average pooling with any window, stride and padding, and their backward.
//! - `simd`: the AVX-512 f32 <-> bf16/f16 conversions, bit-identical to `half`.
//! - `mse`: the mean squared error reading half predictions and targets as they are.
//! - `batch_norm`: batch norm as one op with its own backward on CPU and CUDA, keeping only its
//!   input and per-channel statistics for the backward pass (a composition of candle ops keeps
//!   six f32 intermediates per layer).
//! - `cuda` (feature `cuda`): the CUDA C modules (compiled at run time by NVRTC) and the CUDA
//!   backend of the unscale pass; batch norm's CUDA forwards are in `batch_norm::cuda`.
//! - [`unscale`]: the multi-tensor "multiply by inv_scale in place and record non-finite values"
//!   pass behind `GradScaler`, one pass over every gradient.

/// Runs `$body` with `$xs` bound to the contiguous elements of an f32, f16 or bf16 CPU storage
/// (and `$dys` to those of a second storage of the same dtype), whatever the dtype: the one
/// dtype dispatch of the kernels. `$op` names the kernel in the errors. A body producing a
/// `Vec<T>` in the same dtype wraps it with `WithDType::to_cpu_storage_owned`.
macro_rules! with_floats {
    ($op:expr, $storage:expr, $layout:expr, |$xs:ident| $body:expr) => {
        match $storage {
            candle_core::CpuStorage::F32(v) => {
                let $xs = $crate::kernels::contiguous(v, $layout, $op)?;
                $body
            }
            candle_core::CpuStorage::F16(v) => {
                let $xs = $crate::kernels::contiguous(v, $layout, $op)?;
                $body
            }
            candle_core::CpuStorage::BF16(v) => {
                let $xs = $crate::kernels::contiguous(v, $layout, $op)?;
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
                    $crate::kernels::contiguous(x, $lx, $op)?,
                    $crate::kernels::contiguous(dy, $ldy, $op)?,
                );
                $body
            }
            (candle_core::CpuStorage::F16(x), candle_core::CpuStorage::F16(dy)) => {
                let ($xs, $dys) = (
                    $crate::kernels::contiguous(x, $lx, $op)?,
                    $crate::kernels::contiguous(dy, $ldy, $op)?,
                );
                $body
            }
            (candle_core::CpuStorage::BF16(x), candle_core::CpuStorage::BF16(dy)) => {
                let ($xs, $dys) = (
                    $crate::kernels::contiguous(x, $lx, $op)?,
                    $crate::kernels::contiguous(dy, $ldy, $op)?,
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

mod activation;
mod affine;
pub(crate) mod batch_norm;
mod binary;
mod conv2d;
mod convert;
#[cfg(feature = "cuda")]
mod cuda;
mod embedding;
pub(crate) mod gemm;
mod layer_norm;
pub(crate) mod leaf_grads;
mod matmul;
mod mse;
pub(crate) mod optim;
mod parallel;
mod pool;
#[cfg(target_arch = "x86_64")]
pub(crate) mod simd;
mod softmax;
pub mod unscale;

pub(crate) use activation::{gelu, gelu_erf, relu, silu};
pub(crate) use affine::{affine, masked_scale};
pub(crate) use binary::{
    add, broadcast_add, broadcast_div, broadcast_maximum, broadcast_minimum, broadcast_mul,
    broadcast_sub, spread, sub,
};
pub(crate) use conv2d::{
    conv1d, conv2d, handles as conv2d_handles, widened_transpose, Conv2dParams,
};
pub(crate) use convert::to_dtype;
pub(crate) use embedding::embedding;
pub(crate) use layer_norm::layer_norm;
pub(crate) use matmul::{broadcast_matmul, linear, matmul};
pub(crate) use mse::mse;
pub(crate) use pool::{avg_pool2d, max_pool2d, Pool2d};
pub(crate) use softmax::{log_softmax_last_dim, softmax_last_dim};

use candle_core::Layout;
use half::{bf16, f16};

/// A kernel element type whose arithmetic is done in f32: read widens, write rounds.
pub(crate) trait Real: candle_core::WithDType {
    fn get(self) -> f32;
    fn put(v: f32) -> Self;

    /// `dst[i] = src[i].get()` over equal lengths, 16 at a time with AVX-512 for the 16-bit
    /// types (the scalar conversions of `half` cost more than the arithmetic they feed).
    fn widen(src: &[Self], dst: &mut [f32]) {
        convert::convert_block(src, dst);
    }

    /// `dst[i] = Self::put(src[i])` over equal lengths, vectorised as [`Real::widen`].
    fn narrow(src: &[f32], dst: &mut [Self]) {
        convert::convert_block(src, dst);
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

/// The dtype composed paths compute a float dtype's values in: f64 for f64, f32 for every
/// other (the half types widened).
pub(crate) fn wide(dtype: candle_core::DType) -> candle_core::DType {
    if dtype == candle_core::DType::F64 {
        candle_core::DType::F64
    } else {
        candle_core::DType::F32
    }
}

/// `y + bias` for an f32 master `bias` of `y`'s size along `dim` (the outputs' channels), with
/// the bias's gradient summed in f32: the composed paths' bias add (off the CPU, where the
/// layers' fused ops do not run). On CPU and CUDA, for f32, f16 and bf16 outputs, one op
/// ([`batch_norm::bias_add`]). Elsewhere candle ops: for a half `y` the bias is broadcast in
/// f32 and then rounded to `y`'s dtype (a copy of `y`'s size), so that candle's backward sums
/// the gradient over the broadcast dimensions in f32: rounding the bias first would have it
/// summed in half (candle's CUDA f16 sum accumulates in f16, so would its CPU one; 300 bf16
/// ones summed to 256).
pub(crate) fn add_bias(
    y: &candle_core::Tensor,
    bias: &candle_core::Tensor,
    dim: usize,
) -> candle_core::Result<candle_core::Tensor> {
    if batch_norm::bias_supported(y, bias) {
        return batch_norm::bias_add(y, bias, dim);
    }
    let mut shape = vec![1; y.rank()];
    let Some(at) = shape.get_mut(dim) else {
        candle_core::bail!("bias add: dimension {dim} of a rank-{} output", y.rank())
    };
    *at = bias.elem_count();
    let bias = bias.reshape(shape)?.broadcast_as(y.shape())?;
    if bias.dtype() == y.dtype() {
        return y + bias;
    }
    y + to_dtype(&bias, y.dtype())?
}

/// Whether `t` is an f32, f16 or bf16 tensor on CPU: what every kernel here reads.
pub(crate) fn cpu_float(t: &candle_core::Tensor) -> bool {
    use candle_core::DType;
    t.device().is_cpu() && matches!(t.dtype(), DType::F32 | DType::F16 | DType::BF16)
}

/// Elements per block of a widened pass: f32 scratch on the stack, in L1.
pub(crate) const BLOCK: usize = 512;

/// `xs` read as f32 slice when `T` is f32 (no copy), `None` for the 16-bit types.
pub(crate) fn as_f32<T: Real>(xs: &[T]) -> Option<&[f32]> {
    // SAFETY: `T` is f32 (its dtype says so), so the cast is the identity.
    (T::DTYPE == candle_core::DType::F32)
        .then(|| unsafe { std::slice::from_raw_parts(xs.as_ptr().cast(), xs.len()) })
}

/// `xs` as a mutable f32 slice when `T` is f32.
fn as_f32_mut<T: Real>(xs: &mut [T]) -> Option<&mut [f32]> {
    // SAFETY: as `as_f32`.
    (T::DTYPE == candle_core::DType::F32)
        .then(|| unsafe { std::slice::from_raw_parts_mut(xs.as_mut_ptr().cast(), xs.len()) })
}

/// Calls `f` on consecutive runs of `a` and `b` (equal lengths, each of any element type) as
/// f32: the slices themselves when both are f32, blocks widened on the stack otherwise. The
/// elementwise kernels' reading side.
pub(crate) fn widened2<T: Real, U: Real>(a: &[T], b: &[U], mut f: impl FnMut(&[f32], &[f32])) {
    if let (Some(a), Some(b)) = (as_f32(a), as_f32(b)) {
        return f(a, b);
    }
    let (mut wa, mut wb) = ([0f32; BLOCK], [0f32; BLOCK]);
    for (a, b) in a.chunks(BLOCK).zip(b.chunks(BLOCK)) {
        let (wa, wb) = (&mut wa[..a.len()], &mut wb[..a.len()]);
        T::widen(a, wa);
        U::widen(b, wb);
        f(wa, wb);
    }
}

/// Calls `f` on consecutive runs of `xs` as f32 (see [`widened2`]).
pub(crate) fn widened<T: Real>(xs: &[T], mut f: impl FnMut(&[f32])) {
    widened2(xs, xs, |x, _| f(x));
}

/// Elements summed in f32 before a partial sum joins the f64 total.
const RUN: usize = 256;

/// The sums of both values of `f(x, y)` over `x` and `y` (equal lengths): sixteen f32 lanes
/// over each run of [`RUN`] elements (so the compiler vectorises), the runs added in f64.
pub(crate) fn lane_sums2(x: &[f32], y: &[f32], f: impl Fn(f32, f32) -> (f32, f32)) -> (f64, f64) {
    let (mut ta, mut tb) = (0f64, 0f64);
    for (x, y) in x.chunks(RUN).zip(y.chunks(RUN)) {
        let (mut a, mut b) = ([0f32; 16], [0f32; 16]);
        let mut add = |lanes: &[f32], ys: &[f32]| {
            for (l, (&x, &y)) in lanes.iter().zip(ys).enumerate() {
                let (u, v) = f(x, y);
                a[l] += u;
                b[l] += v;
            }
        };
        let (xs, ys) = (x.chunks_exact(16), y.chunks_exact(16));
        let (xr, yr) = (xs.remainder(), ys.remainder());
        for (x, y) in xs.zip(ys) {
            add(x, y);
        }
        add(xr, yr);
        ta += f64::from(a.iter().sum::<f32>());
        tb += f64::from(b.iter().sum::<f32>());
    }
    (ta, tb)
}

/// Elements per parallel chunk of [`zip_map`].
const ZIP_CHUNK: usize = 1 << 14;

/// `f` over zipped chunks of `a` and `b`, widened to f32, into a new vector, in parallel: the
/// pass of the one-input element-wise ops and their backwards (`zip_map(x, x, ..)` for one).
pub(crate) fn zip_map<T: Real + Send + Sync>(
    a: &[T],
    b: &[T],
    f: impl Fn(f32, f32) -> f32 + Sync,
) -> Vec<T> {
    parallel::filled(a.len(), ZIP_CHUNK, |i, o| {
        let (a, b) = (
            &a[i * ZIP_CHUNK..][..o.len()],
            &b[i * ZIP_CHUNK..][..o.len()],
        );
        map_widened2(a, b, o, |a, b, o| {
            for ((o, &a), &b) in o.iter_mut().zip(a).zip(b) {
                *o = f(a, b);
            }
        });
    })
}

/// `out = f(a, b)` elementwise over equal lengths, computed on f32 runs and rounded once to
/// `T`: the elementwise kernels' writing side.
pub(crate) fn map_widened2<T: Real>(
    a: &[T],
    b: &[T],
    out: &mut [T],
    f: impl Fn(&[f32], &[f32], &mut [f32]),
) {
    if let (Some(a), Some(b), Some(o)) = (as_f32(a), as_f32(b), as_f32_mut(out)) {
        return f(a, b, o);
    }
    let mut wo = [0f32; BLOCK];
    let mut start = 0;
    widened2(a, b, |a, b| {
        let wo = &mut wo[..a.len()];
        f(a, b, wo);
        T::narrow(wo, &mut out[start..start + a.len()]);
        start += a.len();
    });
}

/// `out = f(xs)` elementwise (see [`map_widened2`]).
pub(crate) fn map_widened<T: Real>(xs: &[T], out: &mut [T], f: impl Fn(&[f32], &mut [f32])) {
    map_widened2(xs, xs, out, |x, _, o| f(x, o));
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

/// The storage offsets a strided layout addresses, in row-major order of its shape.
pub(crate) fn strided_offsets(layout: &Layout) -> impl Iterator<Item = usize> + '_ {
    let (dims, stride) = (layout.dims(), layout.stride());
    let mut index = vec![0usize; dims.len()];
    let mut offset = layout.start_offset();
    (0..layout.shape().elem_count()).map(move |_| {
        let current = offset;
        // Odometer increment: bump the last dimension, carrying into earlier ones.
        for d in (0..dims.len()).rev() {
            index[d] += 1;
            offset += stride[d];
            if index[d] < dims[d] {
                break;
            }
            offset -= stride[d] * dims[d];
            index[d] = 0;
        }
        current
    })
}

/// The elements of a contiguous layout: the ops make their operands contiguous before they
/// reach a kernel, so anything else is a bug in the op, reported as an error naming `op`.
pub(crate) fn contiguous<'a, T>(
    data: &'a [T],
    layout: &Layout,
    op: &str,
) -> candle_core::Result<&'a [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(&data[start..end]),
        None => candle_core::bail!("{op} kernel: operand not contiguous"),
    }
}

/// The elements a layout addresses, in row-major order of its shape: the storage itself when
/// contiguous, gathered into a new vector otherwise.
pub(crate) fn elements<'a, T: Copy>(data: &'a [T], layout: &Layout) -> std::borrow::Cow<'a, [T]> {
    match layout.contiguous_offsets() {
        Some((start, end)) => std::borrow::Cow::Borrowed(&data[start..end]),
        None => std::borrow::Cow::Owned(strided_offsets(layout).map(|i| data[i]).collect()),
    }
}

/// Whether every element of `layout` has its own storage slot (no broadcast or overlapping
/// strides), so that an in-place update touches each element exactly once.
pub(crate) fn is_non_overlapping(layout: &Layout) -> bool {
    let mut dims: Vec<(usize, usize)> = layout
        .dims()
        .iter()
        .zip(layout.stride())
        .filter(|(&d, _)| d > 1)
        .map(|(&d, &s)| (s, d))
        .collect();
    dims.sort_unstable();
    let mut span = 1;
    for (stride, dim) in dims {
        if stride < span {
            return false;
        }
        span = stride * dim;
    }
    true
}

/// The largest `|t|`, read as f32: the scale the kernels' tests measure errors against.
#[cfg(test)]
pub(crate) fn max_abs(t: &candle_core::Tensor) -> candle_core::Result<f32> {
    t.abs()?
        .max_all()?
        .to_dtype(candle_core::DType::F32)?
        .to_scalar()
}

/// The largest `|a - b|`, both read as f32: the kernels' tests compare against candle's ops.
#[cfg(test)]
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

#[cfg(test)]
mod tests {
    use half::{bf16, f16};

    use super::{lane_sums2, map_widened2, widened, Real, BLOCK};

    /// The widened passes give what per-element `get`/`put` give, bit for bit, over lengths
    /// that end inside a vector, on a vector edge and across blocks.
    fn widened_passes_match_scalar<T: Real + std::fmt::Debug>() {
        for len in [0, 5, 16, 31, BLOCK, BLOCK + 1, 2 * BLOCK + 37] {
            let a: Vec<T> = (0..len)
                .map(|i| T::put((i as f32 * 0.37).sin() * 300.0))
                .collect();
            let b: Vec<T> = (0..len)
                .map(|i| T::put((i as f32 * 0.11).cos() - 0.5))
                .collect();
            let f = |x: f32, y: f32| x * y + 1.0 / 3.0;
            let mut out = vec![T::put(0.0); len];
            map_widened2(&a, &b, &mut out, |a, b, o| {
                for ((o, &x), &y) in o.iter_mut().zip(a).zip(b) {
                    *o = f(x, y);
                }
            });
            let want: Vec<T> = a
                .iter()
                .zip(&b)
                .map(|(x, y)| T::put(f(x.get(), y.get())))
                .collect();
            assert_eq!(out, want, "{:?} len {len}", T::DTYPE);
            let mut seen = Vec::new();
            widened(&a, |x| seen.extend_from_slice(x));
            assert_eq!(seen, a.iter().map(|x| x.get()).collect::<Vec<_>>());
        }
    }

    #[test]
    fn widened_passes_match_scalar_conversions() {
        widened_passes_match_scalar::<f32>();
        widened_passes_match_scalar::<bf16>();
        widened_passes_match_scalar::<f16>();
    }

    /// The f32 lane sums of long runs stay within f32 rounding of the exact (f64) sums.
    #[test]
    fn lane_sums_track_f64_sums() {
        let x: Vec<f32> = (0..100_003)
            .map(|i| (i as f32 * 0.013).sin() + 0.25)
            .collect();
        let y: Vec<f32> = (0..100_003).map(|i| (i as f32 * 0.007).cos()).collect();
        let (a, b) = lane_sums2(&x, &y, |x, y| (x, x * y));
        let exact_a: f64 = x.iter().map(|&v| f64::from(v)).sum();
        let exact_b: f64 = x.iter().zip(&y).map(|(&u, &v)| f64::from(u * v)).sum();
        let scale: f64 = x.iter().map(|&v| f64::from(v.abs())).sum();
        assert!((a - exact_a).abs() < 1e-6 * scale, "{a} vs {exact_a}");
        assert!((b - exact_b).abs() < 1e-6 * scale, "{b} vs {exact_b}");
    }

    /// The bias add: values `y + b` in `y`'s dtype, and the bias's gradient summed over the
    /// other dimensions in f32: 300 rows of a bf16 output give 300 (rounding the bias to bf16
    /// before broadcasting it has candle sum its gradient in bf16: 256).
    #[test]
    fn the_bias_add_sums_its_gradient_in_f32() -> candle_core::Result<()> {
        use super::add_bias;
        use candle_core::{DType, Device, Tensor, Var};
        let dev = Device::Cpu;
        let y = Tensor::ones((300, 2), DType::BF16, &dev)?;
        let b = Var::new(&[0.5f32, -2.0], &dev)?;
        let out = add_bias(&y, &b, 1)?;
        assert_eq!(out.dtype(), DType::BF16);
        let rows = out.to_dtype(DType::F32)?.to_vec2::<f32>()?;
        assert!(rows.iter().all(|r| r == &[1.5, -1.0]));
        let grads = out.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(&b).expect("a gradient").to_vec1::<f32>()?;
        assert_eq!(g, [300.0, 300.0]);
        let rounded_first = y.broadcast_add(&b.to_dtype(DType::BF16)?)?;
        let grads = rounded_first.to_dtype(DType::F32)?.sum_all()?.backward()?;
        let g = grads.get(&b).expect("a gradient").to_vec1::<f32>()?;
        assert_eq!(g, [256.0, 256.0], "candle sums a bf16 gradient in bf16");
        // Per channel along dimension 1 of a conv output.
        let y = Tensor::zeros((2, 2, 3, 3), DType::F16, &dev)?;
        let out = add_bias(&y, &b, 1)?.to_dtype(DType::F32)?;
        assert_eq!(out.sum((0, 2, 3))?.to_vec1::<f32>()?, [9.0, -36.0]);
        Ok(())
    }

    /// The bias add's values are `y + b` (`b` rounded to `y`'s dtype) computed in f32 and rounded
    /// once to `y`'s dtype, its
    /// input gradient is the output gradient itself and its bias gradient the per-channel sum
    /// of it (against f64), for any dimension, strided inputs and every float dtype.
    #[test]
    fn the_bias_add_matches_an_f64_reference() -> candle_core::Result<()> {
        use super::add_bias;
        use candle_core::{DType, Device, Tensor, Var};
        let dev = Device::Cpu;
        let draw = |n: usize, seed: u64| -> Vec<f32> {
            let mut s = seed;
            (0..n)
                .map(|_| {
                    s = s
                        .wrapping_mul(6_364_136_223_846_793_005)
                        .wrapping_add(1_442_695);
                    ((s >> 40) as f32 / (1u64 << 23) as f32 - 1.0) * 3.0
                })
                .collect()
        };
        let cases: [(&[usize], usize); 5] = [
            (&[3, 5, 4, 2], 1),
            (&[7, 300], 1),
            (&[2, 4, 9], 1),
            (&[6], 0),
            (&[4, 3, 2], 2),
        ];
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (case, &(dims, dim)) in cases.iter().enumerate() {
                for strided in [false, true] {
                    let n: usize = dims.iter().product();
                    let y = Tensor::from_vec(draw(n, case as u64 + 1), dims, &dev)?;
                    // The same values through a transposed view when asked (rank >= 2).
                    let y = if strided && dims.len() >= 2 {
                        y.t()?.contiguous()?.t()?
                    } else {
                        y
                    };
                    let y = Var::from_tensor(&y.to_dtype(dtype)?)?;
                    let c = dims[dim];
                    let b = Var::new(draw(c, 99 + case as u64), &dev)?;
                    let out = add_bias(&y, &b, dim)?;
                    assert_eq!((out.dtype(), out.dims()), (dtype, dims));
                    // Reference: the bias rounded to the dtype; y and b are then f32 values,
                    // so their f32 sum is the exact sum rounded to f32; then one rounding to
                    // the dtype.
                    let inner: usize = dims[dim + 1..].iter().product();
                    let ys = y.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let bs = b.to_dtype(dtype)?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
                    let channel = |i: usize| (i / inner) % c;
                    let expect: Vec<f32> = ys
                        .iter()
                        .enumerate()
                        .map(|(i, &v)| v + bs[channel(i)])
                        .collect();
                    let expect = Tensor::new(expect, &dev)?
                        .to_dtype(dtype)?
                        .to_dtype(DType::F32)?;
                    let got = out.to_dtype(DType::F32)?.flatten_all()?;
                    let bits = |t: &Tensor| -> candle_core::Result<Vec<u32>> {
                        Ok(t.to_vec1::<f32>()?.iter().map(|v| v.to_bits()).collect())
                    };
                    assert_eq!(bits(&got)?, bits(&expect)?, "{dtype:?} {dims:?} dim {dim}");

                    let w = Tensor::from_vec(draw(n, 7 + case as u64), dims, &dev)?;
                    let grads = (out.to_dtype(DType::F32)? * &w)?.sum_all()?.backward()?;
                    let dy = grads.get(&y).expect("a gradient for y");
                    let dout = w.to_dtype(dtype)?; // candle's to_dtype backward rounds
                    assert_eq!(dy.dtype(), dtype);
                    assert_eq!(
                        bits(&dy.to_dtype(DType::F32)?.flatten_all()?)?,
                        bits(&dout.to_dtype(DType::F32)?.flatten_all()?)?
                    );
                    let dout = dout.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
                    let mut exact = vec![0f64; c];
                    let mut scale = vec![0f64; c];
                    for (i, &g) in dout.iter().enumerate() {
                        exact[channel(i)] += f64::from(g);
                        scale[channel(i)] += f64::from(g.abs());
                    }
                    let db = grads.get(&b).expect("a gradient for b").to_vec1::<f32>()?;
                    for ((&got, &want), &scale) in db.iter().zip(&exact).zip(&scale) {
                        let tol = 1e-6 * scale + f64::from(f32::EPSILON) * want.abs();
                        assert!((f64::from(got) - want).abs() <= tol, "{got} vs {want}");
                    }
                }
            }
        }
        Ok(())
    }
}
