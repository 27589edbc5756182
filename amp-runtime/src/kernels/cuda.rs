//! The CUDA backend of [`super::unscale::unscale_in_place`]: one kernel launch per gradient
//! dtype multiplies every gradient by `inv_scale` in place and records, per gradient, whether it
//! held a non-finite value. The flags stay on the device until the one read-back the API needs
//! (the caller must learn whether to skip the step, as PyTorch's `scaler.step` does with its
//! `.item()`), so a training step has no other host synchronisation.
//!
//! The kernel sources (`unscale.cu`, and `batch_norm.cu` for `kernels::batch_norm`, each after
//! `half.cuh`) are compiled at run time by NVRTC, once per process ([`Module`]); building the
//! crate needs no CUDA toolkit, and neither does the CPU path.
//!
//! Gradients are borrowed together through nested `inplace_op1` calls (the CPU pass does the
//! same): each frame holds one storage's write guard, so candle's event tracking orders the
//! launch after earlier work on every gradient and later work after it.

use std::cell::RefCell;
use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::{CudaStorageSlice, WrapErr};
use candle_core::{CudaDevice, CudaStorage, DType, InplaceOp1, Layout, Result, Tensor};

/// A CUDA C source of this crate, compiled by NVRTC on first use (after `half.cuh`, the half and
/// bfloat16 conversions every source shares) and loaded by candle under `name`.
pub(crate) struct Module {
    pub name: &'static str,
    source: &'static str,
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Module {
    const fn new(name: &'static str, source: &'static str) -> Self {
        Self {
            name,
            source,
            ptx: OnceLock::new(),
        }
    }

    /// The module's PTX, compiled on first use.
    pub(crate) fn ptx(&self) -> Result<&str> {
        self.ptx
            .get_or_init(|| {
                nvrtc::compile_ptx(format!("{}\n{}", include_str!("half.cuh"), self.source))
                    .map(|ptx| ptx.to_src())
                    .map_err(|e| e.to_string())
            })
            .as_deref()
            .map_err(|e| {
                candle_core::Error::Msg(format!("NVRTC could not compile {}: {e}", self.name))
            })
    }
}

/// The multi-tensor unscale (`unscale.cu`).
pub(crate) static UNSCALE: Module = Module::new("candle_amp_unscale", include_str!("unscale.cu"));

/// Batch norm's per-channel sums and affine pass, and the bias add (`batch_norm.cu`).
pub(crate) static BATCH_NORM: Module =
    Module::new("candle_amp_batch_norm", include_str!("batch_norm.cu"));

/// The activations and their gradients (`activation.cu`).
pub(crate) static ACTIVATION: Module =
    Module::new("candle_amp_activation", include_str!("activation.cu"));

/// The dtype code of the kernels that take f32, f16 or bf16 arrays (`dt` in `half.cuh`).
pub(crate) fn code(dtype: DType) -> Result<i32> {
    match dtype {
        DType::F32 => Ok(0),
        DType::F16 => Ok(1),
        DType::BF16 => Ok(2),
        other => candle_core::bail!("cuda kernel: f32, f16 or bf16, got {other:?}"),
    }
}

/// The address of the first element of a contiguous f32, f16 or bf16 storage, and the guard
/// that orders the launch after earlier writes to it (drop it after the launch).
pub(crate) fn address<'a>(
    storage: &'a CudaStorage,
    layout: &Layout,
    stream: &'a CudaStream,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let Some((start, _)) = layout.contiguous_offsets() else {
        candle_core::bail!("cuda kernel: inputs must be contiguous")
    };
    let (base, guard) = match &storage.slice {
        CudaStorageSlice::F32(s) => s.device_ptr(stream),
        CudaStorageSlice::F16(s) => s.device_ptr(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr(stream),
        _ => candle_core::bail!("cuda kernel: f32, f16 or bf16 storage expected"),
    };
    Ok((
        base + (start * storage.dtype().size_in_bytes()) as u64,
        guard,
    ))
}

/// The address of an optional array read beside `x` (a gradient), which must have `x`'s dtype
/// and shape: 0 and no guard when there is none.
pub(crate) fn address_like<'a>(
    array: Option<(&'a CudaStorage, &Layout)>,
    x: &CudaStorage,
    lx: &Layout,
    stream: &'a CudaStream,
) -> Result<(u64, Option<SyncOnDrop<'a>>)> {
    let Some((s, l)) = array else {
        return Ok((0, None));
    };
    if s.dtype() != x.dtype() || l.shape() != lx.shape() {
        candle_core::bail!("cuda kernel: the gradient and the input differ in dtype or shape")
    }
    let (p, guard) = address(s, l, stream)?;
    Ok((p, Some(guard)))
}

/// The launch of a grid-stride loop over `n` values: `threads` per block, enough blocks to fill
/// the GPU, at most one per `threads` values.
pub(crate) fn grid_stride(n: u64, threads: u32) -> LaunchConfig {
    let blocks = n.div_ceil(u64::from(threads)).min(1 << 16) as u32;
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A fresh storage of `len` values of `dtype` (f32, f16 or bf16), to be written whole by the
/// caller's kernel before anything reads it.
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    // SAFETY: every caller's kernel writes each element before the storage is read.
    Ok(match dtype {
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(len) }?, dev.clone()),
        DType::F16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(len) }?, dev.clone())
        }
        DType::BF16 => {
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::bf16>(len) }?, dev.clone())
        }
        other => candle_core::bail!("cuda kernel: f32, f16 or bf16, got {other:?}"),
    })
}

/// The writable address of a storage made by [`alloc`], and its guard (drop it after the
/// launch).
pub(crate) fn out_address<'a>(
    out: &'a mut CudaStorage,
    stream: &'a CudaStream,
) -> (u64, SyncOnDrop<'a>) {
    match &mut out.slice {
        CudaStorageSlice::F32(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::F16(s) => s.device_ptr_mut(stream),
        CudaStorageSlice::BF16(s) => s.device_ptr_mut(stream),
        _ => unreachable!("alloc makes f32, f16 or bf16"),
    }
}

/// Elements per block: one block walks its chunk with `THREADS` threads.
pub(crate) const CHUNK: usize = 1 << 16;
const THREADS: u32 = 512;

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
    with_views(grads, &mut Vec::with_capacity(grads.len()), &mut launch)?;
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
            grid_dim: (chunk_tensor.len() as u32, 1, 1),
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

/// Borrows one storage and recurses into the rest (see the module docs).
struct Borrow<'a> {
    rest: &'a [Tensor],
    views: RefCell<&'a mut Vec<View>>,
    body: RefCell<&'a mut Body<'a>>,
}

/// The work done while every storage is borrowed.
type Body<'a> = dyn FnMut(&[View]) -> Result<()> + 'a;

impl InplaceOp1 for Borrow<'_> {
    fn name(&self) -> &'static str {
        "amp-cuda-multi-tensor-borrow"
    }

    fn cpu_fwd(&self, _: &mut candle_core::CpuStorage, _: &Layout) -> Result<()> {
        candle_core::bail!("cuda unscale: a CPU gradient reached the CUDA pass")
    }

    fn cuda_fwd(&self, storage: &mut CudaStorage, layout: &Layout) -> Result<()> {
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
        let view = View {
            ptr: base + (start * dtype.size_in_bytes()) as u64,
            len: end - start,
            dtype,
        };
        let mut views = self.views.borrow_mut();
        views.push(view);
        let mut body = self.body.borrow_mut();
        let result = with_views(self.rest, &mut views, &mut **body);
        views.pop();
        result
    }
}

/// Runs `body` with every tensor's storage write-borrowed at once.
fn with_views(tensors: &[Tensor], views: &mut Vec<View>, body: &mut Body<'_>) -> Result<()> {
    match tensors.split_first() {
        None => body(views),
        Some((first, rest)) => first.inplace_op1(&Borrow {
            rest,
            views: RefCell::new(views),
            body: RefCell::new(body),
        }),
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

    /// NVRTC accepts the kernel sources (needs the NVRTC library, not a GPU).
    #[test]
    fn kernels_compile_with_nvrtc() {
        let ptx = UNSCALE.ptx().unwrap();
        for dtype in ["f32", "f64", "f16", "bf16"] {
            assert!(
                ptx.contains(&format!(".entry amp_unscale_{dtype}(")),
                "{dtype} kernel missing from the PTX"
            );
        }
        let ptx = BATCH_NORM.ptx().unwrap();
        for kernel in ["amp_bn_sums", "amp_bn_apply", "amp_bias_add"] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
        assert!(ACTIVATION.ptx().unwrap().contains(".entry amp_activation("));
    }
}
