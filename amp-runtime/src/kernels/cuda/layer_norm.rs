//! The CUDA launches of layer norm and RMS norm (`layer_norm.cu`, `rms` its flag): the forward from f32, f16 or bf16 rows
//! with f32 scale and shift into f32, one block per row; the backward into one flat f32
//! `[dx | dw | db]`, as the CPU op returns it: the rows' `dx` (saving each row's mean and
//! `rstd`), then `dw` and `db` one thread per column down the rows.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

use super::{address, alloc, block_per_row, code, grid_stride, out_address, Module};

/// Threads per block (one block per row; the column pass's blocks too).
const THREADS: u32 = 256;

/// Layer norm and its gradients (`layer_norm.cu`).
pub(crate) static LAYER_NORM: Module =
    Module::new("candle_amp_layer_norm", include_str!("layer_norm.cu"), &[]);

/// The row length `n` (the scale's) and the number of rows of `x`.
fn rows_of(lx: &Layout, lw: &Layout) -> Result<(u64, u64)> {
    let n = lw.shape().elem_count();
    if lx.dims().last() != Some(&n) {
        candle_core::bail!(
            "layer norm kernel: rows of {n} values expected, got {:?}",
            lx.dims()
        )
    }
    Ok(((lx.shape().elem_count() / n.max(1)) as u64, n as u64))
}

/// `(x - mean) * rstd * w + b` per row, in f32.
pub(crate) fn forward(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (b, lb): (&CudaStorage, &Layout),
    eps: f32,
    rms: bool,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let (rows, n) = rows_of(lx, lw)?;
    let mut out = alloc(dev, DType::F32, lx.shape().elem_count())?;
    if rows == 0 || n == 0 {
        return Ok((out, lx.shape().clone()));
    }
    let stream = dev.cuda_stream();
    let (dt, rms) = (code(x.dtype())?, i32::from(rms));
    let (xp, _x) = address(x, lx, &stream)?;
    let (wp, _w) = address(w, lw, &stream)?;
    let (bp, _b) = address(b, lb, &stream)?;
    let (yp, out_guard) = out_address(&mut out, &stream);
    let func = dev.get_or_load_custom_func("amp_layer_norm", LAYER_NORM.name, LAYER_NORM.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&wp);
    builder.arg(&bp);
    builder.arg(&yp);
    builder.arg(&dt);
    builder.arg(&eps);
    builder.arg(&rms);
    builder.arg(&rows);
    builder.arg(&n);
    // SAFETY: the arguments match `amp_layer_norm`; `xp` addresses `rows * n` values of dtype
    // `dt`, `wp` and `bp` `n` f32 and `yp` `rows * n` f32 (freshly allocated), each held for
    // the launch.
    unsafe { builder.launch(block_per_row(rows, THREADS)) }.w()?;
    drop(out_guard);
    Ok((out, lx.shape().clone()))
}

/// `[dx | dw | db]` flat in f32 from `x`, the scale `w` and the output's f32 gradient `dy`.
pub(crate) fn backward(
    (x, lx): (&CudaStorage, &Layout),
    (w, lw): (&CudaStorage, &Layout),
    (dy, ldy): (&CudaStorage, &Layout),
    eps: f32,
    rms: bool,
) -> Result<(CudaStorage, Shape)> {
    if dy.dtype() != DType::F32 || ldy.shape() != lx.shape() {
        candle_core::bail!("layer norm gradient kernel: an f32 gradient of the input's shape")
    }
    let dev = &x.device;
    let (rows, n) = rows_of(lx, lw)?;
    let len = lx.shape().elem_count() + 2 * n as usize;
    let mut out = alloc(dev, DType::F32, len)?;
    let mut stats = alloc(dev, DType::F32, 2 * rows as usize)?;
    if n == 0 {
        return Ok((out, Shape::from(len)));
    }
    let stream = dev.cuda_stream();
    let (dt, rms) = (code(x.dtype())?, i32::from(rms));
    let (xp, _x) = address(x, lx, &stream)?;
    let (wp, _w) = address(w, lw, &stream)?;
    let (dyp, _dy) = address(dy, ldy, &stream)?;
    let (op, out_guard) = out_address(&mut out, &stream);
    let (sp, stats_guard) = out_address(&mut stats, &stream);
    if rows > 0 {
        let func = dev.get_or_load_custom_func(
            "amp_layer_norm_grad_rows",
            LAYER_NORM.name,
            LAYER_NORM.ptx()?,
        )?;
        let mut builder = func.builder();
        builder.arg(&xp);
        builder.arg(&wp);
        builder.arg(&dyp);
        builder.arg(&op);
        builder.arg(&sp);
        builder.arg(&dt);
        builder.arg(&eps);
        builder.arg(&rms);
        builder.arg(&rows);
        builder.arg(&n);
        // SAFETY: the arguments match `amp_layer_norm_grad_rows`; `xp` addresses `rows * n`
        // values of dtype `dt`, `wp` `n` f32, `dyp` `rows * n` f32, `op` the `rows * n + 2n`
        // f32 of `out` and `sp` the `2 rows` f32 of `stats` (both fresh), held for the launch.
        unsafe { builder.launch(block_per_row(rows, THREADS)) }.w()?;
    }
    // dw and db after dx: `4 * rows * n` and `4 * (rows * n + n)` bytes into `out`.
    let (dwp, dbp) = (op + 4 * rows * n, op + 4 * (rows * n + n));
    let func = dev.get_or_load_custom_func(
        "amp_layer_norm_grad_cols",
        LAYER_NORM.name,
        LAYER_NORM.ptx()?,
    )?;
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&dyp);
    builder.arg(&sp);
    builder.arg(&dwp);
    builder.arg(&dbp);
    builder.arg(&dt);
    builder.arg(&rows);
    builder.arg(&n);
    // SAFETY: the arguments match `amp_layer_norm_grad_cols`; `dwp` and `dbp` address the
    // last `2n` f32 of `out`, `sp` the stats the row pass wrote (same stream, in order), the
    // rest as above.
    unsafe { builder.launch(grid_stride(n, THREADS)) }.w()?;
    drop(stats_guard);
    drop(out_guard);
    Ok((out, Shape::from(len)))
}
