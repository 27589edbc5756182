//! The CUDA launches of max pooling (`pool.cu`): the forward copies each window's maximum, the
//! backward adds each output's gradient at its window's maximum in f32 and rounds once, as the
//! CPU op (`kernels::pool`) does.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{DevicePtrMut, LaunchConfig, PushKernelArg};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result};

use super::{address, alloc, code, grid_stride, out_address, Module};

/// Threads per block of the grid-stride launches.
const THREADS: u32 = 256;

/// Max pooling forward and backward (`pool.cu`).
pub(crate) static POOL: Module = Module::new("candle_amp_pool", include_str!("pool.cu"), &[]);

/// One max pool's geometry: `planes` (batch x channels) of `h x w` values to `oh x ow`, windows
/// `kernel` at `stride`, `padding` on every side.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PoolShape {
    pub planes: usize,
    pub h: usize,
    pub w: usize,
    pub oh: usize,
    pub ow: usize,
    pub kernel: (usize, usize),
    pub stride: (usize, usize),
    pub padding: usize,
}

impl PoolShape {
    /// The sizes as the kernels' `unsigned int`s, or an error naming the one too large.
    fn sides(&self) -> Result<[u32; 9]> {
        let v = [
            self.h,
            self.w,
            self.oh,
            self.ow,
            self.kernel.0,
            self.kernel.1,
            self.stride.0,
            self.stride.1,
            self.padding,
        ];
        let mut out = [0u32; 9];
        for (o, v) in out.iter_mut().zip(v) {
            *o = u32::try_from(v).map_err(|_| {
                candle_core::Error::Msg(format!("max pool kernel: {self:?} is too large"))
            })?;
        }
        Ok(out)
    }

    fn outputs(&self) -> u64 {
        (self.planes * self.oh * self.ow) as u64
    }
}

/// Pushes the geometry's arguments (`AMP_POOL_ARGS` of `pool.cu`): the planes, then the sides.
fn push_shape<'a>(
    builder: &mut candle_core::cuda_backend::cudarc::driver::LaunchArgs<'a>,
    (planes, sides): &'a (u64, [u32; 9]),
) {
    builder.arg(planes);
    for s in sides {
        builder.arg(s);
    }
}

/// The launch of one thread per output (grid-stride).
fn launch(shape: &PoolShape) -> LaunchConfig {
    grid_stride(shape.outputs(), THREADS)
}

/// `y` of the max pool of the contiguous `x`, in `x`'s dtype.
pub(crate) fn max_pool(x: &CudaStorage, lx: &Layout, shape: &PoolShape) -> Result<CudaStorage> {
    let dev = &x.device;
    let n = shape.planes * shape.oh * shape.ow;
    let mut out = alloc(dev, x.dtype(), n)?;
    if n == 0 {
        return Ok(out);
    }
    let stream = dev.cuda_stream();
    let dt = code(x.dtype())?;
    let geometry = (shape.planes as u64, shape.sides()?);
    let (xp, _x_guard) = address(x, lx, &stream)?;
    let (yp, out_guard) = out_address(&mut out, &stream);
    let func = dev.get_or_load_custom_func("amp_max_pool", POOL.name, POOL.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&yp);
    builder.arg(&dt);
    push_shape(&mut builder, &geometry);
    // SAFETY: the arguments match `amp_max_pool`; `xp` addresses `planes * h * w` values of
    // the kernel's dtype (the contiguous input of this shape), `yp` the `planes * oh * ow` of
    // the fresh `out`; each window is clipped to its plane.
    unsafe { builder.launch(launch(shape)) }.w()?;
    drop(out_guard); // ends the borrow of `out`
    Ok(out)
}

/// The input gradient of the max pool of `x` for the output gradient `dy` (both contiguous, of
/// one dtype), summed in f32 and rounded once to that dtype.
pub(crate) fn max_pool_grad(
    (x, lx): (&CudaStorage, &Layout),
    (dy, ldy): (&CudaStorage, &Layout),
    shape: &PoolShape,
) -> Result<CudaStorage> {
    let dev = &x.device;
    let n = shape.planes * shape.h * shape.w;
    if x.dtype() != dy.dtype() || ldy.shape().elem_count() != shape.planes * shape.oh * shape.ow {
        candle_core::bail!("max pool kernel: the gradient does not match the output")
    }
    let mut grad = dev.alloc_zeros::<f32>(n)?;
    if n > 0 && shape.outputs() > 0 {
        let stream = dev.cuda_stream();
        let dt = code(x.dtype())?;
        let geometry = (shape.planes as u64, shape.sides()?);
        let (xp, _x_guard) = address(x, lx, &stream)?;
        let (dyp, _dy_guard) = address(dy, ldy, &stream)?;
        let (gp, grad_guard) = grad.device_ptr_mut(&stream);
        let func = dev.get_or_load_custom_func("amp_max_pool_grad", POOL.name, POOL.ptx()?)?;
        let mut builder = func.builder();
        builder.arg(&xp);
        builder.arg(&dyp);
        builder.arg(&gp);
        builder.arg(&dt);
        push_shape(&mut builder, &geometry);
        // SAFETY: the arguments match `amp_max_pool_grad`; `xp` and `gp` address `planes * h *
        // w` values (of the kernel's dtype; f32), `dyp` `planes * oh * ow` (checked above);
        // every index a thread writes is inside its own plane.
        unsafe { builder.launch(launch(shape)) }.w()?;
        drop(grad_guard); // ends the borrow of `grad`
    }
    let grad = CudaStorage::wrap_cuda_slice(grad, dev.clone());
    if x.dtype() == DType::F32 {
        Ok(grad)
    } else {
        grad.to_dtype(&Layout::contiguous(n), x.dtype())
    }
}
