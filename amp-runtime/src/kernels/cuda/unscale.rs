//! The CUDA backend of [`crate::kernels::unscale::unscale_in_place`]: one kernel launch per
//! gradient dtype multiplies every gradient by `inv_scale` in place and records, per gradient,
//! whether it held a non-finite value. The flags stay on the device until the one read-back the
//! API needs (the caller must learn whether to skip the step, as PyTorch's `scaler.step` does
//! with its `.item()`), so a training step has no other host synchronisation.
//!
//! Gradients are borrowed together by [`crate::kernels::borrow`], as the CPU pass borrows them:
//! each frame holds one storage's write guard, so candle's event tracking orders the launch
//! after earlier work on every gradient and later work after it.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Tensor};

use super::{grid_dim, Module};
use crate::kernels::borrow::{with_borrowed, Borrowed};

/// Threads per block of `unscale.cu`'s kernels (they stride by `blockDim.x`).
const THREADS: u32 = 512;

/// The multi-tensor unscale (`unscale.cu`).
pub(crate) static UNSCALE: Module =
    Module::new("candle_amp_unscale", include_str!("unscale.cu"), &[]);

/// Elements per block: one block walks its chunk with `THREADS` threads.
pub(crate) const CHUNK: usize = 1 << 16;

/// The per-block table of one launch: chunk `c` covers elements `starts[c]..` of gradient
/// `tensors[c]` (at most `chunk` of them). Empty gradients get no chunk.
pub(crate) fn chunk_table(lens: &[usize], chunk: usize) -> (Vec<u32>, Vec<u64>) {
    let mut tensors = Vec::new();
    let mut starts = Vec::new();
    for (t, &len) in lens.iter().enumerate() {
        for start in (0..len).step_by(chunk) {
            tensors.push(t as u32);
            starts.push(start as u64);
        }
    }
    (tensors, starts)
}

/// One borrowed gradient: the address of its first element, its length and dtype.
#[derive(Clone, Copy, Debug)]
struct View {
    ptr: u64,
    len: usize,
    dtype: DType,
}

/// Multiplies contiguous CUDA gradients of one device (with distinct storages) by `inv_scale`
/// in place; returns per gradient whether it held a non-finite value.
pub(crate) fn unscale(grads: &[Tensor], inv_scale: f32) -> Result<Vec<bool>> {
    let Some(first) = grads.first() else {
        return Ok(Vec::new());
    };
    let candle_core::Device::Cuda(dev) = first.device() else {
        candle_core::bail!("cuda unscale: gradients must be on a CUDA device")
    };
    let dev = dev.clone();
    let found = dev.alloc_zeros::<u32>(grads.len())?;
    let mut launch = |views: &[View]| launch_all(&dev, views, inv_scale, &found);
    with_borrowed(grads, &mut launch)?;
    let flags = dev.clone_dtoh(&found)?;
    Ok(flags.into_iter().map(|f| f != 0).collect())
}

/// One launch per dtype present among `views`.
fn launch_all(
    dev: &CudaDevice,
    views: &[View],
    inv_scale: f32,
    found: &CudaSlice<u32>,
) -> Result<()> {
    let stream = dev.cuda_stream();
    for dtype in [DType::F32, DType::F16, DType::BF16, DType::F64] {
        let group: Vec<(usize, &View)> = views
            .iter()
            .enumerate()
            .filter(|(_, v)| v.dtype == dtype)
            .collect();
        if group.is_empty() {
            continue;
        }
        let ptrs: Vec<u64> = group.iter().map(|(_, v)| v.ptr).collect();
        let lens: Vec<usize> = group.iter().map(|(_, v)| v.len).collect();
        let flag_index: Vec<u32> = group.iter().map(|&(i, _)| i as u32).collect();
        let (chunk_tensor, chunk_start) = chunk_table(&lens, CHUNK);
        if chunk_tensor.is_empty() {
            continue;
        }
        let lens: Vec<u64> = lens.iter().map(|&l| l as u64).collect();
        let d_ptrs = stream.clone_htod(&ptrs).w()?;
        let d_lens = stream.clone_htod(&lens).w()?;
        let d_flag_index = stream.clone_htod(&flag_index).w()?;
        let d_chunk_tensor = stream.clone_htod(&chunk_tensor).w()?;
        let d_chunk_start = stream.clone_htod(&chunk_start).w()?;
        let func = dev.get_or_load_custom_func(
            &format!("amp_unscale_{}", dtype.as_str()),
            UNSCALE.name,
            UNSCALE.ptx()?,
        )?;
        let chunk = CHUNK as u32;
        let cfg = LaunchConfig {
            grid_dim: (grid_dim(chunk_tensor.len(), "gradient chunks")?, 1, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = func.builder();
        builder.arg(&d_ptrs);
        builder.arg(&d_lens);
        builder.arg(&d_flag_index);
        builder.arg(&d_chunk_tensor);
        builder.arg(&d_chunk_start);
        builder.arg(&chunk);
        builder.arg(&inv_scale);
        builder.arg(found);
        // SAFETY: the argument list matches `AMP_UNSCALE_ARGS` in unscale.cu; every pointer in
        // `d_ptrs` addresses `lens[t]` elements of a storage write-borrowed by a frame of
        // `with_views`, all distinct (the caller's contract), and the chunks of one gradient are
        // disjoint.
        unsafe { builder.launch(cfg) }.w()?;
    }
    Ok(())
}

impl Borrowed for View {
    fn cuda(
        storage: &mut CudaStorage,
        layout: &Layout,
        then: &mut dyn FnMut(Self) -> Result<()>,
    ) -> Result<()> {
        let Some((start, end)) = layout.contiguous_offsets() else {
            candle_core::bail!("cuda unscale: gradients must be contiguous")
        };
        let dtype = storage.dtype();
        let stream = storage.device.cuda_stream();
        let (base, _write_guard) = match &mut storage.slice {
            CudaStorageSlice::F32(s) => s.device_ptr_mut(&stream),
            CudaStorageSlice::F64(s) => s.device_ptr_mut(&stream),
            CudaStorageSlice::F16(s) => s.device_ptr_mut(&stream),
            CudaStorageSlice::BF16(s) => s.device_ptr_mut(&stream),
            _ => candle_core::bail!("cuda unscale: gradients must be f32, f64, f16 or bf16"),
        };
        then(View {
            ptr: base + (start * dtype.size_in_bytes()) as u64,
            len: end - start,
            dtype,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunk_table_covers_every_element_once() {
        let lens = [0, 1, CHUNK, CHUNK + 1, 3 * CHUNK - 5];
        let (tensors, starts) = chunk_table(&lens, CHUNK);
        // ceil(len / CHUNK) chunks per gradient: 0, 1, 1, 2, 3.
        assert_eq!(tensors, [1, 2, 3, 3, 4, 4, 4]);
        let chunk = CHUNK as u64;
        assert_eq!(starts, [0, 0, 0, chunk, 0, chunk, 2 * chunk]);
    }
}
