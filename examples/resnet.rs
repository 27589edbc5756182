//! The ResNet transfer-learning seed: a ResNet (18, 34 or 50) backbone and a new classification
//! head, trained in f32 and with AMP from the same initial weights on a synthetic image set;
//! and `--max-batch`, the largest batch whose training step fits a memory budget in each mode.
//!
//! ```text
//! cargo run --release --example resnet                              # ResNet-18, f32 vs AMP
//! cargo run --release --example resnet -- --json                    # one JSON line
//! cargo run --release --example resnet -- --max-batch --depth 50    # batch that fits 1 GiB
//! cargo run --release --example resnet -- --weights resnet18.safetensors --frozen
//! ```
//!
//! The seed (ResNet-50 on Caltech-256 with a 6 GB GPU) finds that AMP doubles the batch that fits
//! at equal accuracy. Here the budget is the peak memory of one training step (forward,
//! backward, optimizer step), weights included: on CPU the live heap bytes counted by the
//! example's allocator, `torch.cuda.max_memory_allocated`'s analogue; on CUDA the GPU memory
//! pool's high-water mark, that function itself.
//!
//! Data, made in code (no download): `--classes` kinds of 3-channel images, each class a
//! grating at its own orientation (jittered), with a random frequency, phase and colour tint and
//! strong noise per image; a training and a validation split. Training: SGD (lr `--lr`, a tenth
//! of it for the last quarter of the epochs), cross-entropy, `--epochs` passes over the training
//! split, validation accuracy after each. With `--frozen`
//! only the head trains: the backbone runs in eval mode and gets no gradient (the transfer-
//! learning setup, useful with `--weights`, a backbone in candle-transformers' / torchvision's
//! variable names; the head `fc.*` is always new). AMP: bf16 on CPU (no loss scaling), fp16 on
//! CUDA (with a GradScaler), as PyTorch's autocast defaults; `--precision` overrides.
//!
//! Prints a table per mode (ms per step, the first two steps untimed; peak memory, final
//! training loss, validation accuracy)
//! and writes `loss.png` and `accuracy.png` to `--out`; `--json` prints `{"precision": ..,
//! "f32": {..}, "amp": {..}}`, per mode `ms_per_step`, `peak_bytes`, `final_loss`,
//! `val_accuracy` (per epoch), `skipped_steps`. With `--max-batch`: `{"f32": {"max_batch",
//! "peak_bytes"}, "amp": {..}, "budget_bytes": .., "ratio": ..}`.

mod common;
#[path = "models/resnet.rs"]
mod resnet;

use std::f32::consts::PI;
use std::path::PathBuf;
use std::time::Instant;

use candle_amp::checkpoint;
use candle_amp::nn::loss;
use candle_amp::optim::{Optimizer, SGD};
use candle_amp::{autocast, Bf16Policy, Fp16Policy, GradScaler, Policy, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use common::modes::{self, HostMs};
use common::AmpPrecision;
use resnet::{Depth, ResNet};

#[derive(Parser, Debug)]
#[command(about = "ResNet transfer learning, f32 vs AMP, and the batch that fits a budget")]
struct Args {
    /// ResNet depth.
    #[arg(long, value_enum, default_value = "18")]
    depth: Depth,
    /// Image side in pixels.
    #[arg(long, default_value_t = 32, value_parser = common::positive)]
    image_size: usize,
    /// Classes of the synthetic set.
    #[arg(long, default_value_t = 8, value_parser = common::positive)]
    classes: usize,
    /// Training images per class.
    #[arg(long, default_value_t = 64, value_parser = common::positive)]
    train_per_class: usize,
    /// Validation images per class.
    #[arg(long, default_value_t = 64, value_parser = common::positive)]
    val_per_class: usize,
    /// Passes over the training split.
    #[arg(long, default_value_t = 8, value_parser = common::positive)]
    epochs: usize,
    /// Training batch.
    #[arg(long, default_value_t = 32, value_parser = common::positive)]
    batch: usize,
    /// SGD learning rate (a tenth of it for the last quarter of the epochs).
    #[arg(long, default_value_t = 0.02)]
    lr: f64,
    /// Train the head only: the backbone runs in eval mode and gets no gradient.
    #[arg(long)]
    frozen: bool,
    /// A backbone in candle-transformers' (torchvision's) names, as safetensors.
    #[arg(long)]
    weights: Option<PathBuf>,
    /// Lower precision of the AMP run [default: bf16 on CPU, fp16 on CUDA].
    #[arg(long, value_enum)]
    precision: Option<AmpPrecision>,
    /// Find the largest batch whose training step fits `--budget-mb`, in f32 and in AMP.
    #[arg(long)]
    max_batch: bool,
    /// The memory budget of `--max-batch`, in MiB of peak memory (the live heap on CPU, the
    /// GPU memory pool on CUDA).
    #[arg(long, default_value_t = 1024, value_parser = common::positive)]
    budget_mb: usize,
    /// Print one JSON line instead of the table.
    #[arg(long)]
    json: bool,
    /// Where the PNGs go.
    #[arg(long, default_value = "target/resnet")]
    out: PathBuf,
    /// Seed of the initial weights (the backbone's too unless `--weights` gives it): every mode
    /// starts from the same ones, and a run is repeatable, as with `torch.manual_seed`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Device: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    device: Device,
    /// After training, save each mode's checkpoint (`resnet-f32.safetensors`,
    /// `resnet-amp.safetensors`: weights, batch-norm statistics, optimizer, scaler, step) in
    /// this folder.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Resume each mode from its checkpoint in this folder, at the epoch it ended, and train up
    /// to `--epochs` epochs in all (PyTorch scripts' `for epoch in range(start, epochs)`); the
    /// learning-rate schedule is that of `--epochs` epochs.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Stop after this many epochs in all, the schedule still that of `--epochs` (an
    /// interrupted run): `--epochs 8 --stop-after 5 --save D`, then `--epochs 8 --resume D`,
    /// is `--epochs 8` to the bit.
    #[arg(long, value_parser = common::positive)]
    stop_after: Option<usize>,
}

/// Training steps left out of `ms_per_step` (warm-up), as PyTorch timings leave them out.
const UNTIMED_STEPS: usize = 2;

/// A seeded generator (splitmix64): the same images on every run.
struct Rng(u64);

impl Rng {
    fn next_f32(&mut self) -> f32 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 40) as f32 / (1u64 << 24) as f32
    }
}

/// `n` images per class, `(classes * n, 3, s, s)`, and their labels.
fn images(args: &Args, n: usize, seed: u64) -> Result<(Tensor<F32>, candle_core::Tensor)> {
    let s = args.image_size;
    let mut rng = Rng(seed);
    let mut pixels = Vec::with_capacity(args.classes * n * 3 * s * s);
    let mut labels = Vec::with_capacity(args.classes * n);
    for i in 0..args.classes * n {
        let class = i % args.classes;
        // Orientation by class, jittered by up to a quarter of the gap to the next class;
        // frequency random: the class is in the angle alone.
        let angle = PI * (class as f32 + 0.5 * (rng.next_f32() - 0.5)) / args.classes as f32;
        let freq = 2.0 + 2.0 * rng.next_f32();
        let phase = 2.0 * PI * rng.next_f32();
        let tint: Vec<f32> = (0..3).map(|_| 0.5 + 0.5 * rng.next_f32()).collect();
        for t in &tint {
            for y in 0..s {
                for x in 0..s {
                    let (u, v) = (x as f32 / s as f32, y as f32 / s as f32);
                    let wave =
                        (2.0 * PI * freq * (u * angle.cos() + v * angle.sin()) + phase).sin();
                    pixels.push(t * wave + 2.0 * (rng.next_f32() - 0.5));
                }
            }
        }
        labels.push(class as u32);
    }
    let x = Tensor::from_vec(pixels, (args.classes * n, 3, s, s), &args.device)?;
    let y = candle_core::Tensor::from_vec(labels, args.classes * n, &args.device)?;
    Ok((x, y))
}

/// The training step's forward: logits under the policy `Pol` when `amp`, f32 otherwise.
#[autocast(policy = Pol, enabled = amp)]
fn logits<Pol: Policy>(
    model: &ResNet,
    x: &Tensor<F32>,
    train: bool,
    frozen: bool,
    amp: bool,
) -> Result<Tensor<F32>> {
    model.forward(x, train, frozen)
}

/// One mode's figures.
#[derive(Debug, serde::Serialize)]
struct ModeResult {
    ms_per_step: f64,
    peak_bytes: usize,
    final_loss: f32,
    val_accuracy: Vec<f32>,
    skipped_steps: u64,
    /// Where the host's time of a timed step went (see `HostMs`).
    host_ms: HostMs,
    #[serde(skip)]
    losses: Vec<f32>,
}

/// A model from the shared initial weights (and `--weights` over them, head excluded).
fn model(args: &Args, init: &common::Init) -> Result<(VarMap, ResNet)> {
    let mut vars = VarMap::new();
    let model = ResNet::new(
        args.depth,
        args.classes,
        &VarBuilder::from_varmap(&vars, DType::F32, &args.device),
    )?;
    vars.set(init.iter().map(|(name, t)| (name, t)))?;
    Ok((vars, model))
}

/// The variables that train: all of them, or the head's with `--frozen`.
fn trained_vars(args: &Args, vars: &VarMap) -> Vec<candle_core::Var> {
    let data = vars
        .data()
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    data.iter()
        .filter(|(name, _)| !args.frozen || name.starts_with("fc."))
        .map(|(_, v)| v.clone())
        .collect()
}

/// Trains one mode from `init` and validates after each epoch.
fn train<Pol: Policy>(
    args: &Args,
    amp: bool,
    init: &common::Init,
    data: &Data,
) -> Result<ModeResult> {
    let peak = common::Peak::start(&args.device)?;
    let (vars, model) = model(args, init)?;
    let mut opt = SGD::new(trained_vars(args, &vars), args.lr)?;
    let mut scaler = GradScaler::builder()
        .enabled(amp && Pol::lower() == DType::F16)
        .build()?;
    let n = data.train_x.dim(0)?;
    let steps_per_epoch = n.div_ceil(args.batch);
    let label = if amp { Pol::NAME } else { "f32" };
    let file = |dir: &PathBuf| {
        dir.join(format!(
            "resnet-{}.safetensors",
            if amp { "amp" } else { "f32" }
        ))
    };
    let first_epoch = match &args.resume {
        Some(dir) => {
            let step = checkpoint::load(file(dir), &vars, &mut opt, &mut scaler)?;
            common::note_resumed_rate(opt.learning_rate(), args.lr);
            resumed_epoch(step, steps_per_epoch, args.epochs)?
        }
        None => 0,
    };
    let last_epoch = args.stop_after.map_or(args.epochs, |e| e.min(args.epochs));
    let bar = common::progress(
        (last_epoch.saturating_sub(first_epoch) * steps_per_epoch) as u64,
        label,
        args.json,
    );
    let (mut losses, mut val_accuracy) = (Vec::new(), Vec::new());
    // The first steps are untimed: CUDA loads kernels and cuDNN picks algorithms per shape.
    let (mut timed, mut timed_steps) = (std::time::Duration::ZERO, 0usize);
    let mut host = HostMs::default();
    for epoch in first_epoch..last_epoch {
        // The usual step schedule: a tenth of the rate for the last quarter of the epochs (set
        // every epoch, so that a resumed run has it too).
        let last_quarter = args.epochs >= 4 && epoch >= args.epochs - args.epochs / 4;
        opt.set_learning_rate(if last_quarter {
            args.lr / 10.0
        } else {
            args.lr
        });
        // The same shuffle per epoch in both modes (Fisher-Yates from a seeded generator).
        let mut order: Vec<u32> = (0..n as u32).collect();
        let mut rng = Rng(100 + epoch as u64);
        for i in (1..n).rev() {
            order.swap(i, (rng.next_f32() * (i + 1) as f32) as usize % (i + 1));
        }
        for step in 0..steps_per_epoch {
            let idx = &order[step * args.batch..((step + 1) * args.batch).min(n)];
            let idx = candle_core::Tensor::new(idx, &args.device)?;
            let x = Tensor::<F32>::from_candle(data.train_x.as_candle().index_select(&idx, 0)?)?;
            let y = data.train_y.index_select(&idx, 0)?;
            let start = Instant::now();
            let (value, phases) = modes::train_step(&mut opt, &mut scaler, |_| {
                loss::cross_entropy(&logits::<Pol>(&model, &x, true, args.frozen, amp)?, &y)
            })?;
            if losses.len() >= UNTIMED_STEPS {
                timed += start.elapsed();
                timed_steps += 1;
                host.add(phases);
            }
            losses.push(value);
            bar.set_message(format!("epoch {} loss {value:.4}", epoch + 1));
            bar.inc(1);
        }
        val_accuracy.push(accuracy::<Pol>(args, &model, data, amp)?);
    }
    bar.finish_and_clear();
    if let Some(dir) = &args.save {
        std::fs::create_dir_all(dir)?;
        let step = (last_epoch * steps_per_epoch) as u64;
        checkpoint::save(file(dir), &vars, &opt, &scaler, step)?;
    }
    Ok(ModeResult {
        ms_per_step: timed.as_secs_f64() * 1e3 / timed_steps.max(1) as f64,
        peak_bytes: peak.bytes()?,
        // The last tenth of the whole run's steps (a resumed run's too, when it holds them).
        final_loss: common::mean_tail_n(
            &losses,
            (args.epochs * steps_per_epoch / 10).clamp(1, losses.len().max(1)),
        ),
        val_accuracy,
        skipped_steps: scaler.skipped_steps(),
        host_ms: host.per_step(timed_steps),
        losses,
    })
}

/// The epoch a checkpoint saved after `step` steps ended, which must be a whole number of
/// epochs of this run's data and batch, and before `epochs`.
fn resumed_epoch(step: u64, steps_per_epoch: usize, epochs: usize) -> Result<usize> {
    let step = step as usize;
    if !step.is_multiple_of(steps_per_epoch) {
        candle_core::bail!(
            "resume: the checkpoint was saved after {step} steps, not a whole number of this \
             run's epochs of {steps_per_epoch} steps (another --batch or data size?)"
        )
    }
    let epoch = step / steps_per_epoch;
    if epoch >= epochs {
        candle_core::bail!(
            "resume: the checkpoint is at epoch {epoch}; --epochs {epochs} leaves nothing to train"
        )
    }
    Ok(epoch)
}

/// Validation accuracy in percent, in eval mode.
fn accuracy<Pol: Policy>(args: &Args, model: &ResNet, data: &Data, amp: bool) -> Result<f32> {
    let n = data.val_x.dim(0)?;
    let mut correct = 0usize;
    for start in (0..n).step_by(args.batch.max(64)) {
        let len = args.batch.max(64).min(n - start);
        let x = data.val_x.narrow(0, start, len)?;
        let predicted = logits::<Pol>(model, &x, false, false, amp)?
            .as_candle()
            .argmax(1)?;
        let labels = data.val_y.narrow(0, start, len)?;
        correct += predicted
            .eq(&labels)?
            .to_dtype(DType::U32)?
            .sum_all()?
            .to_scalar::<u32>()? as usize;
    }
    Ok(100.0 * correct as f32 / n as f32)
}

struct Data {
    train_x: Tensor<F32>,
    train_y: candle_core::Tensor,
    val_x: Tensor<F32>,
    val_y: candle_core::Tensor,
}

/// Peak memory of one training step at `batch`, from a fresh model (see `common::Peak`).
fn step_peak<Pol: Policy>(
    args: &Args,
    init: &common::Init,
    batch: usize,
    amp: bool,
) -> Result<usize> {
    let peak = common::Peak::start(&args.device)?;
    let (vars, model) = model(args, init)?;
    let mut opt = SGD::new(trained_vars(args, &vars), args.lr)?;
    let mut scaler = GradScaler::builder()
        .enabled(amp && Pol::lower() == DType::F16)
        .build()?;
    let s = args.image_size;
    let x = Tensor::<F32>::randn(0.0, 1.0, (batch, 3, s, s), &args.device)?;
    let y = candle_core::Tensor::zeros(batch, DType::U32, &args.device)?;
    let l = loss::cross_entropy(&logits::<Pol>(&model, &x, true, args.frozen, amp)?, &y)?;
    let _ = scaler.step(&mut opt, scaler.scale(l.as_candle())?.backward()?)?;
    scaler.update()?;
    peak.bytes()
}

/// The largest batch whose step peaks within `budget` bytes: doubling, then bisection.
fn max_batch<Pol: Policy>(
    args: &Args,
    init: &common::Init,
    amp: bool,
    budget: usize,
) -> Result<(usize, usize)> {
    let label = if amp { Pol::NAME } else { "f32" };
    let probe = |batch: usize| -> Result<usize> {
        let peak = step_peak::<Pol>(args, init, batch, amp)?;
        if !args.json {
            eprintln!(
                "  {label}: batch {batch:>5} peaks at {:>8.1} MiB",
                peak as f64 / (1 << 20) as f64
            );
        }
        Ok(peak)
    };
    // From 2: batch norm in training needs two values per channel (at 32x32 the last stage
    // is 1x1), as in PyTorch.
    let (mut good, mut good_peak) = (1, 0);
    let mut bad = 2;
    loop {
        let peak = probe(bad)?;
        if peak > budget {
            break;
        }
        (good, good_peak) = (bad, peak);
        bad *= 2;
    }
    if good_peak == 0 {
        // Batch 2, the smallest that trains, is already over the budget: no batch was found.
        candle_core::bail!(
            "--budget-mb {}: no training batch fits ({label}: batch 2 already needs more)",
            args.budget_mb
        )
    }
    while bad - good > 1 {
        let mid = usize::midpoint(good, bad);
        let peak = probe(mid)?;
        if peak > budget {
            bad = mid;
        } else {
            (good, good_peak) = (mid, peak);
        }
    }
    Ok((good, good_peak))
}

fn main() -> Result<()> {
    common::keep_freed_memory();
    let args = Args::parse();
    let precision = args
        .precision
        .unwrap_or_else(|| AmpPrecision::default_for(&args.device));
    // One set of initial weights (with `--weights` over the backbone), copied into every model.
    let mut init_map = VarMap::new();
    let build = |vb: &VarBuilder| ResNet::new(args.depth, args.classes, vb).map(|_| ());
    build(&VarBuilder::from_varmap(
        &init_map,
        DType::F32,
        &args.device,
    ))?;
    let seeded = common::seeded_init(args.seed, &args.device, build)?;
    init_map.set(seeded.iter().map(|(name, t)| (name, t)))?;
    if let Some(path) = &args.weights {
        let loaded = resnet::load_backbone(&init_map, path, &args.device)?;
        if !args.json {
            println!("loaded {loaded} backbone tensors from {}", path.display());
        }
    }
    let init = common::snapshot(&init_map)?;
    drop(init_map);
    match precision {
        AmpPrecision::Bf16 => run::<Bf16Policy>(&args, precision, &init),
        AmpPrecision::Fp16 => run::<Fp16Policy>(&args, precision, &init),
    }
}

fn run<Pol: Policy>(args: &Args, precision: AmpPrecision, init: &common::Init) -> Result<()> {
    if args.max_batch {
        let budget = args.budget_mb.checked_mul(1 << 20).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "--budget-mb {} does not fit in bytes (usize)",
                args.budget_mb
            ))
        })?;
        if !args.json {
            eprintln!(
                "{}: the largest training batch within {} MiB",
                args.depth.name(),
                args.budget_mb
            );
        }
        let (f32_batch, f32_peak) = max_batch::<Pol>(args, init, false, budget)?;
        let (amp_batch, amp_peak) = max_batch::<Pol>(args, init, true, budget)?;
        let ratio = amp_batch as f64 / f32_batch.max(1) as f64;
        if args.json {
            let line = serde_json::json!({
                "f32": {"max_batch": f32_batch, "peak_bytes": f32_peak},
                "amp": {"max_batch": amp_batch, "peak_bytes": amp_peak, "precision": precision},
                "budget_bytes": budget,
                "ratio": ratio,
            });
            println!("{line}");
        } else {
            let mib = |b: usize| b as f64 / (1 << 20) as f64;
            println!(
                "{}, {}x{} images, budget {} MiB: f32 batch {f32_batch} ({:.0} MiB), {} batch {amp_batch} ({:.0} MiB): {ratio:.2}x",
                args.depth.name(),
                args.image_size,
                args.image_size,
                args.budget_mb,
                mib(f32_peak),
                precision.label(),
                mib(amp_peak)
            );
        }
        return Ok(());
    }
    let (train_x, train_y) = images(args, args.train_per_class, 1)?;
    let (val_x, val_y) = images(args, args.val_per_class, 2)?;
    let data = Data {
        train_x,
        train_y,
        val_x,
        val_y,
    };
    let f32_run = train::<Pol>(args, false, init, &data)?;
    let amp_run = train::<Pol>(args, true, init, &data)?;
    if args.json {
        println!(
            "{}",
            serde_json::json!({"precision": precision, "f32": f32_run, "amp": amp_run})
        );
    } else {
        println!(
            "{} {}, {} classes of {}x{} synthetic images ({} train, {} validation), batch {}, {} epochs, SGD lr {}{}",
            args.depth.name(),
            if args.weights.is_some() { "from --weights" } else { "from scratch" },
            args.classes,
            args.image_size,
            args.image_size,
            data.train_x.dim(0)?,
            data.val_x.dim(0)?,
            args.batch,
            args.epochs,
            args.lr,
            if args.frozen { ", backbone frozen" } else { "" }
        );
        println!(
            "| mode | ms per step | peak MiB | final loss | val accuracy % per epoch | skipped |"
        );
        println!("|---|---|---|---|---|---|");
        for (name, r) in [("f32".to_string(), &f32_run), (precision.label(), &amp_run)] {
            let acc: Vec<String> = r.val_accuracy.iter().map(|a| format!("{a:.1}")).collect();
            println!(
                "| {name} | {:.1} | {:.1} | {:.4} | {} | {} |",
                r.ms_per_step,
                r.peak_bytes as f64 / (1 << 20) as f64,
                r.final_loss,
                acc.join(" "),
                r.skipped_steps
            );
        }
    }
    if let Err(e) = plots(args, precision, &f32_run, &amp_run) {
        eprintln!("plots not written: {e}");
    }
    common::check_finite([("f32", f32_run.final_loss), ("amp", amp_run.final_loss)])
}

fn plots(
    args: &Args,
    precision: AmpPrecision,
    f32_run: &ModeResult,
    amp_run: &ModeResult,
) -> std::result::Result<(), Box<dyn std::error::Error>> {
    std::fs::create_dir_all(&args.out)?;
    let label = precision.label();
    common::curves::draw_losses(
        &args.out.join("loss.png"),
        &format!("{}: training loss", args.depth.name()),
        &[("f32", &f32_run.losses), (&label, &amp_run.losses)],
    )?;
    // Accuracy is drawn as "error" (100 - accuracy) on the same log-scale plot.
    let error = |r: &ModeResult| -> Vec<f32> {
        r.val_accuracy
            .iter()
            .map(|a| (100.0 - a).max(0.1))
            .collect()
    };
    common::curves::draw_losses(
        &args.out.join("accuracy.png"),
        &format!("{}: validation error % per epoch", args.depth.name()),
        &[("f32", &error(f32_run)), (&label, &error(amp_run))],
    )?;
    if !args.json {
        println!(
            "wrote {} and {}",
            args.out.join("loss.png").display(),
            args.out.join("accuracy.png").display()
        );
    }
    Ok(())
}
