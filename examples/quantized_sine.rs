//! The main job: the AMP experiment of AMD's ROCm blog, a 2-D quantized sine learnt by a 1x1-conv
//! network (on a GPU the blog reports AMP 46% faster with 50% less memory, final loss 0.0083
//! against f32's 0.01), trained in f32 and then with AMP in one process, then run for inference.
//!
//! Data: the (2, H, W) grid of coordinates in [0, 1]; target cos(2 pi 4x) + cos(2 pi 2y)
//! digitised into 4 levels and standardised to [0, 1]. Model: Conv(2, h) + BatchNorm + ReLU,
//! two Conv(h, h) + BatchNorm + ReLU, Conv(h, 1), all 1x1; MSE; Adam lr 1e-3; one step per
//! epoch on the whole grid.
//!
//! `--precision bf16|fp16` chooses the AMP run's lower precision, as `dtype=` does for
//! `torch.autocast`; without it, PyTorch's defaults: bf16 on CPU, fp16 on CUDA. fp16 trains with
//! a `GradScaler`; bf16, whose range is f32's, without one (as in PyTorch). The forward is
//! generic over the autocast policy (`#[autocast(policy = Pol, enabled = amp)]`), and `main`
//! picks `Bf16Policy` or `Fp16Policy` once from the flag.
//!
//! ```text
//! cargo run --release --example quantized_sine                     # a few seconds on 2 cores
//! cargo run --release --example quantized_sine -- --precision fp16 # fp16 + GradScaler
//! cargo run --release --example quantized_sine -- --json           # one JSON object on stdout
//! cargo run --release --example quantized_sine -- --seed 7         # other initial weights
//! cargo run --release --example quantized_sine -- --seeds 16       # final losses of seeds 0-15
//! cargo run --release --example quantized_sine -- --seeds 16 --jitter 1e-4  # 16 starts near seed 0's
//! cargo run --release --example quantized_sine -- --size 512 --hidden 256 --epochs 512  # the blog
//! ```
//!
//! Prints a table (time per step, the first step of each mode untimed; peak memory (heap on CPU, GPU memory pool on CUDA), final loss, skipped steps, final scale; AMP's
//! speedup and memory saving), the AMP row named by its precision (`AMP (bf16)`), and writes
//! `outputs.png` (target | f32 | AMP) and `loss.png` (both loss curves) to `--out` (default
//! `target/quantized_sine`). `--json` prints `{"precision": "bf16", "f32": {...}, "amp":
//! {...}}`. On a CPU with AVX512-BF16 the bf16 run's GEMMs use its bf16 dot product, and AMX
//! tiles where it has them: at the blog's width (`--size 128 --hidden 256`) an AMP step takes
//! 0.5-0.7x the f32 step on Zen 4 and 0.34-0.41x on a Xeon with AMX; at the toy default sizes
//! per-op overheads dominate and the gain is smaller. x86 CPUs have no f16 product that
//! accumulates in f32 (AVX512-FP16 accumulates in f16), so fp16 runs at f32's speed or slower
//! there. The blog's GPU figures need `--device cuda` in a
//! `--features cuda` build.

mod common;
#[path = "models/sine.rs"]
mod sine;

use std::f64::consts::PI;
use std::path::{Path, PathBuf};
use std::time::Instant;

use candle_amp::nn::loss;
use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW};
use candle_amp::report::{self, PrecisionReport};
use candle_amp::{Bf16Policy, Fp16Policy, GradScaler, Policy, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use common::{AmpPrecision, ModeResult};
use sine::Model;

#[derive(Parser, Debug)]
#[command(about = "The ROCm blog's quantized-sine AMP experiment: f32 vs AMP, side by side")]
struct Args {
    /// Grid side (the blog: 512).
    #[arg(long, default_value_t = 32)]
    size: usize,
    /// Hidden channels (the blog: 256).
    #[arg(long, default_value_t = 64)]
    hidden: usize,
    /// Training steps, one per epoch over the whole grid (the blog: 512).
    #[arg(long, default_value_t = 500)]
    epochs: usize,
    /// Lower precision of the AMP run [default: bf16 on CPU, fp16 on CUDA, as PyTorch's
    /// autocast]; fp16 trains with a GradScaler, bf16 without.
    #[arg(long, value_enum)]
    precision: Option<AmpPrecision>,
    /// Print one JSON object `{"precision": .., "f32": {...}, "amp": {...}}` instead of the
    /// table.
    #[arg(long)]
    json: bool,
    /// Print the precision report of the AMP run's first training step: each op call site, the
    /// precision it ran in, the casts inserted (to stderr with `--json`).
    #[arg(long)]
    precision_report: bool,
    /// Where the PNGs go.
    #[arg(long, default_value = "target/quantized_sine")]
    out: PathBuf,
    /// Seed of the initial weights (both modes start from the same ones): a run is repeatable,
    /// as with `torch.manual_seed`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Train `--seed` and the next seeds, `seeds` in all, and report only each seed's final
    /// losses and how far AMP ends from f32 (each seed's gap, their median and largest): one
    /// seed's final loss is one trajectory, and how far two runs end apart moves by several
    /// percent from seed to seed.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u64).range(1..))]
    seeds: u64,
    /// Relative noise on the initial weights: each is multiplied by `1 + jitter * n`, `n` drawn
    /// from N(0, 1) (both runs of a pair start from the same weights). With `--seeds N` the N
    /// pairs are N draws of that noise around `--seed`'s weights instead of N seeds: how far
    /// runs from almost the same start end apart, f32 from f32 as well as AMP from f32.
    #[arg(long, default_value_t = 0.0, value_parser = noise_scale)]
    jitter: f64,
    /// Device: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    device: Device,
}

/// A finite number >= 0, as a clap value parser.
fn noise_scale(s: &str) -> std::result::Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if v >= 0.0 && v.is_finite() => Ok(v),
        Ok(_) => Err("must be a finite number >= 0".into()),
        Err(e) => Err(e.to_string()),
    }
}

/// Inputs `(1, 2, size, size)` and target `(1, 1, size, size)`.
fn data(size: usize, dev: &Device) -> Result<(Tensor<F32>, Tensor<F32>)> {
    let coord = |i: usize| i as f64 / (size - 1) as f64;
    let mut grid = Vec::with_capacity(2 * size * size);
    for channel in 0..2 {
        for row in 0..size {
            for col in 0..size {
                grid.push(coord(if channel == 0 { col } else { row }) as f32);
            }
        }
    }
    let mut target = Vec::with_capacity(size * size);
    for row in 0..size {
        for col in 0..size {
            let v = (2.0 * PI * 4.0 * coord(col)).cos() + (2.0 * PI * 2.0 * coord(row)).cos();
            // v in [-2, 2] -> level 0..=3 -> standardised to [0, 1].
            let level = ((v + 2.0) / 4.0 * 4.0).floor().clamp(0.0, 3.0);
            target.push((level / 3.0) as f32);
        }
    }
    Ok((
        Tensor::from_vec(grid, (1, 2, size, size), dev)?,
        Tensor::from_vec(target, (1, 1, size, size), dev)?,
    ))
}

/// Timed eval-mode calls per mode; the inference figure is their median.
const INFERENCE_CALLS: usize = 5;

/// What one mode produced besides its figures.
struct Run {
    result: ModeResult,
    losses: Vec<f32>,
    output: Vec<f32>,
    inference_ms: f64,
    /// With `--precision-report`, the AMP run's first step.
    report: Option<PrecisionReport>,
}

/// Trains a fresh model from the `init` weights in one mode (with `amp`, under the policy
/// `Pol`), then runs inference; peak memory counted from model creation.
fn run<Pol: Policy>(
    args: &Args,
    amp: bool,
    x: &Tensor<F32>,
    target: &Tensor<F32>,
    init: &common::Init,
) -> Result<Run> {
    let peak = common::Peak::start(x.device())?;
    let dev = x.device().clone();
    let mut vars = VarMap::new();
    let model = Model::new(
        args.hidden,
        &VarBuilder::from_varmap(&vars, DType::F32, &dev),
    )?;
    vars.set(init.iter().map(|(name, t)| (name, t)))?;
    let params = ParamsAdamW {
        lr: 1e-3,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(vars.all_vars(), params)?;
    // `GradScaler(enabled=use_amp and dtype == torch.float16)`: fp16 needs loss scaling; bf16 has
    // f32's range and, as in PyTorch, none.
    let fp16 = Pol::lower() == DType::F16;
    let mut scaler = GradScaler::builder().enabled(amp && fp16).build()?;
    let label = if amp { Pol::NAME } else { "f32" };
    let bar = common::progress(args.epochs as u64, label, args.json);
    let mut losses = Vec::new();
    let mut step = |opt: &mut AdamW| -> Result<f32> {
        let l = loss::mse(&model.forward::<Pol>(x, true, amp)?, target)?;
        let grads = scaler.scale(&l)?.backward()?;
        let _ = scaler.step(opt, grads)?;
        scaler.update()?;
        l.to_scalar::<f32>()
    };
    let mut first_step_report = None;
    let mut start = Instant::now();
    for epoch in 0..args.epochs {
        if epoch == 1 {
            // Step 0 is the untimed warm-up, as in the other examples: the first mode would
            // otherwise pay the process's one-off costs (thread pool, allocator growth).
            start = Instant::now();
        }
        let value = if amp && args.precision_report && epoch == 0 {
            let (value, rep) = report::record(|| step(&mut opt));
            first_step_report = Some(rep);
            value?
        } else {
            step(&mut opt)?
        };
        losses.push(value);
        bar.set_message(format!("loss {value:.5}"));
        bar.inc(1);
    }
    let timed_steps = args.epochs.saturating_sub(1).max(1);
    let ms_per_step = start.elapsed().as_secs_f64() * 1e3 / timed_steps as f64;
    bar.finish_and_clear();

    // Inference: one warm-up call (the first eval-mode call pays one-off costs), then the median
    // of a few timed calls; one call of well under a millisecond is too noisy to compare.
    // Each call's output is dropped before the next call, so the peak is one call's.
    let mut output = Some(model.forward::<Pol>(x, false, amp)?);
    let mut times = Vec::with_capacity(INFERENCE_CALLS);
    for _ in 0..INFERENCE_CALLS {
        drop(output.take());
        let start = Instant::now();
        let y = model.forward::<Pol>(x, false, amp)?;
        x.device().synchronize()?; // on CUDA, wait for the queued kernels before reading the timer
        times.push(start.elapsed().as_secs_f64() * 1e3);
        output = Some(y);
    }
    let inference_ms = common::median(&mut times);
    let output = output.map_or(Ok(Vec::new()), |y| y.to_flat_vec::<f32>())?;
    let result = ModeResult {
        ms_per_step,
        peak_bytes: peak.bytes()?,
        final_loss: *losses.last().unwrap_or(&f32::NAN),
        skipped_steps: scaler.skipped_steps(),
        final_scale: scaler.scale_value(),
    };
    Ok(Run {
        result,
        losses,
        output,
        inference_ms,
        report: first_step_report,
    })
}

/// The f32 run, then the AMP run under the policy `Pol`, from the same initial weights.
fn train<Pol: Policy>(
    args: &Args,
    x: &Tensor<F32>,
    target: &Tensor<F32>,
    init: &common::Init,
) -> Result<(Run, Run)> {
    let f32_run = run::<Pol>(args, false, x, target, init)?;
    let amp_run = run::<Pol>(args, true, x, target, init)?;
    Ok((f32_run, amp_run))
}

/// Each initial weight times `1 + scale * n`, `n` from N(0, 1) drawn by a generator seeded
/// with `draw` (the same noise for the same draw, whatever the seed).
fn jittered(init: &common::Init, scale: f64, draw: u64) -> Result<common::Init> {
    use rand::SeedableRng;
    use rand_distr::{Distribution, StandardNormal};
    let mut rng = rand::rngs::StdRng::seed_from_u64(draw ^ 0x6a69_7474_6572_0000); // "jitter"
    init.iter()
        .map(|(name, t)| {
            let noise: Vec<f32> = (0..t.elem_count())
                .map(|_| {
                    let n: f64 = StandardNormal.sample(&mut rng);
                    1.0 + (scale * n) as f32
                })
                .collect();
            let noise = candle_core::Tensor::from_vec(noise, t.shape(), t.device())?;
            Ok((name.clone(), t.mul(&noise)?))
        })
        .collect()
}

/// Both runs from the initial weights of `seed`, times draw `draw` of the `--jitter` noise.
fn train_seed(
    args: &Args,
    precision: AmpPrecision,
    (seed, draw): (u64, u64),
    x: &Tensor<F32>,
    target: &Tensor<F32>,
) -> Result<(Run, Run)> {
    // One set of initial weights from the seed, copied into each mode's fresh model.
    let mut init = common::seeded_init(seed, x.device(), |vb| {
        Model::new(args.hidden, vb).map(|_| ())
    })?;
    if args.jitter > 0.0 {
        init = jittered(&init, args.jitter, draw)?;
    }
    // The policy is a type: pick it once from the flag (PyTorch: `dtype = torch.bfloat16 if
    // args.precision == "bf16" else torch.float16`), the rest is the same generic code.
    match precision {
        AmpPrecision::Bf16 => train::<Bf16Policy>(args, x, target, &init),
        AmpPrecision::Fp16 => train::<Fp16Policy>(args, x, target, &init),
    }
}

/// One pair of a `--seeds` sweep: both final losses and AMP's gap, `(amp - f32) / f32`.
#[derive(serde::Serialize)]
struct SeedResult {
    seed: u64,
    /// The `--jitter` draw, with `--jitter`.
    #[serde(skip_serializing_if = "Option::is_none")]
    draw: Option<u64>,
    f32: f32,
    amp: f32,
    gap: f64,
}

/// `--seeds`: each pair's final losses and AMP's gap to f32, then the median gap, the largest
/// in size, and how far the f32 runs end from their own median (lowest and highest, relative):
/// `{"precision": .., "seeds": [{"seed", "draw"?, "f32", "amp", "gap"}, ..], "median_gap": ..,
/// "largest_gap": .., "f32_spread": [low, high]}` with `--json`.
fn sweep(
    args: &Args,
    precision: AmpPrecision,
    x: &Tensor<F32>,
    target: &Tensor<F32>,
) -> Result<()> {
    let jitter = args.jitter > 0.0;
    if !jitter && args.seed.checked_add(args.seeds).is_none() {
        candle_core::bail!(
            "--seed {} plus --seeds {} is past u64",
            args.seed,
            args.seeds
        )
    }
    let mut seeds = Vec::new();
    for i in 0..args.seeds {
        let (seed, draw) = if jitter {
            (args.seed, Some(i))
        } else {
            (args.seed + i, None)
        };
        let (f32_run, amp_run) = train_seed(args, precision, (seed, draw.unwrap_or(0)), x, target)?;
        let (f32, amp) = (f32_run.result.final_loss, amp_run.result.final_loss);
        let row = SeedResult {
            seed,
            draw,
            f32,
            amp,
            gap: f64::from(amp - f32) / f64::from(f32),
        };
        if !args.json {
            let name = draw.map_or(format!("seed {seed:>3}"), |d| format!("draw {d:>3}"));
            println!(
                "{name}: f32 {f32:.6}  {} {amp:.6}  gap {:+.2}%",
                precision.label(),
                row.gap * 100.0
            );
        }
        seeds.push(row);
    }
    let mut gaps: Vec<f64> = seeds.iter().map(|r| r.gap).collect();
    let largest = gaps
        .iter()
        .copied()
        .max_by(|a, b| a.abs().total_cmp(&b.abs()))
        .unwrap_or(f64::NAN);
    let median_gap = common::median(&mut gaps);
    let mut f32s: Vec<f64> = seeds.iter().map(|r| f64::from(r.f32)).collect();
    let f32_median = common::median(&mut f32s);
    let spread = [
        f32s[0] / f32_median - 1.0,
        f32s[f32s.len() - 1] / f32_median - 1.0,
    ];
    if args.json {
        let out = serde_json::json!({
            "precision": precision,
            "seeds": seeds,
            "median_gap": median_gap,
            "largest_gap": largest,
            "f32_spread": spread,
        });
        println!("{out}");
    } else {
        let runs = if jitter {
            format!(
                "{} draws of jitter {} around seed {}",
                seeds.len(),
                args.jitter,
                args.seed
            )
        } else {
            format!("{} seeds", seeds.len())
        };
        println!(
            "{} final loss against f32 over {runs}: median gap {:+.2}%, largest {:+.2}%\n\
             f32 final losses: median {f32_median:.6}, from {:+.2}% to {:+.2}% of it",
            precision.label(),
            median_gap * 100.0,
            largest * 100.0,
            spread[0] * 100.0,
            spread[1] * 100.0,
        );
    }
    Ok(())
}

fn main() -> Result<()> {
    common::keep_freed_memory();
    let args = Args::parse();
    let dev = args.device.clone();
    let precision = args
        .precision
        .unwrap_or_else(|| AmpPrecision::default_for(&dev));
    if args.size < 2 || args.hidden == 0 || args.epochs == 0 {
        candle_core::bail!("--size must be >= 2, --hidden and --epochs >= 1");
    }
    let (x, target) = data(args.size, &dev)?;
    if args.seeds > 1 {
        return sweep(&args, precision, &x, &target);
    }
    let (f32_run, amp_run) = train_seed(&args, precision, (args.seed, 0), &x, &target)?;

    let target = target.to_flat_vec::<f32>()?;
    let written = plots(&args, precision, &target, &f32_run, &amp_run);
    if args.json {
        println!(
            "{}",
            common::json(precision, &f32_run.result, &amp_run.result)
        );
    } else {
        let title = format!(
            "quantized_sine: {0}x{0} grid, hidden {1}, {2} steps, Adam 1e-3, {3:?}\n{4}",
            args.size,
            args.hidden,
            args.epochs,
            dev,
            common::amp_description(precision)
        );
        print!(
            "{}",
            common::table(&title, precision, &f32_run.result, &amp_run.result)
        );
        println!(
            "inference (eval mode, whole grid, median of {INFERENCE_CALLS}): f32 {:.2} ms, {} {:.2} ms",
            f32_run.inference_ms,
            precision.label(),
            amp_run.inference_ms
        );
    }
    if let Some(rep) = &amp_run.report {
        if args.json {
            eprintln!("{rep}");
        } else {
            println!("\n{rep}");
        }
    }
    match written {
        Ok(files) if !args.json => {
            for f in files {
                println!("wrote {}", f.display());
            }
        }
        Ok(_) => {}
        Err(e) => eprintln!("plots not written: {e}"),
    }
    common::check_finite([
        ("f32", f32_run.result.final_loss),
        ("amp", amp_run.result.final_loss),
    ])
}

type PlotResult<T> = std::result::Result<T, Box<dyn std::error::Error>>;

/// Writes `outputs.png` (target | f32 | AMP) and `loss.png` into `--out`, the AMP panel and
/// curve named by the precision (`AMP (bf16)`).
fn plots(
    args: &Args,
    precision: AmpPrecision,
    target: &[f32],
    f32_run: &Run,
    amp_run: &Run,
) -> PlotResult<Vec<PathBuf>> {
    std::fs::create_dir_all(&args.out)?;
    common::register_font();
    let amp = precision.label();
    let images = args.out.join("outputs.png");
    draw_images(
        &images,
        args.size,
        &[
            ("target", target),
            ("f32 output", &f32_run.output),
            (&format!("{amp} output"), &amp_run.output),
        ],
    )?;
    let curves = args.out.join("loss.png");
    common::curves::draw_losses(
        &curves,
        "quantized_sine: training loss (MSE)",
        &[("f32", &f32_run.losses), (&amp, &amp_run.losses)],
    )?;
    Ok(vec![images, curves])
}

fn draw_images(path: &Path, size: usize, panels: &[(&str, &[f32])]) -> PlotResult<()> {
    use plotters::prelude::*;
    let side = 256u32;
    let (w, h) = (
        side * panels.len() as u32 + 10 * (panels.len() as u32 + 1),
        side + 40,
    );
    let root = BitMapBackend::new(path, (w, h)).into_drawing_area();
    root.fill(&WHITE)?;
    for (i, (title, values)) in panels.iter().enumerate() {
        let x0 = 10 + i as i32 * (side as i32 + 10);
        root.draw(&Text::new(
            (*title).to_string(),
            (x0, 8),
            ("sans-serif", 18).into_font(),
        ))?;
        let cell = side as f64 / size as f64;
        for (k, v) in values.iter().enumerate() {
            let (row, col) = (k / size, k % size);
            let shade = (v.clamp(0.0, 1.0) * 255.0) as u8;
            let (px, py) = (
                x0 + (col as f64 * cell) as i32,
                32 + (row as f64 * cell) as i32,
            );
            let (qx, qy) = (
                x0 + ((col + 1) as f64 * cell).ceil() as i32,
                32 + ((row + 1) as f64 * cell).ceil() as i32,
            );
            root.draw(&Rectangle::new(
                [(px, py), (qx, qy)],
                RGBColor(shade, shade, shade).filled(),
            ))?;
        }
    }
    root.present()?;
    Ok(())
}
