//! The CUDA launch of the activations (`activation.cu`): one grid-stride kernel for every form,
//! forward and gradient, f32 arithmetic per element.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::PushKernelArg;
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, Layout, Result, Shape};

use super::{address, address_like, alloc, code, grid_stride, out_address, Module};

/// Threads per block of the grid-stride launch.
const THREADS: u32 = 256;

/// The activations and their gradients (`activation.cu`).
pub(crate) static ACTIVATION: Module =
    Module::new("candle_amp_activation", include_str!("activation.cu"), &[]);

/// `f(x)`, or `dy * f'(x)` with `dy`, into a fresh storage of `x`'s dtype; `form` is
/// `activation.cu`'s code of `f` (0 GELU tanh, 1 GELU erf, 2 SiLU, 3 ReLU).
pub(crate) fn run(
    form: i32,
    x: &CudaStorage,
    lx: &Layout,
    dy: Option<(&CudaStorage, &Layout)>,
) -> Result<(CudaStorage, Shape)> {
    let dev = &x.device;
    let n = lx.shape().elem_count();
    let mut out = alloc(dev, x.dtype(), n)?;
    if n == 0 {
        return Ok((out, lx.shape().clone()));
    }
    let stream = dev.cuda_stream();
    let dt = code(x.dtype())?;
    let (xp, _x_guard) = address(x, lx, &stream)?;
    let (dyp, _dy_guard) = address_like(dy, x, lx, &stream)?;
    let (out_ptr, out_guard) = out_address(&mut out, &stream);
    let n64 = n as u64;
    let func = dev.get_or_load_custom_func("amp_activation", ACTIVATION.name, ACTIVATION.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&dyp);
    builder.arg(&out_ptr);
    builder.arg(&dt);
    builder.arg(&form);
    builder.arg(&n64);
    // SAFETY: the arguments match `amp_activation`; `xp`, `dyp` (when not null) and
    // `out_ptr` address `n` values of the kernel's dtype in storages held for the launch
    // (`out` freshly allocated, distinct from the inputs).
    unsafe { builder.launch(grid_stride(n64, THREADS)) }.w()?;
    drop(out_guard); // ends the borrow of `out`
    Ok((out, lx.shape().clone()))
}
