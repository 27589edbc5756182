//! The CUDA launches of softmax and log-softmax over the last dimension (`softmax.cu`): the
//! forward from f32, f16 or bf16 into f32, and the backward from the f32 output and its
//! gradient into the input's dtype, one block per row.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

use super::{address, alloc, block_per_row, code, out_address, Module};

/// Threads per block (one block per row).
const THREADS: u32 = 256;

/// Softmax and its gradient (`softmax.cu`).
pub(crate) static SOFTMAX: Module =
    Module::new("candle_amp_softmax", include_str!("softmax.cu"), &[]);

/// Rows and row length of a contiguous layout.
fn rows_of(l: &Layout) -> (u64, u64) {
    let n = l.dims().last().copied().unwrap_or(1);
    let rows = l.shape().elem_count().checked_div(n).unwrap_or(0);
    (rows as u64, n as u64)
}

/// Softmax (log-softmax with `log`) of `x` over its last dimension, in f32.
pub(crate) fn forward(x: &CudaStorage, lx: &Layout, log: bool) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let mut out = alloc(dev, DType::F32, lx.shape().elem_count())?;
    let (rows, n) = rows_of(lx);
    if rows == 0 || n == 0 {
        return Ok((out, lx.shape().clone()));
    }
    let stream = dev.cuda_stream();
    let dt = code(x.dtype())?;
    let log = i32::from(log);
    let (xp, _x_guard) = address(x, lx, &stream)?;
    let (yp, out_guard) = out_address(&mut out, &stream);
    let func = dev.get_or_load_custom_func("amp_softmax", SOFTMAX.name, SOFTMAX.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&yp);
    builder.arg(&dt);
    builder.arg(&log);
    builder.arg(&rows);
    builder.arg(&n);
    // SAFETY: the arguments match `amp_softmax`; `xp` addresses `rows * n` values of dtype
    // `dt` and `yp` as many f32 (freshly allocated), each held for the launch.
    unsafe { builder.launch(block_per_row(rows, THREADS)) }.w()?;
    drop(out_guard);
    Ok((out, lx.shape().clone()))
}

/// The gradient of the input (of dtype `dtype`) from the forward's f32 output `y` and its f32
/// gradient `dy`, of one shape.
pub(crate) fn backward(
    (y, ly): (&CudaStorage, &Layout),
    (dy, ldy): (&CudaStorage, &Layout),
    dtype: DType,
    log: bool,
) -> Result<(CudaStorage, Shape)> {
    if y.dtype() != DType::F32 || dy.dtype() != DType::F32 || ly.shape() != ldy.shape() {
        candle_core::bail!("softmax gradient kernel: an f32 output and gradient of one shape")
    }
    let dev = &y.device;
    let mut out = alloc(dev, dtype, ly.shape().elem_count())?;
    let (rows, n) = rows_of(ly);
    if rows == 0 || n == 0 {
        return Ok((out, ly.shape().clone()));
    }
    let stream = dev.cuda_stream();
    let dt = code(dtype)?;
    let log = i32::from(log);
    let (yp, _y_guard) = address(y, ly, &stream)?;
    let (dyp, _dy_guard) = address(dy, ldy, &stream)?;
    let (dxp, out_guard) = out_address(&mut out, &stream);
    let func = dev.get_or_load_custom_func("amp_softmax_grad", SOFTMAX.name, SOFTMAX.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&yp);
    builder.arg(&dyp);
    builder.arg(&dxp);
    builder.arg(&dt);
    builder.arg(&log);
    builder.arg(&rows);
    builder.arg(&n);
    // SAFETY: the arguments match `amp_softmax_grad`; `yp` and `dyp` address `rows * n` f32
    // values and `dxp` as many of dtype `dt` (freshly allocated), each held for the launch.
    unsafe { builder.launch(block_per_row(rows, THREADS)) }.w()?;
    drop(out_guard);
    Ok((out, ly.shape().clone()))
}
