//! The seed CNN (one of the AMP experiments this project reproduces, with the ROCm blog's
//! quantized sine and PyTorch's AMP recipe): a small image classifier trained in f32 and with AMP
//! side by side in one process.
//!
//! Model: Conv(3, 32, 3, padding 1) + ReLU + MaxPool(2), Conv(32, 64, 3, padding 1) + ReLU +
//! MaxPool(2), Linear(64 * 8 * 8, 10). The seed experiment writes the head as
//! Linear(64 * 16 * 16, 10), which is what one 2x2 pool (or 64x64 inputs) would give; with the two
//! pools above, 32x32 inputs leave 8x8 feature maps, so the head here is Linear(4096, 10), the
//! shape the layers produce.
//! Training: cross-entropy against 10 random class labels, Adam (AdamW with weight decay 0) lr
//! 1e-3, on random 3x32x32 images from N(0, 1) made once up front from `--seed` (default 0), as
//! are the initial weights: both modes see the same batches and start from the same weights, and
//! a run is repeatable. The "amp" mode runs the forward under
//! `#[autocast(policy = Pol, enabled = use_amp)]` (convolutions and the head in the policy's half
//! precision, the f32 masters rounded inside the op with no half copy kept, ReLU and pooling in
//! that precision, the loss in f32); the f32 mode is the same loop with `use_amp = false` and a disabled scaler (an exact
//! pass-through).
//!
//! `--precision bf16|fp16` chooses the policy, as `dtype=` does for `torch.autocast`: `main`
//! matches on it once and runs the generic code with `Bf16Policy` or `Fp16Policy`. Without the
//! flag it is PyTorch's autocast default for the device: bf16 on CPU, fp16 on CUDA. fp16 trains
//! with a `GradScaler`; bf16, whose range is f32's, without one (as in PyTorch; the scaler is
//! built disabled).
//!
//! ```sh
//! cargo run --release --example simple_cnn                 # small defaults, a few seconds
//! cargo run --release --example simple_cnn -- --precision fp16   # fp16 + GradScaler
//! cargo run --release --example simple_cnn -- --batches 20 --epochs 5 --seed 3
//! cargo run --release --example simple_cnn -- --json       # one JSON line on stdout
//! ```
//!
//! Flags: `--batch` (default 64, as the seed), `--batches` (random batches per epoch, default
//! 6), `--epochs` (default 5), `--precision bf16|fp16` (the AMP run's lower precision; default
//! bf16 on CPU, fp16 on CUDA), `--enabled false` (AMP off in the "amp" run, nothing else changed:
//! it then is the f32 program with a disabled scaler and should match the f32 row), `--json`
//! (print only `{"precision": "bf16", "f32": {...}, "amp": {...}}` and hide the progress bars),
//! `--device cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`, `--seed N`. The table
//! names the AMP row by its precision: `AMP (bf16)`.
//!
//! Measured per mode: milliseconds per training step (forward, loss, scaled backward, unscale,
//! Adam step, scale update), excluding the mode's first step (it is trained on, just not timed);
//! the peak heap bytes above what was live when the mode started (the data set and the initial
//! weights are shared and not counted); the loss of the last step; the scaler's skipped steps and
//! final scale (0 and 1 when it is disabled, as for bf16). Before either mode, one unmeasured
//! step of each warms up the process (thread pool, gemm's per-thread buffers), so that its
//! one-time allocations count in neither peak: with `--enabled false` the two rows then have the
//! same peak to the byte and the same loss to the bit.
//!
//! What to expect on CPU (the defaults take a few seconds on this project's 2 cores):
//! - The loss starts near 6 rather than ln 10 = 2.3 (unnormalised N(0, 1) images through
//!   PyTorch-style initialisations give large logits) and falls, noisily, as Adam memorises the
//!   few random batches. bf16 keeps 8 significant bits to fp16's 11 and runs without a scaler;
//!   fp16 runs with one, which skips a step whenever an f16 gradient overflows (none at the
//!   defaults with `--seed 0`). The final losses of the three runs are comparable, not equal.
//! - bf16 is the fast precision on a CPU with AVX512-BF16 or AMX: its convolutions (im2col
//!   GEMMs) and the head run on the CPU's bf16 products. On this project's 2-core Xeon with AMX
//!   a bf16 step took 0.48x of the f32 step, an fp16 step 0.87-0.93x (f16 is converted to f32
//!   while packing: no x86 CPU multiplies it into an f32 sum); README, Results.
//! - Peak heap halves: the im2col buffers and the activations saved for backward are half
//!   precision.

mod common;

use candle_amp::nn::{self, loss};
use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW};
use candle_amp::{autocast, Bf16Policy, Fp16Policy, Policy, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::VarBuilder;
use clap::Parser;
use common::AmpPrecision;

/// Classes of the random labels.
const CLASSES: usize = 10;
/// Side of the square input images.
const SIDE: usize = 32;

/// The seed CNN (two conv blocks and a linear head, cross-entropy, Adam) trained in f32 and with
/// AMP (bf16 or fp16) side by side on random 3x32x32 images.
///
/// The defaults run both modes in a few seconds on 2 CPU cores.
#[derive(Parser, Debug)]
struct Args {
    /// Batch size.
    #[arg(long, default_value_t = 64, value_parser = common::positive)]
    batch: usize,
    /// Random batches per epoch, made once up front.
    #[arg(long, default_value_t = 6, value_parser = common::positive)]
    batches: usize,
    /// Epochs.
    #[arg(long, default_value_t = 5, value_parser = common::positive)]
    epochs: usize,
    /// AMP on (true) or off (false) in the "amp" run; off, it is the f32 program.
    #[arg(long, default_value_t = true, action = clap::ArgAction::Set)]
    enabled: bool,
    /// Lower precision of the AMP run [default: bf16 on CPU, fp16 on CUDA, as PyTorch's
    /// autocast]; fp16 trains with a GradScaler, bf16 without.
    #[arg(long, value_enum)]
    precision: Option<AmpPrecision>,
    /// Print one JSON line (`{"precision": .., "f32": {...}, "amp": {...}}`) instead of the table.
    #[arg(long)]
    json: bool,
    /// Print the precision report of the AMP run's first (untimed) step: each op call site,
    /// the precision it ran in, the casts inserted (to stderr with `--json`).
    #[arg(long)]
    precision_report: bool,
    /// Seed of the random batches and the initial weights (both modes start from the same
    /// ones): a run is repeatable, as with `torch.manual_seed`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Device to train on: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    device: Device,
}

/// Conv(3, 32, 3, pad 1) + ReLU + MaxPool(2), Conv(32, 64, 3, pad 1) + ReLU + MaxPool(2),
/// Linear(64 * 8 * 8, 10) (32x32 inputs are 8x8 after the two pools).
struct Cnn {
    conv1: nn::Conv2d,
    conv2: nn::Conv2d,
    pool: nn::MaxPool2d,
    head: nn::Linear,
}

impl Cnn {
    fn new(vb: &VarBuilder) -> Result<Self> {
        let cfg = nn::Conv2dConfig {
            padding: 1,
            ..Default::default()
        };
        let side = SIDE / 4; // two 2x2 pools
        Ok(Self {
            conv1: nn::conv2d(3, 32, 3, cfg, vb.pp("conv1"))?,
            conv2: nn::conv2d(32, 64, 3, cfg, vb.pp("conv2"))?,
            pool: nn::MaxPool2d::new(2),
            head: nn::linear(64 * side * side, CLASSES, vb.pp("head"))?,
        })
    }

    /// Logits `(batch, 10)` of images `(batch, 3, 32, 32)`: convolutions, pooling and head in
    /// the lower precision of the policy `Pol` (bf16 for `Bf16Policy`, f16 for `Fp16Policy`) when
    /// `use_amp`, plain f32 otherwise; the logits leave in f32 either way.
    #[autocast(policy = Pol, enabled = use_amp)]
    fn forward<Pol: Policy>(&self, x: &Tensor<F32>, use_amp: bool) -> Result<Tensor<F32>> {
        let h = self.conv1.forward(&x)?.relu()?;
        let h = self.pool.forward(&h)?;
        let h = self.conv2.forward(&h)?.relu()?;
        let h = self.pool.forward(&h)?;
        self.head.forward(&h.flatten_from(1)?)
    }
}

/// The random batches: images `(batch, 3, 32, 32)` from N(0, 1) and u32 labels `(batch)` in
/// `0..10`.
fn data(args: &Args) -> Result<Vec<(Tensor<F32>, candle_core::Tensor)>> {
    let mut rng = common::SeededData::new(args.seed);
    (0..args.batches)
        .map(|_| {
            let x = rng.randn((args.batch, 3, SIDE, SIDE), &args.device)?;
            Ok((x, rng.labels(args.batch, CLASSES as u32, &args.device)?))
        })
        .collect()
}

/// One mode of the seed CNN (see `common::run_mode`): Adam lr 1e-3 on cross-entropy, the
/// batches in order; with `amp`, the forward runs under the policy `Pol`.
fn run_mode<Pol: Policy>(
    label: Option<&str>,
    amp: bool,
    args: &Args,
    init: &common::Init,
    data: &[(Tensor<F32>, candle_core::Tensor)],
    steps: usize,
) -> Result<common::ModeResult> {
    let mode = common::Mode {
        label,
        quiet: args.json,
        amp,
        // `GradScaler(enabled=use_amp and dtype == torch.float16)`: fp16 needs loss scaling; bf16
        // has f32's range and, as in PyTorch, none.
        loss_scaling: amp && Pol::lower() == DType::F16,
        steps,
        precision_report: args.precision_report,
    };
    let params = ParamsAdamW {
        lr: 1e-3,
        weight_decay: 0.0, // Adam
        ..Default::default()
    };
    common::run_mode(
        &mode,
        init,
        &args.device,
        Cnn::new,
        |vars| AdamW::new(vars, params),
        |model, step, amp| {
            let (x, labels) = &data[step % data.len()];
            loss::cross_entropy(&model.forward::<Pol>(x, amp)?, labels)
        },
    )
}

/// The f32 run, then the AMP run under the policy `Pol`, from the same weights and batches.
fn train<Pol: Policy>(
    args: &Args,
    init: &common::Init,
    data: &[(Tensor<F32>, candle_core::Tensor)],
) -> Result<(common::ModeResult, common::ModeResult)> {
    let steps = args.epochs * data.len();
    common::f32_then_amp(args.enabled, Pol::NAME, steps, |label, amp, steps| {
        run_mode::<Pol>(label, amp, args, init, data, steps)
    })
}

fn main() -> Result<()> {
    common::keep_freed_memory();
    let args = Args::parse();
    let precision = args
        .precision
        .unwrap_or_else(|| AmpPrecision::default_for(&args.device));
    let data = data(&args)?;
    // One set of initial weights from the seed, copied into each mode's fresh model.
    let init = common::seeded_init(args.seed, &args.device, |vb| Cnn::new(vb).map(|_| ()))?;

    // The policy is a type: pick it once from the flag (PyTorch: `dtype = torch.bfloat16 if
    // args.precision == "bf16" else torch.float16`), the rest is the same generic code.
    let (f32, amp) = match precision {
        AmpPrecision::Bf16 => train::<Bf16Policy>(&args, &init, &data)?,
        AmpPrecision::Fp16 => train::<Fp16Policy>(&args, &init, &data)?,
    };
    let title = format!(
        "simple_cnn: 2x (Conv3x3 + ReLU + MaxPool2) + Linear({flat}, {CLASSES}) on random \
         3x{SIDE}x{SIDE} images, batch {b}, {n} batches x {e} epochs, cross-entropy, Adam lr \
         1e-3, {dev:?}",
        flat = 64 * (SIDE / 4) * (SIDE / 4),
        b = args.batch,
        n = args.batches,
        e = args.epochs,
        dev = args.device,
    );
    common::report(args.json, args.enabled, precision, &title, &f32, &amp)
}
