//! The CUDA launch of the widening sum (`binary.cu`): an f32 and a half operand of one shape
//! summed in f32, one grid-stride kernel.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape};

use super::{address, alloc, code, grid_stride, out_address, Module};

/// Threads per block of the grid-stride launch.
const THREADS: u32 = 256;

/// The widening sum (`binary.cu`).
pub(crate) static BINARY: Module = Module::new("candle_amp_binary", include_str!("binary.cu"), &[]);

/// `x + sign * y` in f32 for contiguous `x` and `y` of one shape (f32, f16 or bf16 each).
pub(crate) fn widening_sum(
    (x, lx): (&CudaStorage, &Layout),
    (y, ly): (&CudaStorage, &Layout),
    sign: f32,
) -> Result<(CudaStorage, Shape)> {
    if lx.shape() != ly.shape() {
        candle_core::bail!("widening sum kernel: operands of one shape")
    }
    let dev = &x.device;
    let n = lx.shape().elem_count();
    let mut out = alloc(dev, DType::F32, n)?;
    if n == 0 {
        return Ok((out, lx.shape().clone()));
    }
    let stream = dev.cuda_stream();
    let (dtx, dty) = (code(x.dtype())?, code(y.dtype())?);
    let (xp, _x_guard) = address(x, lx, &stream)?;
    let (yp, _y_guard) = address(y, ly, &stream)?;
    let (outp, out_guard) = out_address(&mut out, &stream);
    let n64 = n as u64;
    let func = dev.get_or_load_custom_func("amp_widening_sum", BINARY.name, BINARY.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&dtx);
    builder.arg(&yp);
    builder.arg(&dty);
    builder.arg(&outp);
    builder.arg(&sign);
    builder.arg(&n64);
    // SAFETY: the arguments match `amp_widening_sum`; `xp` and `yp` address `n` values of
    // dtypes `dtx` and `dty`, `outp` `n` f32 values (freshly allocated), each held for the
    // launch.
    unsafe { builder.launch(grid_stride(n64, THREADS)) }.w()?;
    drop(out_guard);
    Ok((out, lx.shape().clone()))
}
