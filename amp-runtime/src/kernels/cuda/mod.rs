//! The CUDA side of the kernels: each op's launches in a file of their own beside the CUDA C
//! source it runs (`unscale`, `batch_norm`, `activation`, `pool`, `optim`, `softmax`, `layer_norm`,
//! `attention`, `binary`; `conv` calls cuDNN, feature
//! `cudnn`), and here what they share: NVRTC
//! compilation of the sources ([`Module`]), storage addresses with the guards that order
//! launches after earlier work, fresh outputs, and launch geometry.
//!
//! The sources are compiled at run time by NVRTC, once per process, each after `half.cuh`
//! (the half and bfloat16 conversions and the block reduction they share) and the `#define`s its [`Module`] names:
//! a block size the Rust launch and the CUDA code both depend on is defined once, in Rust,
//! and handed to the source. Building the crate needs no CUDA toolkit, and neither does the
//! CPU path.

pub(crate) mod activation;
pub(crate) mod attention;
pub(crate) mod batch_norm;
pub(crate) mod binary;
#[cfg(feature = "cudnn")]
pub(crate) mod conv;
pub(crate) mod layer_norm;
pub(crate) mod optim;
pub(crate) mod pool;
pub(crate) mod softmax;
pub(crate) mod unscale;

use std::sync::OnceLock;

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, SyncOnDrop,
};
use candle_core::cuda_backend::cudarc::nvrtc;
use candle_core::cuda_backend::CudaStorageSlice;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result};

/// A CUDA C source of this crate, compiled by NVRTC on first use (after `half.cuh`, the half and
/// bfloat16 conversions and the block reduction every source shares, and `defines`, each `#define NAME value`) and
/// loaded by candle under `name`.
#[derive(Debug)]
pub(crate) struct Module {
    pub name: &'static str,
    source: &'static str,
    defines: &'static [(&'static str, u32)],
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl Module {
    pub(crate) const fn new(
        name: &'static str,
        source: &'static str,
        defines: &'static [(&'static str, u32)],
    ) -> Self {
        Self {
            name,
            source,
            defines,
            ptx: OnceLock::new(),
        }
    }

    /// The text NVRTC compiles: the defines, `half.cuh`, the source.
    fn text(&self) -> String {
        use std::fmt::Write as _;
        let mut text = String::new();
        for (name, value) in self.defines {
            // Writing to a String cannot fail.
            let _ = writeln!(text, "#define {name} {value}");
        }
        let _ = write!(text, "{}\n{}", include_str!("half.cuh"), self.source);
        text
    }

    /// The module's PTX, compiled on first use.
    pub(crate) fn ptx(&self) -> Result<&str> {
        self.ptx
            .get_or_init(|| {
                nvrtc::compile_ptx(self.text())
                    .map(|ptx| ptx.to_src())
                    .map_err(|e| e.to_string())
            })
            .as_deref()
            .map_err(|e| {
                candle_core::Error::Msg(format!("NVRTC could not compile {}: {e}", self.name))
            })
    }
}

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
    let blocks =
        u32::try_from(n.div_ceil(u64::from(threads)).min(1 << 16)).expect("at most 2^16 blocks");
    LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// One block of `threads` per row of `rows`, at most 2^16 blocks (the kernels loop over the
/// rest): the row-wise reductions' launch (softmax, layer norm).
pub(crate) fn block_per_row(rows: u64, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (
            u32::try_from(rows.min(1 << 16)).expect("at most 2^16 blocks"),
            1,
            1,
        ),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// A fresh storage of `len` values of `dtype` (f32, f16 or bf16), to be written whole by the
/// caller's kernel before anything reads it.
pub(crate) fn alloc(dev: &CudaDevice, dtype: DType, len: usize) -> Result<CudaStorage> {
    // SAFETY (each `alloc` below): every caller's kernel writes each element before the
    // storage is read.
    Ok(match dtype {
        // SAFETY: see above.
        DType::F32 => CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<f32>(len) }?, dev.clone()),
        DType::F16 => {
            // SAFETY: see above.
            CudaStorage::wrap_cuda_slice(unsafe { dev.alloc::<half::f16>(len) }?, dev.clone())
        }
        DType::BF16 => {
            // SAFETY: see above.
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

/// A grid dimension of `n` blocks, or an error naming `what` when one launch cannot hold them.
pub(crate) fn grid_dim(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| {
        candle_core::Error::Msg(format!("cuda kernel: too many {what} for one launch ({n})"))
    })
}

#[cfg(test)]
mod tests {
    use super::{
        activation, attention, batch_norm, binary, layer_norm, optim, pool, softmax, unscale,
    };

    /// NVRTC accepts the kernel sources with their defines (needs the NVRTC library, not a GPU).
    #[test]
    fn kernels_compile_with_nvrtc() {
        let ptx = unscale::UNSCALE.ptx().unwrap();
        for dtype in ["f32", "f64", "f16", "bf16"] {
            assert!(
                ptx.contains(&format!(".entry amp_unscale_{dtype}(")),
                "{dtype} kernel missing from the PTX"
            );
        }
        let ptx = batch_norm::BATCH_NORM.ptx().unwrap();
        for kernel in [
            "amp_bn_sums",
            "amp_bn_stats",
            "amp_bn_grad_consts",
            "amp_bn_apply",
            "amp_bias_add",
        ] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
        assert!(activation::ACTIVATION
            .ptx()
            .unwrap()
            .contains(".entry amp_activation("));
        assert!(attention::ATTENTION
            .ptx()
            .unwrap()
            .contains(".entry amp_attention_probs("));
        assert!(binary::BINARY
            .ptx()
            .unwrap()
            .contains(".entry amp_widening_sum("));
        let ptx = optim::OPTIM.ptx().unwrap();
        for kernel in ["amp_sgd", "amp_adamw_moments", "amp_adamw_apply"] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
        let ptx = pool::POOL.ptx().unwrap();
        for kernel in ["amp_max_pool", "amp_max_pool_grad"] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
        let ptx = layer_norm::LAYER_NORM.ptx().unwrap();
        for kernel in [
            "amp_layer_norm",
            "amp_layer_norm_grad_rows",
            "amp_layer_norm_grad_cols",
        ] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
        let ptx = softmax::SOFTMAX.ptx().unwrap();
        for kernel in ["amp_softmax", "amp_softmax_grad"] {
            assert!(
                ptx.contains(&format!(".entry {kernel}(")),
                "{kernel} missing"
            );
        }
    }
}
