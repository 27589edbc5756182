//! The CUDA forwards of the batch-norm ops (`batch_norm.cu`): the per-channel sums and the
//! per-channel affine pass of the CPU kernels, f32 arithmetic per element and f64 block totals.
//! Per-channel values stay on the device: the constants are read from device arrays and the
//! sums are written to one, nothing is read back.

use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{
    CudaSlice, CudaStream, DevicePtr, DevicePtrMut, LaunchConfig, PushKernelArg, SyncOnDrop,
};
use candle_core::cuda_backend::WrapErr;
use candle_core::{CudaStorage, DType, Layout, Result, Shape, Storage};

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
/// Values one thread of the sums sums in f32 at most (then f64); small enough that a channel
/// of a large activation splits over several blocks (more loads in flight).
const PER_THREAD: u64 = 64;

/// Values per load of `amp_bn_sums` and `amp_bn_apply`: 16 bytes' worth (4 f32 or 8 f16/bf16)
/// where every row of `hw` values holds whole groups of them and each array (its address; 0 for
/// none) is 16-byte aligned, 1 otherwise.
fn width(dtype: DType, hw: usize, addresses: &[u64]) -> i32 {
    let w = if dtype == DType::F32 { 4 } else { 8 };
    if hw.is_multiple_of(w) && addresses.iter().all(|a| a % 16 == 0) {
        w as i32
    } else {
        1
    }
}

/// A per-channel f32 array on the device: a storage and the layout of its values.
pub(crate) struct PerChannel<'a>(pub &'a CudaStorage, pub Layout);

impl<'a> PerChannel<'a> {
    /// The address of the `c` f32 values, and the guard that orders the launch after earlier
    /// writes to them.
    fn address(
        &self,
        stream: &'a CudaStream,
        what: &str,
        c: usize,
    ) -> Result<(u64, SyncOnDrop<'a>)> {
        f32_address(self.0, &self.1, stream, what, c)
    }

    /// [`Self::address`] of an optional array: 0 (a null pointer) and no guard for none.
    fn optional(
        pc: Option<&Self>,
        stream: &'a CudaStream,
        what: &str,
        c: usize,
    ) -> Result<(u64, Option<SyncOnDrop<'a>>)> {
        Ok(match pc {
            Some(pc) => {
                let (p, guard) = pc.address(stream, what, c)?;
                (p, Some(guard))
            }
            None => (0, None),
        })
    }
}

/// A forward's ReLU for the backward's kernels, its per-channel scale (the inverse deviation),
/// weight and shift: `dy` counts only where the forward's output, recomputed, was positive
/// (`amp_relu_kept` in `batch_norm.cu`).
pub(crate) struct ReluMask<'a> {
    pub scale: PerChannel<'a>,
    pub mul: PerChannel<'a>,
    pub shift: PerChannel<'a>,
}

/// The three addresses of an optional [`ReluMask`] (null pointers for none) and their guards.
type MaskAddresses<'a> = ([u64; 3], Vec<SyncOnDrop<'a>>);

impl<'a> ReluMask<'a> {
    fn addresses(
        mask: Option<&Self>,
        stream: &'a CudaStream,
        c: usize,
    ) -> Result<MaskAddresses<'a>> {
        let Some(m) = mask else {
            return Ok(([0; 3], Vec::new()));
        };
        let (scale, g0) = m.scale.address(stream, "ReLU scale", c)?;
        let (mul, g1) = m.mul.address(stream, "ReLU weight", c)?;
        let (shift, g2) = m.shift.address(stream, "ReLU shift", c)?;
        Ok(([scale, mul, shift], vec![g0, g1, g2]))
    }
}

/// The CUDA storage of a tensor's (read-locked) storage, as a [`PerChannel`].
pub(crate) fn on_device<'a>(storage: &'a Storage, layout: &Layout) -> Result<PerChannel<'a>> {
    match storage {
        Storage::Cuda(s) => Ok(PerChannel(s, layout.clone())),
        _ => candle_core::bail!("batch norm kernel: per-channel values must be on the CUDA device"),
    }
}

/// The `n` rows of a contiguous `(n, c)` f32 storage, as [`PerChannel`]s.
pub(crate) fn rows<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    n: usize,
    c: usize,
) -> Result<Vec<PerChannel<'a>>> {
    match l.contiguous_offsets() {
        Some((start, end)) if end - start == n * c => Ok((0..n)
            .map(|r| PerChannel(s, Layout::contiguous_with_offset(c, start + r * c)))
            .collect()),
        _ => {
            candle_core::bail!("batch norm kernel: per-channel rows must be ({n}, {c}) contiguous")
        }
    }
}

/// The address of a contiguous f64 storage of `len` values.
fn f64_address<'a>(
    s: &'a CudaStorage,
    l: &Layout,
    stream: &'a CudaStream,
    len: usize,
) -> Result<(u64, SyncOnDrop<'a>)> {
    let (Some((start, end)), Ok(slice)) = (l.contiguous_offsets(), s.as_cuda_slice::<f64>()) else {
        candle_core::bail!("batch norm kernel: per-channel sums must be contiguous f64")
    };
    if end - start != len {
        candle_core::bail!(
            "batch norm kernel: {} sums where {len} were expected",
            end - start
        )
    }
    let (base, guard) = slice.device_ptr(stream);
    Ok((base + (start * std::mem::size_of::<f64>()) as u64, guard))
}

/// A launch of one thread per channel.
fn per_channel_launch(c: usize) -> Result<LaunchConfig> {
    Ok(LaunchConfig {
        grid_dim: (grid_dim(c.div_ceil(THREADS as usize), "channels")?, 1, 1),
        block_dim: (THREADS, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// A training forward's statistics (`amp_bn_stats` around two passes of `amp_bn_sums`): a
/// `(4, channels)` f32 storage of the mean, the inverse standard deviation (of the biased
/// variance plus `eps`), and the running mean and variance moved by `momentum` (the running
/// mean towards the mean plus `shift`, when given).
pub(crate) fn batch_stats(
    x: &CudaStorage,
    lx: &Layout,
    running: (PerChannel<'_>, PerChannel<'_>),
    shift: Option<PerChannel<'_>>,
    eps: f64,
    momentum: f64,
) -> Result<(CudaStorage, Shape)> {
    let g = Geometry::of(lx)?;
    let dev = &x.device;
    let mut out = alloc(dev, DType::F32, 4 * g.c)?;
    if g.c == 0 {
        return Ok((out, Shape::from((4, 0))));
    }
    let (sums, _) = self::sums(x, lx, g, None, 0, None, None, None)?;
    let mut mean64 = dev.alloc_zeros::<f64>(g.c)?;
    let stream = dev.cuda_stream();
    let func = dev.get_or_load_custom_func("amp_bn_stats", BATCH_NORM.name, BATCH_NORM.ptx()?)?;
    let (channels, count) = (grid_dim(g.c, "channels")?, g.count() as f64);
    let (rm, _rm_guard) = running.0.address(&stream, "running mean", g.c)?;
    let (rv, _rv_guard) = running.1.address(&stream, "running variance", g.c)?;
    let (sh, _sh_guard) = PerChannel::optional(shift.as_ref(), &stream, "shift", g.c)?;
    // One stage of `amp_bn_stats`, reading `input` (`(2, c)` f64: the sums in stage 0, the
    // squares in stage 1; the kernel reads one per stage, so both arguments get it).
    let stage = |stage: i32,
                 input: &CudaStorage,
                 mean64: &mut CudaSlice<f64>,
                 out: &mut CudaStorage|
     -> Result<()> {
        let (inp, _in_guard) = f64_address(input, &Layout::contiguous(2 * g.c), &stream, 2 * g.c)?;
        let (m64, _m_guard) = mean64.device_ptr_mut(&stream);
        let (o, _o_guard) = out_address(out, &stream);
        let mut builder = func.builder();
        builder.arg(&stage);
        builder.arg(&channels);
        builder.arg(&count);
        builder.arg(&eps);
        builder.arg(&momentum);
        builder.arg(&inp);
        builder.arg(&m64);
        builder.arg(&inp);
        builder.arg(&rm);
        builder.arg(&rv);
        builder.arg(&sh);
        builder.arg(&o);
        // SAFETY: the arguments match `amp_bn_stats`; `inp` addresses the first `channels` f64
        // values of the `(2, channels)` input, `m64` `channels` f64 values, `rm`, `rv` and `sh`
        // (unless null) `channels` f32 values (checked by `address`), `o` the 4 * `channels`
        // f32 values of `out`; one thread per channel, threads past the last return.
        unsafe { builder.launch(per_channel_launch(g.c)?) }.w()?;
        Ok(())
    };
    // Stage 0: the mean and the centre (row 0 of `out`); the squares about the centre; stage 1.
    stage(0, &sums, &mut mean64, &mut out)?;
    let centre = rows(&out, &Layout::contiguous((4, g.c)), 4, g.c)?.swap_remove(0);
    let (squares, _) = self::sums(x, lx, g, None, 1, Some(centre), None, None)?;
    stage(1, &squares, &mut mean64, &mut out)?;
    Ok((out, Shape::from((4, g.c))))
}

/// The input gradient's constants (`amp_bn_grad_consts`) from the `(2, channels)` f64 gradient
/// sums over `count` values per channel, the weight and the inverse standard deviation: a `(6,
/// channels)` f32 storage of k, p, q, zeros and the two sums (see `batch_norm.cu`).
pub(crate) fn grad_consts(
    (sums, ls): (&CudaStorage, &Layout),
    weight: PerChannel<'_>,
    invstd: PerChannel<'_>,
    count: f64,
    train: bool,
    unit: bool,
) -> Result<(CudaStorage, Shape)> {
    // `amp_bn_grad_consts`'s rows, the layout the CPU op shares.
    const ROWS: usize = 6;
    let c = ls.shape().elem_count() / 2;
    let dev = &sums.device;
    let mut out = alloc(dev, DType::F32, ROWS * c)?;
    if c == 0 {
        return Ok((out, Shape::from((ROWS, 0))));
    }
    let stream = dev.cuda_stream();
    let (sp, _s_guard) = f64_address(sums, ls, &stream, 2 * c)?;
    let (wp, _w_guard) = weight.address(&stream, "weight", c)?;
    let (ip, _i_guard) = invstd.address(&stream, "invstd", c)?;
    let (o, out_guard) = out_address(&mut out, &stream);
    let func =
        dev.get_or_load_custom_func("amp_bn_grad_consts", BATCH_NORM.name, BATCH_NORM.ptx()?)?;
    let (channels, train, unit) = (grid_dim(c, "channels")?, i32::from(train), i32::from(unit));
    let mut builder = func.builder();
    builder.arg(&channels);
    builder.arg(&count);
    builder.arg(&train);
    builder.arg(&unit);
    builder.arg(&sp);
    builder.arg(&wp);
    builder.arg(&ip);
    builder.arg(&o);
    // SAFETY: the arguments match `amp_bn_grad_consts`; `sp` addresses 2 * `channels` f64
    // values, `wp` and `ip` `channels` f32 values (checked above), `o` the 6 * `channels` f32
    // values of `out`; one thread per channel, threads past the last return.
    unsafe { builder.launch(per_channel_launch(c)?) }.w()?;
    drop(out_guard); // ends the borrow of `out`
    Ok((out, Shape::from((ROWS, c))))
}

/// Per-channel sums over `x` (and `dy`, mode 2) as batch_norm.cu's `amp_bn_sums` defines them,
/// `x` of geometry `g`: a `(2, channels)` f64 storage, `out0` in row 0 and `out1` in row 1.
/// Mode 0 reads neither `center` nor `scale`, mode 1 `center`, mode 2 both (and `relu`, where
/// given, masks `dy`).
#[allow(clippy::too_many_arguments)] // the kernel's operands, each optional by mode
pub(crate) fn sums(
    x: &CudaStorage,
    lx: &Layout,
    g: Geometry,
    dy: Option<(&CudaStorage, &Layout)>,
    mode: i32,
    center: Option<PerChannel<'_>>,
    scale: Option<PerChannel<'_>>,
    relu: Option<ReluMask<'_>>,
) -> Result<(CudaStorage, Shape)> {
    if (mode >= 1 && center.is_none()) || (mode == 2 && scale.is_none()) {
        candle_core::bail!("batch norm kernel: sums of mode {mode} need their per-channel values")
    }
    if lx.shape().elem_count() != g.n * g.c * g.hw {
        candle_core::bail!("batch norm kernel: {:?} is not of {g:?}", lx.shape())
    }
    let dev = &x.device;
    let count = g.count() as u64;
    let mut out = dev.alloc_zeros::<f64>(2 * g.c)?;
    if g.c == 0 || count == 0 {
        return Ok((
            CudaStorage::wrap_cuda_slice(out, dev.clone()),
            Shape::from((2, g.c)),
        ));
    }
    let stream = dev.cuda_stream();
    let dt = code(x.dtype())?;
    let (xp, _x_guard) = address(x, lx, &stream)?;
    let (dyp, _dy_guard) = address_like(dy, x, lx, &stream)?;
    let (center, _center_guard) = PerChannel::optional(center.as_ref(), &stream, "center", g.c)?;
    let (scale, _scale_guard) = PerChannel::optional(scale.as_ref(), &stream, "scale", g.c)?;
    let (relu, _relu_guards) = ReluMask::addresses(relu.as_ref(), &stream, g.c)?;
    let width = width(x.dtype(), g.hw, &[xp, dyp]);
    let splits = count.div_ceil(u64::from(THREADS) * PER_THREAD).min(65_535);
    // In groups of `width` values, as the kernel counts.
    let groups = count / width as u64;
    let per_split = groups.div_ceil(splits);
    let (out0, out_guard) = out.device_ptr_mut(&stream);
    let out1 = out0 + (g.c * std::mem::size_of::<f64>()) as u64;
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
    builder.arg(&width);
    builder.arg(&channels);
    builder.arg(&hw);
    builder.arg(&groups);
    builder.arg(&per_split);
    builder.arg(&center);
    builder.arg(&scale);
    for p in &relu {
        builder.arg(p);
    }
    builder.arg(&out0);
    builder.arg(&out1);
    // SAFETY: the arguments match `amp_bn_sums`; `xp` (and `dyp` in mode 2) address `n * c *
    // hw` values of the kernel's dtype in storages borrowed for the launch, aligned and of rows
    // of whole groups where `width` > 1; `center` and
    // `scale` hold `channels` f32 values (checked by `f32_address`) where the mode reads them
    // (checked above), so do the three of `relu` unless null, `out0` and `out1` the two
    // rows of `channels` zeroed f64 values of `out`; every index the grid reaches is below
    // `count` per channel.
    unsafe { builder.launch(cfg) }.w()?;
    drop(out_guard); // ends the borrow of `out`
    Ok((
        CudaStorage::wrap_cuda_slice(out, dev.clone()),
        Shape::from((2, g.c)),
    ))
}

/// The per-channel affine pass `amp_bn_apply` into a fresh storage of `x`'s dtype:
/// `(x - center) * scale * mul + shift (+ k * dy)`, through a ReLU with `relu`; `mul` (the
/// weight) is ones when `None`.
pub(crate) struct Apply<'a> {
    pub center: PerChannel<'a>,
    pub scale: PerChannel<'a>,
    pub mul: Option<PerChannel<'a>>,
    pub shift: PerChannel<'a>,
    /// The input gradient's `dy` and its factor `k`.
    pub dy: Option<((&'a CudaStorage, &'a Layout), PerChannel<'a>)>,
    /// The output goes through a ReLU.
    pub relu: bool,
    /// The forward's ReLU, masking `dy`.
    pub relu_mask: Option<ReluMask<'a>>,
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
        let (xp, _x_guard) = address(x, lx, &stream)?;
        let (d_center, _center_guard) = self.center.address(&stream, "center", g.c)?;
        let (d_scale, _scale_guard) = self.scale.address(&stream, "scale", g.c)?;
        let (shift, _shift_guard) = self.shift.address(&stream, "shift", g.c)?;
        let (mul, _mul_guard) = PerChannel::optional(self.mul.as_ref(), &stream, "weight", g.c)?;
        let (dyp, _dy_guard) = address_like(self.dy.as_ref().map(|(d, _)| *d), x, lx, &stream)?;
        let k = self.dy.as_ref().map(|(_, k)| k);
        let (kp, _k_guard) = PerChannel::optional(k, &stream, "k", g.c)?;
        let (mask, _mask_guards) = ReluMask::addresses(self.relu_mask.as_ref(), &stream, g.c)?;
        let (out_ptr, out_guard) = out_address(&mut out, &stream);
        let width = width(x.dtype(), g.hw, &[xp, dyp, out_ptr]);
        let (channels, hw, total) = (grid_dim(g.c, "channels")?, g.hw as u64, len as u64);
        let func =
            dev.get_or_load_custom_func("amp_bn_apply", BATCH_NORM.name, BATCH_NORM.ptx()?)?;
        let cfg = grid_stride(total / width as u64, THREADS);
        let mut builder = func.builder();
        builder.arg(&xp);
        builder.arg(&dyp);
        builder.arg(&out_ptr);
        builder.arg(&dt);
        builder.arg(&width);
        builder.arg(&channels);
        builder.arg(&hw);
        builder.arg(&total);
        builder.arg(&d_center);
        builder.arg(&d_scale);
        builder.arg(&mul);
        builder.arg(&shift);
        builder.arg(&kp);
        let relu = i32::from(self.relu);
        builder.arg(&relu);
        for p in &mask {
            builder.arg(p);
        }
        // SAFETY: the arguments match `amp_bn_apply`; `xp`, `dyp` (when not null) and `out_ptr`
        // address `total` values (rows of `hw`) of the kernel's dtype in storages held for the launch
        // (`out` freshly allocated, distinct from the inputs), aligned and of rows of whole
        // groups where `width` > 1; every per-channel array (the
        // mask's unless null) holds `channels` f32 values (checked above).
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
