//! The CUDA launches of the optimizers' in-place updates (`optim.cu`): one grid-stride kernel
//! per parameter and step for SGD, two for AdamW (its moments, then the parameter), where
//! candle's tensor ops took three and about fifteen launches, each with an allocation.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtrMut, PushKernelArg, SyncOnDrop};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaStorage, DType, Layout, Result};

use super::{address, code, grid_stride, Module};

/// Threads per block of the grid-stride launches.
const THREADS: u32 = 256;

/// The optimizers' updates (`optim.cu`).
pub(crate) static OPTIM: Module = Module::new("candle_amp_optim", include_str!("optim.cu"), &[]);

/// The writable address of the first element of a contiguous f32, f16 or bf16 storage, with the
/// guard that orders the launch after earlier work on it.
fn address_mut<'a>(
    s: &'a mut CudaStorage,
    l: &Layout,
    stream: &'a candle_core::cuda_backend::cudarc::driver::CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Some((start, _)) = l.contiguous_offsets() else {
        candle_core::bail!("optimizer step: the parameter must be contiguous")
    };
    let size = s.dtype().size_in_bytes();
    let (base, guard) = match &mut s.slice {
        CudaStorageSlice::F32(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr_mut(stream),
        _ => candle_core::bail!("optimizer step: f32, f16 or bf16 storage expected"),
    };
    Ok((base + (start * size) as u64, guard))
}

/// Checks that `other` holds `n` values of `dtype`.
fn check(what: &str, other: &Layout, dtype: DType, other_dtype: DType, n: usize) -> Result<()> {
    if other.shape().elem_count() != n || other_dtype != dtype {
        candle_core::bail!(
            "optimizer step: the {what} ({:?}, {other_dtype:?}) does not match the {n} values of \
             {dtype:?} it updates",
            other.dims()
        )
    }
    Ok(())
}

/// One launch of an `optim.cu` kernel `(dst, src, dt, n, consts...)` over `n` values: `dst`
/// written in place, `src` read, `dt` the dtype code of whichever of the two holds the
/// parameter's or gradient's dtype (`dt_of`), the other f32.
fn launch(
    kernel: &str,
    (dst, ldst): (&mut CudaStorage, &Layout),
    (src, lsrc): (&CudaStorage, &Layout),
    dt_of: DType,
    n: usize,
    consts: &[f32],
) -> Result<()> {
    if n == 0 {
        return Ok(());
    }
    let dev = dst.device.clone();
    let stream = dev.cuda_stream();
    let dt = code(dt_of)?;
    let (sp, _s_guard) = address(src, lsrc, &stream)?;
    let (dp, d_guard) = address_mut(dst, ldst, &stream)?;
    let n64 = n as u64;
    let func = dev.get_or_load_custom_func(kernel, OPTIM.name, OPTIM.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&dp);
    builder.arg(&sp);
    builder.arg(&dt);
    builder.arg(&n64);
    for c in consts {
        builder.arg(c);
    }
    // SAFETY: the arguments match the kernel's (each caller passes its constants); `dp` and
    // `sp` address the values each kernel reads for `n` (checked by the callers: `n` of `dt`'s
    // dtype, or 2 * `n` f32 moments) in storages held for the launch, `dp` writable and
    // distinct from `sp` (a `&mut` and a `&` storage).
    unsafe { builder.launch(grid_stride(n64, THREADS)) }.w()?;
    drop(d_guard);
    Ok(())
}

/// `w -= g * lr` in place (`amp_sgd`).
pub(crate) fn sgd(
    w: &mut CudaStorage,
    lw: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    lr: f32,
) -> Result<()> {
    let n = lw.shape().elem_count();
    check("gradient", lg, w.dtype(), g.dtype(), n)?;
    let dtype = w.dtype();
    launch("amp_sgd", (w, lw), (g, lg), dtype, n, &[lr])
}

/// AdamW's moments `mv` (`(2, n)` f32: m, then v) moved by the gradient `g`
/// (`amp_adamw_moments`), `consts` = `[beta1, 1 - beta1, beta2, 1 - beta2]`.
pub(crate) fn adamw_moments(
    mv: &mut CudaStorage,
    lmv: &Layout,
    g: &CudaStorage,
    lg: &Layout,
    consts: [f32; 4],
) -> Result<()> {
    let n = lg.shape().elem_count();
    check("moments", lmv, DType::F32, mv.dtype(), 2 * n)?;
    launch(
        "amp_adamw_moments",
        (mv, lmv),
        (g, lg),
        g.dtype(),
        n,
        &consts,
    )
}

/// AdamW's step of the parameter `w` from the moments `mv` (`amp_adamw_apply`), `consts` =
/// `[lr, decay, scale_m, scale_v, eps]`.
pub(crate) fn adamw_apply(
    w: &mut CudaStorage,
    lw: &Layout,
    mv: &CudaStorage,
    lmv: &Layout,
    consts: [f32; 5],
) -> Result<()> {
    let n = lw.shape().elem_count();
    check("moments", lmv, DType::F32, mv.dtype(), 2 * n)?;
    let dtype = w.dtype();
    launch("amp_adamw_apply", (w, lw), (mv, lmv), dtype, n, &consts)
}
