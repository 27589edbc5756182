//! The CUDA forwards of the batch-norm ops (`batch_norm.cu`): the per-channel sums and the
//! per-channel affine pass of the CPU kernels, f32 arithmetic per element and f64 block totals.
//! Per-channel constants go up as small arrays; the sums come back to the host (the CPU ops'
//! contract: `Normalisation` and `InputGrad` hold host vectors), one read-back per sum pass.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaStream, DevicePtr, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape};

use super::{address, address_like, alloc, code, grid_dim, grid_stride, out_address, Module};
use crate::kernels::channels::Geometry;

/// Threads per block of `batch_norm.cu`'s kernels, handed to the source as `AMP_BN_THREADS`
/// (its per-block reduction arrays are that long).
const THREADS: u32 = 256;

/// Batch norm's per-channel sums and affine pass, and the bias add (`batch_norm.cu`).
pub(crate) static BATCH_NORM: Module = Module::new(
    "candle_amp_batch_norm",
    include_str!("batch_norm.cu"),
    &[("AMP_BN_THREADS", THREADS)],
);
/// `AMP_BN_SPAN`: values of a row one block of the affine pass covers.
const SPAN: usize = THREADS as usize * 8;
/// Values one thread of the sums sums in f32 at most (then f64); small enough that a channel
/// of a large activation splits over several blocks (more loads in flight).
const PER_THREAD: u64 = 64;

/// `(2, channels)` f64 values as a storage on `dev`: what the sum ops return.
pub(crate) fn upload_pair(dev: &CudaDevice, a: &[f64], b: &[f64]) -> Result<(CudaStorage, Shape)> {
    let both = dev.clone_htod(&[a, b].concat())?;
    Ok((
        CudaStorage::wrap_cuda_slice(both, dev.clone()),
        Shape::from((2, a.len())),
    ))
}

/// Per-channel sums over `x` (and `dy`, mode 2) as batch_norm.cu's `amp_bn_sums` defines them,
/// `x` of geometry `g`.
pub(crate) fn sums(
    x: &CudaStorage,
    lx: &Layout,
    g: Geometry,
    dy: Option<(&CudaStorage, &Layout)>,
    mode: i32,
    center: &[f32],
    scale: &[f32],
) -> Result<(Vec<f64>, Vec<f64>)> {
    if lx.shape().elem_count() != g.n * g.c * g.hw {
        candle_core::bail!("batch norm kernel: {:?} is not of {g:?}", lx.shape())
    }
    let dev = &x.device;
    let count = g.count() as u64;
    if g.c == 0 || count == 0 {
        return Ok((vec![0.0; g.c], vec![0.0; g.c]));
    }
    if center.len() != g.c || scale.len() != g.c {
        candle_core::bail!(
            "batch norm kernel: per-channel values do not match {} channels",
            g.c
        )
    }
    let stream = dev.cuda_stream();
    let dt = code(x.dtype())?;
    let (xp, _x_guard) = address(x, lx, &stream)?;
    let (dyp, _dy_guard) = address_like(dy, x, lx, &stream)?;
    let splits = count.div_ceil(u64::from(THREADS) * PER_THREAD).min(65_535);
    let per_split = count.div_ceil(splits);
    let (d_center, d_scale) = (dev.clone_htod(center)?, dev.clone_htod(scale)?);
    let mut out0 = dev.alloc_zeros::<f64>(g.c)?;
    let mut out1 = dev.alloc_zeros::<f64>(g.c)?;
    let channels = grid_dim(g.c, "channels")?;
    let hw = g.hw as u64;
    let func = dev.get_or_load_custom_func("amp_bn_sums", BATCH_NORM.name, BATCH_NORM.ptx()?)?;
    let cfg = LaunchConfig {
        grid_dim: (channels, grid_dim(splits as usize, "splits")?, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut builder = func.builder();
    builder.arg(&xp);
    builder.arg(&dyp);
    builder.arg(&dt);
    builder.arg(&mode);
    builder.arg(&channels);
    builder.arg(&hw);
    builder.arg(&count);
    builder.arg(&per_split);
    builder.arg(&d_center);
    builder.arg(&d_scale);
    builder.arg(&mut out0);
    builder.arg(&mut out1);
    // SAFETY: the arguments match `amp_bn_sums`; `xp` (and `dyp` in mode 2) address `n * c *
    // hw` values of the kernel's dtype in storages borrowed for the launch; the per-channel
    // arrays hold `channels` values; every index the grid reaches is below `count` per channel.
    unsafe { builder.launch(cfg) }.w()?;
    Ok((dev.clone_dtoh(&out0)?, dev.clone_dtoh(&out1)?))
}

/// The per-channel affine pass `amp_bn_apply` into a fresh storage of `x`'s dtype:
/// `(x - center) * scale * mul + shift (+ k * dy)`; `mul` is a device f32 `(channels)` storage
/// (the weight), or ones when `None`; `shift` too may be a device storage (the bias).
pub(crate) struct Apply<'a> {
    pub center: &'a [f32],
    pub scale: &'a [f32],
    pub mul: Option<(&'a CudaStorage, &'a Layout)>,
    pub shift: Shift<'a>,
    pub dy: Option<(&'a CudaStorage, &'a Layout, &'a [f32])>,
}

/// Where the shift comes from: host values or a device storage.
pub(crate) enum Shift<'a> {
    Host(&'a [f32]),
    Device(&'a CudaStorage, &'a Layout),
}

impl Apply<'_> {
    pub(crate) fn run(&self, x: &CudaStorage, lx: &Layout) -> Result<(CudaStorage, Shape)> {
        let g = Geometry::of(lx)?;
        let dev = &x.device;
        let len = g.n * g.c * g.hw;
        let mut out = alloc(dev, x.dtype(), len)?;
        if len == 0 {
            return Ok((out, lx.shape().clone()));
        }
        let stream = dev.cuda_stream();
        let dt = code(x.dtype())?;
        let per_channel = |what: &str, n: usize| -> Result<()> {
            if n != g.c {
                candle_core::bail!("batch norm kernel: {what} has {n} values, not {}", g.c)
            }
            Ok(())
        };
        per_channel("center", self.center.len())?;
        per_channel("scale", self.scale.len())?;
        let (xp, _x_guard) = address(x, lx, &stream)?;
        let (mul, _mul_guard) = match self.mul {
            Some((s, l)) => {
                let (p, guard) = f32_address(s, l, &stream, "weight", g.c)?;
                (p, Some(guard))
            }
            None => (0u64, None),
        };
        let host_shift;
        let (shift, _shift_guard) = match self.shift {
            Shift::Device(s, l) => {
                let (p, guard) = f32_address(s, l, &stream, "bias", g.c)?;
                (p, Some(guard))
            }
            Shift::Host(v) => {
                per_channel("shift", v.len())?;
                host_shift = dev.clone_htod(v)?;
                let (p, guard) = host_shift.device_ptr(&stream);
                (p, Some(guard))
            }
        };
        let (dyp, _dy_guard) = address_like(self.dy.map(|(s, l, _)| (s, l)), x, lx, &stream)?;
        let host_k;
        let (kp, _k_guard) = match self.dy {
            Some((_, _, k)) => {
                per_channel("k", k.len())?;
                host_k = dev.clone_htod(k)?;
                let (kp, k_guard) = host_k.device_ptr(&stream);
                (kp, Some(k_guard))
            }
            None => (0u64, None),
        };
        let (d_center, d_scale) = (dev.clone_htod(self.center)?, dev.clone_htod(self.scale)?);
        let (out_ptr, out_guard) = out_address(&mut out, &stream);
        let rows = grid_dim(g.n * g.c, "rows")?;
        let chunks = u32::try_from(g.hw.div_ceil(SPAN))
            .ok()
            .filter(|&c| c <= 65_535)
            .ok_or_else(|| too_many("values per row"))?;
        let (channels, hw) = (grid_dim(g.c, "channels")?, g.hw as u64);
        let func =
            dev.get_or_load_custom_func("amp_bn_apply", BATCH_NORM.name, BATCH_NORM.ptx()?)?;
        let cfg = LaunchConfig {
            grid_dim: (rows, chunks, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        };
        let mut builder = func.builder();
        builder.arg(&xp);
        builder.arg(&dyp);
        builder.arg(&out_ptr);
        builder.arg(&dt);
        builder.arg(&channels);
        builder.arg(&hw);
        builder.arg(&d_center);
        builder.arg(&d_scale);
        builder.arg(&mul);
        builder.arg(&shift);
        builder.arg(&kp);
        // SAFETY: the arguments match `amp_bn_apply`; `xp`, `dyp` (when not null) and `out_ptr`
        // address `rows * hw` values of the kernel's dtype in storages held for the launch
        // (`out` freshly allocated, distinct from the inputs); every per-channel array holds
        // `channels` f32 values (checked above).
        unsafe { builder.launch(cfg) }.w()?;
        drop(out_guard); // ends the borrow of `out`
        Ok((out, lx.shape().clone()))
    }
}

/// `y + bias` per channel of the `(n, c, hw)` geometry `g` (`amp_bias_add`) into a fresh
/// storage of `y`'s dtype.
pub(crate) fn bias_add(
    y: &CudaStorage,
    ly: &Layout,
    bias: &CudaStorage,
    lb: &Layout,
    g: Geometry,
) -> Result<(CudaStorage, Shape)> {
    let dev = &y.device;
    let total = g.n * g.c * g.hw;
    let mut out = alloc(dev, y.dtype(), total)?;
    if total == 0 {
        return Ok((out, ly.shape().clone()));
    }
    let stream = dev.cuda_stream();
    let dt = code(y.dtype())?;
    let (yp, _y_guard) = address(y, ly, &stream)?;
    let (bp, _b_guard) = f32_address(bias, lb, &stream, "bias", g.c)?;
    let (out_ptr, out_guard) = out_address(&mut out, &stream);
    let channels = grid_dim(g.c, "channels")?;
    let (inner, total) = (g.hw as u64, total as u64);
    let func = dev.get_or_load_custom_func("amp_bias_add", BATCH_NORM.name, BATCH_NORM.ptx()?)?;
    let mut builder = func.builder();
    builder.arg(&yp);
    builder.arg(&out_ptr);
    builder.arg(&dt);
    builder.arg(&bp);
    builder.arg(&channels);
    builder.arg(&inner);
    builder.arg(&total);
    // SAFETY: the arguments match `amp_bias_add`; `yp` and `out_ptr` address `total` values of
    // the kernel's dtype in storages held for the launch (`out` freshly allocated), `bp`
    // `channels` f32 values (checked by `f32_address`).
    unsafe { builder.launch(grid_stride(total, THREADS)) }.w()?;
    drop(out_guard); // ends the borrow of `out`
    Ok((out, ly.shape().clone()))
}

/// The address of a per-channel f32 storage (weight or bias) of `c` values.
fn f32_address<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
    what: &str,
    c: usize,
) -> Result<(u64, SyncOnDrop<'a>)> {
    if s.dtype() != DType::F32 || l.shape().elem_count() != c {
        candle_core::bail!("batch norm kernel: {what} must be {c} f32 values")
    }
    address(s, l, stream)
}

fn too_many(what: &str) -> candle_core::Error {
    candle_core::Error::Msg(format!("batch norm kernel: too many {what} for one launch"))
}
