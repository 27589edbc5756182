//! Shared by the seed-experiment examples: peak-memory accounting, the per-mode result record, the
//! `--precision` choice, the comparison table, the `--json` object, progress bars and the plots'
//! font.
#![allow(dead_code)] // each example uses a different subset

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use std::time::Instant;

use candle_amp::{GradScaler, Tensor, F32};
use candle_core::{DType, Device, Result, Var};
use candle_nn::{Optimizer, VarBuilder, VarMap};
use serde::Serialize;

pub mod curves;
mod device;
pub mod modes;
#[allow(unused_imports)] // not every example takes `--device`
pub use device::parse_device;

/// Keeps freed heap memory in the process instead of handing it back to the OS after each free.
///
/// A training step allocates the same large buffers every step (activations, gradients, and the
/// zeros candle's backward starts each gradient from). glibc serves blocks above a dynamic
/// threshold (128 KiB to 32 MiB) with fresh `mmap`s and trims the heap's top on free, so every
/// step touches fresh pages again: a page fault per 4 KiB, 10-20% of a CPU step here (`perf`).
/// With the mmap threshold at glibc's maximum and trimming off, freed buffers are reused as they
/// are. The same setting is open to any process (`GLIBC_TUNABLES=glibc.malloc.trim_threshold=..`),
/// PyTorch's included. Peak heap (`CountingAlloc`) counts live bytes and is unaffected; the
/// resident size stays at its high-water mark. Elsewhere than glibc this does nothing.
pub fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // glibc's largest mmap threshold on 64-bit targets: 4 MiB * size_of::<long>().
        const MMAP_MAX: libc::c_int = 32 << 20;
        // SAFETY: `mallopt` only sets glibc's allocation thresholds; it is called at the start of
        // `main`, before any allocation it could affect is live in another thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_MAX);
            libc::mallopt(libc::M_TRIM_THRESHOLD, libc::c_int::MAX);
        }
    }
}

/// The system allocator, counting live heap bytes and their peak (CPU tensors live on the heap,
/// so this is `torch.cuda.max_memory_allocated` for the CPU device).
pub struct CountingAlloc;

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

// SAFETY: forwards to the system allocator unchanged; only counts.
unsafe impl GlobalAlloc for CountingAlloc {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for this method, passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract for this method, passed on unchanged.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for this method, passed on unchanged.
        unsafe { System.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: the caller's contract for this method, passed on unchanged.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
            grew(new_size);
        }
        p
    }
}

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes, Ordering::Relaxed) + bytes;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

/// One mode's peak memory on its device, from the bytes in use when it starts (the data set and
/// anything else both modes share are not counted): `torch.cuda.reset_peak_memory_stats` then
/// `torch.cuda.max_memory_allocated`. On CPU the live heap bytes ([`CountingAlloc`]: CPU
/// tensors live on the heap); on CUDA the bytes allocated from the device's default memory pool,
/// which candle's allocations come from (`cuMemAllocAsync`), and its high-water mark.
pub struct Peak {
    dev: Device,
    base: usize,
}

impl Peak {
    /// Starts a new peak measurement on `dev` from the bytes in use now.
    pub fn start(dev: &Device) -> Result<Self> {
        dev.synchronize()?; // on CUDA, the queued work's allocations and frees first
        let base = match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => cuda_pool::start(d)?,
            _ => {
                let live = LIVE.load(Ordering::Relaxed);
                PEAK.store(live, Ordering::Relaxed);
                live
            }
        };
        Ok(Self {
            dev: dev.clone(),
            base,
        })
    }

    /// The most bytes in use at once since [`Peak::start`], above those in use then.
    pub fn bytes(&self) -> Result<usize> {
        self.dev.synchronize()?;
        let high = match &self.dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => cuda_pool::high(d)?,
            _ => PEAK.load(Ordering::Relaxed),
        };
        Ok(high.saturating_sub(self.base))
    }
}

/// The CUDA default memory pool's accounting: bytes allocated now and their high-water mark.
#[cfg(feature = "cuda")]
mod cuda_pool {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use candle_core::{CudaDevice, Result};

    fn attribute(dev: &CudaDevice, attr: sys::CUmemPool_attribute, reset: bool) -> Result<usize> {
        let fail =
            |what: &str, e| candle_core::Error::Msg(format!("CUDA memory pool: {what}: {e:?}"));
        let ctx = dev.cuda_stream().context().clone();
        ctx.bind_to_thread().map_err(|e| fail("bind", e))?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        let mut value: u64 = 0;
        // SAFETY: the context is current on this thread; `pool` and `value` are valid out
        // pointers of the types the driver writes (a pool handle, a cuuint64_t).
        unsafe {
            sys::cuDeviceGetDefaultMemPool(&raw mut pool, ctx.cu_device())
                .result()
                .map_err(|e| fail("default pool", e))?;
            if reset {
                // Setting the high-water mark to 0 resets it to the bytes allocated now.
                sys::cuMemPoolSetAttribute(pool, attr, std::ptr::from_mut(&mut value).cast())
                    .result()
                    .map_err(|e| fail("reset", e))?;
            }
            sys::cuMemPoolGetAttribute(pool, attr, std::ptr::from_mut(&mut value).cast())
                .result()
                .map_err(|e| fail("read", e))?;
        }
        usize::try_from(value).map_err(|_| candle_core::Error::Msg("CUDA memory pool: size".into()))
    }

    /// Resets the high-water mark; returns the bytes allocated now.
    pub(super) fn start(dev: &CudaDevice) -> Result<usize> {
        attribute(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            true,
        )?;
        attribute(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT,
            false,
        )
    }

    /// The most bytes allocated at once since [`start`].
    pub(super) fn high(dev: &CudaDevice) -> Result<usize> {
        attribute(
            dev,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH,
            false,
        )
    }
}

/// `--precision`: the lower precision of the AMP run, PyTorch's `torch.autocast(dtype=...)`.
///
/// Without the flag, [`AmpPrecision::default_for`] picks PyTorch's autocast default for the
/// device: bf16 on CPU, fp16 on CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AmpPrecision {
    /// bfloat16: f32's range, 8 significant bits; no loss scaling needed
    Bf16,
    /// float16: 11 significant bits, range up to 65504; trained with a GradScaler
    Fp16,
}

impl AmpPrecision {
    /// PyTorch's autocast default: `torch.autocast("cpu")` is bf16, `torch.autocast("cuda")`
    /// fp16.
    pub fn default_for(device: &Device) -> Self {
        if device.is_cpu() {
            Self::Bf16
        } else {
            Self::Fp16
        }
    }

    /// `"bf16"` or `"fp16"`, as the flag spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bf16 => "bf16",
            Self::Fp16 => "fp16",
        }
    }

    /// The AMP mode's label in tables and plot legends: `AMP (bf16)`.
    pub fn label(self) -> String {
        format!("AMP ({})", self.name())
    }
}

/// One mode's figures, the fields of the `--json` object.
#[derive(Clone, Debug, Serialize)]
pub struct ModeResult {
    pub ms_per_step: f64,
    pub peak_bytes: usize,
    pub final_loss: f32,
    pub skipped_steps: u64,
    pub final_scale: f32,
}

/// `{"precision": "bf16", "f32": {...}, "amp": {...}}` on one line (`precision`: the AMP run's).
pub fn json(precision: AmpPrecision, f32: &ModeResult, amp: &ModeResult) -> String {
    serde_json::json!({ "precision": precision, "f32": f32, "amp": amp }).to_string()
}

/// The seed examples' two measured runs: one untimed, unmeasured step of each mode first (the
/// first use of the thread pool and of gemm's per-thread packing buffers allocates memory that
/// stays for the process, which would otherwise count in the first mode's peak only), then
/// `steps` steps in f32 and in AMP. `run(label, amp, steps)` runs one mode (`label` names its
/// progress bar: `f32`, or `amp_label` for the AMP run, e.g. its policy's name `bf16`);
/// `amp_enabled` false (`--enabled false`) makes the AMP row run the f32 program.
pub fn f32_then_amp(
    amp_enabled: bool,
    amp_label: &str,
    steps: usize,
    mut run: impl FnMut(Option<&str>, bool, usize) -> Result<ModeResult>,
) -> Result<(ModeResult, ModeResult)> {
    run(None, false, 1)?;
    run(None, amp_enabled, 1)?;
    Ok((
        run(Some("f32"), false, steps)?,
        run(Some(amp_label), amp_enabled, steps)?,
    ))
}

/// What the AMP row ran, for the line under a table's title: `AMP (fp16) = fp16 autocast +
/// GradScaler`, or `AMP (bf16) = bf16 autocast without GradScaler (...)`.
pub fn amp_description(precision: AmpPrecision) -> String {
    let scaler = match precision {
        AmpPrecision::Fp16 => "+ GradScaler",
        AmpPrecision::Bf16 => "without GradScaler (bf16 has f32's range)",
    };
    format!(
        "{} = {} autocast {scaler}",
        precision.label(),
        precision.name()
    )
}

/// An error naming every mode whose final loss is not finite: that run diverged (a learning
/// rate too large, say). The examples print their figures first, then end with it, so that a
/// diverged run exits non-zero instead of reporting NaN as its result.
pub fn check_finite<'a>(final_losses: impl IntoIterator<Item = (&'a str, f32)>) -> Result<()> {
    let diverged: Vec<String> = final_losses
        .into_iter()
        .filter(|(_, loss)| !loss.is_finite())
        .map(|(mode, loss)| format!("{mode} ({loss})"))
        .collect();
    if diverged.is_empty() {
        return Ok(());
    }
    candle_core::bail!(
        "training diverged: the final loss of {} is not finite (a smaller --lr?)",
        diverged.join(", ")
    )
}

/// Prints the `--json` object, or the table under `title` and a line saying what the AMP row
/// ran; then [`check_finite`] on both rows.
pub fn report(
    json: bool,
    amp_enabled: bool,
    precision: AmpPrecision,
    title: &str,
    f32: &ModeResult,
    amp: &ModeResult,
) -> Result<()> {
    if json {
        println!("{}", self::json(precision, f32, amp));
    } else {
        let off = if amp_enabled {
            ""
        } else {
            ": DISABLED by --enabled false, both rows run the f32 program"
        };
        let title = format!(
            "{title}\n{}{off}; ms per step excludes each mode's first step",
            amp_description(precision)
        );
        print!("{}", table(&title, precision, f32, amp));
    }
    check_finite([("f32", f32.final_loss), ("amp", amp.final_loss)])
}

/// The comparison table: one row per mode (the AMP row named by its precision, `AMP (bf16)`),
/// then AMP's speedup and memory saving in %.
pub fn table(title: &str, precision: AmpPrecision, f32: &ModeResult, amp: &ModeResult) -> String {
    let mib = |b: usize| b as f64 / (1024.0 * 1024.0);
    let row = |name: &str, r: &ModeResult| {
        format!(
            "| {name:<10} | {:>11.2} | {:>14.1} | {:>10.5} | {:>13} | {:>11} |\n",
            r.ms_per_step,
            mib(r.peak_bytes),
            r.final_loss,
            r.skipped_steps,
            r.final_scale
        )
    };
    let speedup = (f32.ms_per_step / amp.ms_per_step - 1.0) * 100.0;
    let saving = (1.0 - amp.peak_bytes as f64 / f32.peak_bytes as f64) * 100.0;
    let label = precision.label();
    format!(
        "{title}\n\
         | mode       | ms per step | peak MiB       | final loss | skipped steps | final scale |\n\
         |------------|-------------|----------------|------------|---------------|-------------|\n\
         {}{}\
         {label} vs f32: {speedup:+.1}% speed ({:.2}x time), {saving:+.1}% memory saving ({:.2}x \
         peak)\n",
        row("f32", f32),
        row(&label, amp),
        amp.ms_per_step / f32.ms_per_step,
        amp.peak_bytes as f64 / f32.peak_bytes as f64,
    )
}

/// A count of at least 1, as a clap value parser (clap prints the message for 0 or a
/// non-number).
pub fn positive(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// Initial weights by name, copied into each mode's fresh model.
pub type Init = Vec<(String, candle_core::Tensor)>;

/// Initial weights drawn from a fixed seed: every tensor a model asks its `VarBuilder` for, drawn
/// from the distribution candle-nn's `Init` hint names (the same one a `VarMap` would use), by
/// a generator seeded with `seed` and the tensor's name. candle cannot seed its CPU generator
/// (`Device::set_seed` is an error there), so this is how a run is made repeatable, as
/// `torch.manual_seed` does for a PyTorch example.
pub fn seeded_init(
    seed: u64,
    dev: &Device,
    build: impl FnOnce(&VarBuilder) -> Result<()>,
) -> Result<Init> {
    let backend = Seeded {
        seed,
        drawn: std::sync::Mutex::new(Vec::new()),
    };
    build(&VarBuilder::from_backend(
        Box::new(&backend),
        DType::F32,
        dev.clone(),
    ))?;
    backend
        .drawn
        .into_inner()
        .map_err(|_| candle_core::Error::Msg("the seeded weights' lock is poisoned".into()))
}

/// Random data from a fixed seed (candle's CPU generator cannot be seeded): the examples' random
/// batches, the same on every run with the same `--seed`.
pub struct SeededData(rand::rngs::StdRng);

impl SeededData {
    /// A generator for `seed`, its stream apart from [`seeded_init`]'s weights of that seed.
    pub fn new(seed: u64) -> Self {
        use rand::SeedableRng;
        Self(rand::rngs::StdRng::seed_from_u64(
            seed ^ 0x6461_7461_5f73_6565, // "data_see": not a weight name's hash
        ))
    }

    /// A tensor of `shape` from N(0, 1).
    pub fn randn<S: Into<candle_core::Shape>>(
        &mut self,
        shape: S,
        dev: &Device,
    ) -> Result<Tensor<F32>> {
        use rand_distr::{Distribution, StandardNormal};
        let shape = shape.into();
        let values: Vec<f32> = (0..shape.elem_count())
            .map(|_| StandardNormal.sample(&mut self.0))
            .collect();
        Tensor::from_vec(values, shape, dev)
    }

    /// `n` class labels (u32), uniform in `0..classes`.
    pub fn labels(&mut self, n: usize, classes: u32, dev: &Device) -> Result<candle_core::Tensor> {
        use rand::Rng;
        let labels: Vec<u32> = (0..n).map(|_| self.0.random_range(0..classes)).collect();
        candle_core::Tensor::from_vec(labels, n, dev)
    }
}

/// The `VarBuilder` backend of [`seeded_init`].
struct Seeded {
    seed: u64,
    drawn: std::sync::Mutex<Init>,
}

impl candle_nn::var_builder::SimpleBackend for &Seeded {
    fn get(
        &self,
        shape: candle_core::Shape,
        name: &str,
        init: candle_nn::Init,
        dtype: DType,
        dev: &Device,
    ) -> Result<candle_core::Tensor> {
        use candle_nn::init::NormalOrUniform;
        use rand::{Rng, SeedableRng};
        use rand_distr::{Distribution, Normal, Uniform};

        // FNV-1a of the name: each tensor its own stream, whatever order they are asked for.
        let key = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
            (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
        });
        let mut rng = rand::rngs::StdRng::seed_from_u64(self.seed ^ key);
        let n = shape.elem_count();
        let normal = |rng: &mut rand::rngs::StdRng, mean: f64, std: f64| -> Result<Vec<f32>> {
            let d = Normal::new(mean, std).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            Ok((0..n).map(|_| d.sample(rng) as f32).collect())
        };
        let uniform = |rng: &mut rand::rngs::StdRng, lo: f64, up: f64| -> Result<Vec<f32>> {
            let d = Uniform::new(lo, up).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
            Ok((0..n).map(|_| rng.sample(d) as f32).collect())
        };
        let values = match init {
            candle_nn::Init::Const(c) => vec![c as f32; n],
            candle_nn::Init::Randn { mean, stdev } => normal(&mut rng, mean, stdev)?,
            candle_nn::Init::Uniform { lo, up } => uniform(&mut rng, lo, up)?,
            candle_nn::Init::Kaiming {
                dist,
                fan,
                non_linearity,
            } => {
                let std = non_linearity.gain() / (fan.for_shape(&shape) as f64).sqrt();
                match dist {
                    NormalOrUniform::Uniform => {
                        let bound = 3f64.sqrt() * std;
                        uniform(&mut rng, -bound, bound)?
                    }
                    NormalOrUniform::Normal => normal(&mut rng, 0.0, std)?,
                }
            }
        };
        let t = candle_core::Tensor::from_vec(values, shape, dev)?.to_dtype(dtype)?;
        self.drawn
            .lock()
            .map_err(|_| candle_core::Error::Msg("the seeded weights' lock is poisoned".into()))?
            .push((name.to_string(), t.clone()));
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, _: DType, _: &Device) -> Result<candle_core::Tensor> {
        candle_core::bail!("seeded initial weights: `{name}` was asked for without a shape")
    }

    fn contains_tensor(&self, _name: &str) -> bool {
        false
    }
}

/// Name and tensor of every variable in `map` (the shared initial weights).
pub fn snapshot(map: &VarMap) -> Result<Init> {
    let data = map
        .data()
        .lock()
        .map_err(|_| candle_core::Error::Msg("the initial weights' lock is poisoned".into()))?;
    Ok(data
        .iter()
        .map(|(name, var)| (name.clone(), var.as_tensor().clone()))
        .collect())
}

/// How one mode runs: AMP on or off, loss scaling on or off (a `GradScaler` enabled or not),
/// the number of steps, and the progress bar's label (`None` hides it, as for the warm-up;
/// `quiet` hides it too, for `--json`).
#[allow(clippy::struct_excessive_bools)] // independent switches of one run, not a state
pub struct Mode<'a> {
    pub label: Option<&'a str>,
    pub quiet: bool,
    pub amp: bool,
    pub loss_scaling: bool,
    pub steps: usize,
    /// Print the precision report of the AMP run's first (untimed) step: to stdout, or to
    /// stderr when `quiet`.
    pub precision_report: bool,
}

/// Trains a fresh model in one mode and measures it: `build` makes the model on a new f32
/// `VarMap`, which then takes the `init` weights; `optimizer` is made from its variables; each
/// step runs the GradScaler loop on `loss(model, step, amp)`, the scaler enabled only with
/// `mode.loss_scaling` (disabled, it is an exact pass-through: a plain optimizer step). Every
/// step but the first (the untimed warm-up) is timed; peak memory ([`Peak`]) counts from model
/// creation.
pub fn run_mode<M, O: Optimizer>(
    mode: &Mode,
    init: &Init,
    dev: &Device,
    build: impl FnOnce(&VarBuilder) -> Result<M>,
    optimizer: impl FnOnce(Vec<Var>) -> Result<O>,
    mut loss: impl FnMut(&M, usize, bool) -> Result<Tensor<F32>>,
) -> Result<ModeResult> {
    let peak = Peak::start(dev)?;

    let mut vars = VarMap::new();
    let model = build(&VarBuilder::from_varmap(&vars, DType::F32, dev))?;
    vars.set(init.iter().map(|(name, t)| (name, t)))?;
    let mut opt = optimizer(vars.all_vars())?;
    let mut scaler = GradScaler::builder().enabled(mode.loss_scaling).build()?;

    let bar = progress(
        mode.steps as u64,
        mode.label.unwrap_or(""),
        mode.quiet || mode.label.is_none(),
    );
    let mut start = Instant::now();
    let mut final_loss = f32::NAN;
    for step in 0..mode.steps {
        if step == 1 {
            start = Instant::now(); // step 0 is the untimed warm-up
        }
        let mut one_step = || -> Result<f32> {
            let l = loss(&model, step, mode.amp)?;
            let grads = scaler.scale(&l)?.backward()?;
            let _ = scaler.step(&mut opt, grads)?; // skips are counted by the scaler
            scaler.update()?;
            l.to_scalar::<f32>()
        };
        final_loss = if step == 0 && mode.amp && mode.precision_report && mode.label.is_some() {
            let (value, rep) = candle_amp::report::record(one_step);
            if mode.quiet {
                eprintln!("{rep}");
            } else {
                println!("{rep}");
            }
            value?
        } else {
            one_step()?
        };
        bar.set_message(format!("loss {final_loss:.5}"));
        bar.inc(1);
    }
    let timed_steps = mode.steps.saturating_sub(1).max(1);
    let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / timed_steps as f64;
    bar.finish();

    Ok(ModeResult {
        ms_per_step,
        peak_bytes: peak.bytes()?,
        final_loss,
        skipped_steps: scaler.skipped_steps(),
        final_scale: scaler.scale_value(),
    })
}

/// A progress bar on stderr (hidden with `--json`, so stdout stays one JSON object).
pub fn progress(len: u64, label: &str, hidden: bool) -> indicatif::ProgressBar {
    if hidden {
        return indicatif::ProgressBar::hidden();
    }
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{prefix:>5} [{bar:40}] {pos}/{len} {msg} ({eta})")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_prefix(label.to_string());
    bar
}

/// Registers the bundled DejaVu Sans (see assets/DejaVuSans-LICENSE.txt) as plotters'
/// "sans-serif", so plots render text without system fonts.
pub fn register_font() {
    static FONT: &[u8] = include_bytes!("assets/DejaVuSans.ttf");
    plotters::style::register_font("sans-serif", plotters::style::FontStyle::Normal, FONT)
        .map_err(|_| "invalid font")
        .expect("the bundled font parses");
}

#[global_allocator]
static GLOBAL: CountingAlloc = CountingAlloc;
/// The mean of the last `n` losses: the final loss, less one batch's noise (the examples take
/// the last tenth of a run's steps).
pub fn mean_tail_n(losses: &[f32], n: usize) -> f32 {
    losses[losses.len() - n..].iter().sum::<f32>() / n as f32
}

/// The median of `values` (sorted here): the examples' figure over seeds and repeats.
pub fn median(values: &mut [f64]) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len().is_multiple_of(2) {
        f64::midpoint(values[mid - 1], values[mid])
    } else {
        values[mid]
    }
}

/// Says on stderr when a `--resume`d run goes on at another learning rate than `--lr`: a
/// checkpoint restores the optimizer's rate (as PyTorch's `load_state_dict`), so that a rate a
/// schedule changed resumes as it was. The run printed `--lr` and trained at the other.
pub fn note_resumed_rate(resumed: f64, given: f64) {
    if resumed.to_bits() != given.to_bits() {
        eprintln!(
            "--resume: training goes on at the checkpoint's learning rate {resumed}, not --lr \
             {given} (a checkpoint restores the optimizer's rate, as PyTorch's load_state_dict)"
        );
    }
}
