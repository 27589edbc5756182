//! The performance figures of candle-amp, measured side by side in one run:
//! `cargo run --release --example bench` prints a table with the targets,
//! `cargo run --release --example bench -- --json` prints exactly one JSON line on stdout.
//!
//! The figures (each ratio is taken between two sides timed in the same loop):
//!
//! - `macro_vs_handwritten` (target <= 1.02): the forward of a 3-layer MLP (width 512, batch 64,
//!   the model of `benches/autocast_overhead.rs`) annotated `#[autocast(fp16)]`, over the same
//!   forward hand-written as careful mixed precision with the typed tensors and the same layers
//!   (cast the input to f16 once, f16 layers, cast back). Both do the same 8 casts on the same
//!   kernels, so this is the cost of the macro itself and means the same thing on any device.
//! - `fused_unscale_gbps`, `memcpy_gbps`, `fused_unscale_vs_memcpy` (target >= 0.7): the fused
//!   gradient unscale `kernels::unscale::unscale_in_place` over the gradient set of
//!   `benches/unscale.rs` (35 tensors, 31.7M f32 values: 127 MB), against `copy_from_slice` of
//!   the same number of bytes into a preallocated, already-written buffer. GB/s are gradient
//!   bytes (1e9) per second for both, so the ratio is memcpy time over fused time. The fused pass
//!   reads and writes every byte in place; memcpy reads one buffer and writes another.
//! - `naive_unscale_vs_fused` (target >= 3): `kernels::unscale::naive_unscale` (per-tensor candle
//!   ops, one host sync per gradient) over the fused pass, on copies of the same gradients.
//! - `amp_vs_f32_step` (target < 1): one training step of the PyTorch AMP recipe MLP
//!   (Linear+ReLU, Linear+ReLU, Linear, MSE, SGD lr 1e-3; `--width` 1024, `--batch` 256 by
//!   default on CPU, the recipe's own 4096 and 512 on CUDA, where the smaller step is bound by
//!   kernel launches whatever the precision) under autocast in the device's default precision (bf16 without loss scaling on
//!   CPU, fp16 with a `GradScaler` on CUDA, as PyTorch's defaults), over the same step in plain
//!   f32 (the same function with `enabled = false`, `backward` and `opt.step`).
//! - `bf16_matmul_vs_candle_f32` (target >= 1.8): GFLOP/s of a 1024^3 matmul of two
//!   `Tensor<BF16>` (candle-amp's GEMM: AMX tiles where the CPU has them, else `vdpbf16ps` where
//!   it has AVX512-BF16) over candle's f32 matmul of the same shape.
//! - `conv1x1_train_step_vs_candle` (target <= 0.5): forward and backward of candle-amp's f32
//!   `Conv2d` (1x1, 256 -> 256 channels on 128 x 128, batch 1: `quantized_sine`'s hidden layer
//!   at `--size 128 --hidden 256`) over `candle_nn::Conv2d` with the same weights.
//!
//! - `adamw_step_vs_candle_nn` (target <= 0.5): one `candle_amp::optim::AdamW` step (in place,
//!   one pass per parameter) over one `candle_nn::AdamW` step (a dozen tensor ops per
//!   parameter), each on its own copy of three `--width` x `--width` f32 weights with the same
//!   gradients.
//! - `linear3d_vs_candle_nn` (target <= 1.05): forward and backward of candle-amp's `Linear` on
//!   a rank-3 f32 input `(8, 128, 768)` to 768 features (a transformer's projection), over
//!   `candle_nn::Linear` with the same weights: both flatten to one 2-D GEMM.
//!
//! - `attention_vs_composed` (target <= 0.5) and `gpt_block_bf16_vs_f32` (target <= 0.35): see
//!   `bench/transformer.rs`.
//! - `untracked_vs_tracked_step` (CUDA only): see `bench/launches.rs`.
//!
//! `--device cpu` (default) or `cuda` (a `--features cuda` build). On a GPU the memcpy
//! reference is a device-to-device copy, and every timed run ends with a device sync.
//!
//! Timing: every side is warmed up (`--warmup` rounds), then the sides take turns (A, B, A, B,
//! the starting side rotating each round) so that drift and other tenants' noise hit all of them
//! alike; `--forward-samples` (300), `--samples` (30, unscale) and `--step-samples` (10) rounds
//! are timed. Each `*_ms` is the median of one side's runs; each ratio is the median over rounds
//! of the two sides' quotient within a round (runs that were neighbours in time), which a burst
//! of load cancels out of, so it can differ slightly from the quotient of the two medians. The
//! default run takes well under a minute on 2 cores. Debug builds refuse to run: their timings
//! mean nothing.

#[path = "common/device.rs"]
mod device;
#[path = "../benches/fixtures/mod.rs"]
mod fixtures;
#[path = "transformers/gpt_model.rs"]
mod gpt_model;
#[cfg(feature = "cuda")]
#[path = "bench/launches.rs"]
mod launches;
#[path = "bench/transformer.rs"]
mod transformer;

use std::hint::black_box;
use std::time::Instant;

use candle_amp::kernels::unscale::{naive_unscale, unscale_in_place};
use candle_amp::nn::loss;
use candle_amp::optim::{Optimizer, SGD};
use candle_amp::{Bf16Policy, Fp16Policy, GradScaler, Policy, Tensor, BF16, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use fixtures::Mlp;
use serde::Serialize;

/// Side-by-side timings of the macro, the fused unscale and an AMP training step.
#[derive(Parser, Debug)]
#[command(about)]
struct Args {
    /// Print one JSON line on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Width of the training-step MLP (`amp_vs_f32_step`) and of the AdamW weights [default:
    /// 1024 on CPU, 4096 on CUDA].
    #[arg(long, value_parser = positive)]
    width: Option<usize>,
    /// Batch size of the training-step MLP (`amp_vs_f32_step`) [default: 256 on CPU, 512 on
    /// CUDA].
    #[arg(long, value_parser = positive)]
    batch: Option<usize>,
    /// Timed runs per side for the unscale figures (medians are reported).
    #[arg(long, default_value_t = 30, value_parser = positive)]
    samples: usize,
    /// Timed runs per side for the forward figure (a few ms each, so more of them).
    #[arg(long, default_value_t = 300, value_parser = positive)]
    forward_samples: usize,
    /// Timed runs per side for the training steps (medians are reported).
    #[arg(long, default_value_t = 10, value_parser = positive)]
    step_samples: usize,
    /// Untimed rounds per side before timing.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Device: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = device::parse_device)]
    device: Device,
}

/// The MLP's width: `--width`, else by device. On a GPU the CPU's sizes are launch-bound (a step
/// of ~100 kernels of microseconds each, whatever the precision): there the MLP is PyTorch's
/// AMP recipe's, 4096 wide, batch 512.
fn width(args: &Args) -> usize {
    let default = if args.device.is_cuda() { 4096 } else { 1024 };
    args.width.unwrap_or(default)
}

/// The MLP's batch: `--batch`, else by device (see [`width`]).
fn batch(args: &Args) -> usize {
    let default = if args.device.is_cuda() { 512 } else { 256 };
    args.batch.unwrap_or(default)
}

fn positive(s: &str) -> std::result::Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

// ---- Timing. ----

/// One side of a comparison: a closure run once per sample.
type Job<'a> = &'a mut dyn FnMut() -> Result<()>;

/// Every timed run of each side, in milliseconds, one entry per round.
struct Samples(Vec<Vec<f64>>);

impl Samples {
    /// The median time of side `i`.
    fn median(&self, i: usize) -> f64 {
        median(self.0[i].clone())
    }

    /// The median over rounds of `time(a) / time(b)`: the two runs of one round are neighbours
    /// in time, so a burst of load from other tenants scales both and cancels in the quotient.
    fn ratio(&self, a: usize, b: usize) -> f64 {
        median(
            self.0[a]
                .iter()
                .zip(&self.0[b])
                .map(|(x, y)| x / y)
                .collect(),
        )
    }
}

/// Runs every job `warmup` times untimed, then `samples` timed times each, taking turns (the
/// starting job rotates every round so no side always runs right after the same neighbour).
/// Each timed run ends with a device synchronisation, so queued GPU work is inside its time.
fn interleaved(
    dev: &Device,
    warmup: usize,
    samples: usize,
    jobs: &mut [Job<'_>],
) -> Result<Samples> {
    for _ in 0..warmup {
        for job in jobs.iter_mut() {
            job()?;
        }
    }
    let n = jobs.len();
    let mut times = vec![Vec::with_capacity(samples); n];
    for round in 0..samples {
        for k in 0..n {
            let i = (round + k) % n;
            dev.synchronize()?;
            let start = Instant::now();
            jobs[i]()?;
            dev.synchronize()?;
            times[i].push(start.elapsed().as_secs_f64() * 1e3);
        }
    }
    Ok(Samples(times))
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len().is_multiple_of(2) {
        f64::midpoint(v[m - 1], v[m])
    } else {
        v[m]
    }
}

// ---- The three measurements. ----

/// Side 0: `#[autocast(fp16)]`, side 1: hand-written.
struct Forward(Samples);

fn measure_forward(args: &Args, dev: &Device) -> Result<Forward> {
    let vars = VarMap::new();
    let mlp = Mlp::new(512, &VarBuilder::from_varmap(&vars, DType::F32, dev))?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (64, 512), dev)?;
    let mut by_macro = || -> Result<()> {
        black_box(mlp.forward(black_box(&x))?);
        Ok(())
    };
    let mut by_hand = || -> Result<()> {
        black_box(mlp.forward_by_hand(black_box(&x))?);
        Ok(())
    };
    let t = interleaved(
        dev,
        args.warmup,
        args.forward_samples,
        &mut [&mut by_macro, &mut by_hand],
    )?;
    Ok(Forward(t))
}

struct Unscale {
    tensors: usize,
    bytes: usize,
    /// Sides `FUSED`, `NAIVE`, `MEMCPY`.
    t: Samples,
}

const FUSED: usize = 0;
const NAIVE: usize = 1;
const MEMCPY: usize = 2;

fn measure_unscale(args: &Args, dev: &Device) -> Result<Unscale> {
    let mut fused = fixtures::unscale_gradients(dev)?;
    // A deep copy: the naive side must not share storage with the fused side.
    let mut naive = fused
        .iter()
        .map(candle_core::Tensor::copy)
        .collect::<Result<Vec<_>>>()?;
    let n: usize = fused.iter().map(candle_core::Tensor::elem_count).sum();
    // Both buffers written now (not lazily zeroed pages), so no page faults are timed.
    let src = vec![1.0f32; n];
    let mut dst = vec![0.5f32; n];
    // inv_scale 1: the same work as any other factor, and the values stay put across runs.
    let mut run_fused = || -> Result<()> {
        black_box(unscale_in_place(&mut fused, black_box(1.0))?);
        Ok(())
    };
    let mut run_naive = || -> Result<()> {
        black_box(naive_unscale(&mut naive, black_box(1.0))?);
        Ok(())
    };
    // On a GPU the physical reference is a device-to-device copy of the same bytes.
    let on_device = if dev.is_cpu() {
        None
    } else {
        Some(candle_core::Tensor::ones(n, DType::F32, dev)?)
    };
    let mut run_memcpy = || -> Result<()> {
        match &on_device {
            None => {
                dst.copy_from_slice(black_box(&src));
                black_box(&mut dst);
            }
            Some(t) => drop(black_box(t.copy()?)),
        }
        Ok(())
    };
    let t = interleaved(
        dev,
        args.warmup,
        args.samples,
        &mut [&mut run_fused, &mut run_naive, &mut run_memcpy],
    )?;
    Ok(Unscale {
        tensors: fused.len(),
        bytes: n * 4,
        t,
    })
}

struct Step {
    /// Side 0: AMP, side 1: f32.
    t: Samples,
    amp_skipped: u64,
    precision: &'static str,
}

/// The AMP step in PyTorch's default precision for the device: bf16 without loss scaling on
/// CPU, fp16 with a `GradScaler` on CUDA.
fn measure_step(args: &Args, dev: &Device) -> Result<Step> {
    if dev.is_cpu() {
        measure_step_in::<Bf16Policy>(args, dev)
    } else {
        measure_step_in::<Fp16Policy>(args, dev)
    }
}

fn measure_step_in<Pol: Policy>(args: &Args, dev: &Device) -> Result<Step> {
    let vars = VarMap::new();
    let mlp = Mlp::new(
        width(args),
        &VarBuilder::from_varmap(&vars, DType::F32, dev),
    )?;
    let x = Tensor::<F32>::randn(0.0, 1.0, (batch(args), width(args)), dev)?;
    let y = Tensor::<F32>::randn(0.0, 1.0, (batch(args), width(args)), dev)?;
    // Two optimizers over the same master weights: SGD keeps no state, and each side needs its
    // own `&mut`.
    let mut amp_opt = SGD::new(vars.all_vars(), 1e-3)?;
    let mut f32_opt = SGD::new(vars.all_vars(), 1e-3)?;
    let mut scaler = GradScaler::builder()
        .enabled(Pol::lower() == DType::F16)
        .build()?;
    let mut amp_step = || -> Result<()> {
        let l = loss::mse(&mlp.forward_switch::<Pol>(&x, true)?, &y)?;
        let grads = scaler.scale(&l)?.backward()?;
        let _ = scaler.step(&mut amp_opt, grads)?;
        scaler.update()?;
        Ok(())
    };
    let mut f32_step = || -> Result<()> {
        let l = loss::mse(&mlp.forward_switch::<Pol>(&x, false)?, &y)?;
        let grads = l.as_candle().backward()?;
        f32_opt.step(&grads)
    };
    let t = interleaved(
        dev,
        args.warmup,
        args.step_samples,
        &mut [&mut amp_step, &mut f32_step],
    )?;
    Ok(Step {
        t,
        amp_skipped: scaler.skipped_steps(),
        precision: Pol::NAME,
    })
}

/// Side 0: `candle_amp::optim::AdamW`, side 1: `candle_nn::AdamW`, one step each.
struct AdamWStep(Samples);

fn measure_adamw(args: &Args, dev: &Device) -> Result<AdamWStep> {
    let params = candle_amp::optim::ParamsAdamW::default();
    // Each side its own weights (the steps write them), with gradients of the same values.
    let side = || -> Result<(Vec<candle_core::Var>, candle_core::backprop::GradStore)> {
        let vars = (0..3)
            .map(|i| {
                let t = (candle_core::Tensor::ones((width(args), width(args)), DType::F32, dev)?
                    * (0.01 * f64::from(i + 1)))?;
                candle_core::Var::from_tensor(&t)
            })
            .collect::<Result<Vec<_>>>()?;
        let mut loss = vars[0].as_tensor().sqr()?.sum_all()?;
        for v in &vars[1..] {
            loss = (loss + v.as_tensor().sqr()?.sum_all()?)?;
        }
        let grads = loss.backward()?;
        Ok((vars, grads))
    };
    let ((ours_vars, ours_grads), (theirs_vars, theirs_grads)) = (side()?, side()?);
    let mut ours = candle_amp::optim::AdamW::new(ours_vars, params.clone())?;
    let mut theirs = candle_nn::AdamW::new(theirs_vars, params)?;
    let mut by_amp = || ours.step(&ours_grads);
    let mut by_candle_nn = || theirs.step(&theirs_grads);
    let t = interleaved(
        dev,
        args.warmup,
        args.step_samples,
        &mut [&mut by_amp, &mut by_candle_nn],
    )?;
    Ok(AdamWStep(t))
}

/// Side 0: candle-amp's bf16 matmul, side 1: candle's f32 matmul, at 1024^3 on CPU.
struct Gemm(Samples);

const GEMM_SIZE: usize = 1024;

fn measure_gemm(args: &Args, dev: &Device) -> Result<Gemm> {
    let a = Tensor::<F32>::randn(0.0, 1.0, (GEMM_SIZE, GEMM_SIZE), dev)?;
    let b = Tensor::<F32>::randn(0.0, 1.0, (GEMM_SIZE, GEMM_SIZE), dev)?;
    let (a16, b16) = (a.cast::<BF16>()?, b.cast::<BF16>()?);
    let mut ours = || -> Result<()> {
        black_box(black_box(&a16).matmul(&b16)?);
        Ok(())
    };
    let mut candle = || -> Result<()> {
        black_box(black_box(a.as_candle()).matmul(b.as_candle())?);
        Ok(())
    };
    let t = interleaved(
        dev,
        args.warmup,
        (args.forward_samples / 10).max(1),
        &mut [&mut ours, &mut candle],
    )?;
    Ok(Gemm(t))
}

/// Side 0: candle-amp's `Conv2d`, side 1: `candle_nn::Conv2d` with the same weights, f32
/// forward and backward of a 1x1 conv (256 -> 256 channels, batch 1, 128 x 128), the hidden
/// layer of `quantized_sine --size 128 --hidden 256`.
struct Conv1x1(Samples);

fn measure_conv1x1(args: &Args, dev: &Device) -> Result<Conv1x1> {
    use candle_nn::Module;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, dev);
    let cfg = candle_amp::nn::Conv2dConfig::default();
    let amp = candle_amp::nn::conv2d(256, 256, 1, cfg, vb.pp("conv"))?;
    let plain = candle_nn::Conv2d::new(
        amp.weight().as_tensor().clone(),
        amp.bias().map(|b| b.as_tensor().clone()),
        cfg,
    );
    let x = candle_core::Var::from_tensor(&candle_core::Tensor::randn(
        0f32,
        1.0,
        (1, 256, 128, 128),
        dev,
    )?)?;
    let xt = Tensor::<F32>::from_candle(x.as_tensor().clone())?;
    let mut by_amp = || -> Result<()> {
        let y = amp.forward(black_box(&xt))?;
        black_box(y.as_candle().sum_all()?.backward()?);
        Ok(())
    };
    let mut by_candle_nn = || -> Result<()> {
        let y = plain.forward(black_box(x.as_tensor()))?;
        black_box(y.sum_all()?.backward()?);
        Ok(())
    };
    let t = interleaved(
        dev,
        args.warmup,
        args.step_samples,
        &mut [&mut by_amp, &mut by_candle_nn],
    )?;
    Ok(Conv1x1(t))
}

/// Side 0: candle-amp's `Linear`, side 1: `candle_nn::Linear`, fwd+bwd on `(8, 128, 768)`.
struct Linear3d(Samples);

fn measure_linear3d(args: &Args, dev: &Device) -> Result<Linear3d> {
    use candle_nn::Module;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, dev);
    let amp = candle_amp::nn::linear(768, 768, vb.pp("fc"))?;
    let plain = candle_nn::Linear::new(
        amp.weight().as_tensor().clone(),
        amp.bias().map(|b| b.as_tensor().clone()),
    );
    let x = Tensor::<F32>::randn(0.0, 1.0, (8, 128, 768), dev)?;
    let mut by_amp = || -> Result<()> {
        let y = amp.forward(black_box(&x))?;
        black_box(y.as_candle().sum_all()?.backward()?);
        Ok(())
    };
    let mut by_candle_nn = || -> Result<()> {
        let y = plain.forward(black_box(x.as_candle()))?;
        black_box(y.sum_all()?.backward()?);
        Ok(())
    };
    let t = interleaved(
        dev,
        args.warmup,
        args.step_samples,
        &mut [&mut by_amp, &mut by_candle_nn],
    )?;
    Ok(Linear3d(t))
}

// ---- Report. ----

#[derive(Serialize, Debug)]
struct Report {
    macro_vs_handwritten: f64,
    fused_unscale_gbps: f64,
    memcpy_gbps: f64,
    fused_unscale_vs_memcpy: f64,
    naive_unscale_vs_fused: f64,
    amp_vs_f32_step: f64,
    linear3d_vs_candle_nn: f64,
    bf16_matmul_vs_candle_f32: f64,
    conv1x1_train_step_vs_candle: f64,
    adamw_step_vs_candle_nn: f64,
    attention_vs_composed: f64,
    gpt_block_bf16_vs_f32: f64,
    untracked_vs_tracked_step: Option<f64>,
    untracked_step_ms: Option<f64>,
    tracked_step_ms: Option<f64>,
    attention_ms: f64,
    attention_composed_ms: f64,
    gpt_block_bf16_ms: f64,
    gpt_block_f32_ms: f64,
    adamw_ms: f64,
    adamw_candle_nn_ms: f64,
    bf16_matmul_gflops: f64,
    candle_f32_matmul_gflops: f64,
    conv1x1_ms: f64,
    conv1x1_candle_ms: f64,
    step_precision: &'static str,
    macro_ms: f64,
    handwritten_ms: f64,
    fused_ms: f64,
    naive_ms: f64,
    memcpy_ms: f64,
    amp_step_ms: f64,
    f32_step_ms: f64,
    linear3d_ms: f64,
    linear3d_candle_nn_ms: f64,
    amp_skipped_steps: u64,
    unscale_tensors: usize,
    unscale_bytes: usize,
    width: usize,
    batch: usize,
    samples: usize,
    forward_samples: usize,
    step_samples: usize,
    device: String,
    machine: String,
}

/// `x` rounded to `digits` decimals, so the JSON line stays readable.
fn round(x: f64, digits: i32) -> f64 {
    let p = 10f64.powi(digits);
    (x * p).round() / p
}

/// `cpu`, or the device's location (`cuda { gpu_id: 0 }`).
fn device_name(dev: &Device) -> String {
    format!("{:?}", dev.location()).to_lowercase()
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|info| {
            info.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, name)| name.trim().to_string())
        })
        .unwrap_or_else(|| "unknown".into());
    let threads = std::thread::available_parallelism()
        .map_or_else(|_| "unknown".into(), |n| n.get().to_string());
    format!("{cpu}, {threads} threads")
}

/// Everything measured, one field per comparison.
struct Measured {
    forward: Forward,
    unscale: Unscale,
    step: Step,
    linear3d: Linear3d,
    gemm: Gemm,
    conv1x1: Conv1x1,
    adamw: AdamWStep,
    attention: Samples,
    gpt_block: Samples,
    event_tracking: Option<Samples>,
}

fn report(args: &Args, m: &Measured) -> Report {
    let (f, u, s, l) = (&m.forward, &m.unscale, &m.step, &m.linear3d);
    let gbps = |ms: f64| u.bytes as f64 / (ms * 1e-3) / 1e9;
    let gflops = |ms: f64| 2.0 * (GEMM_SIZE as f64).powi(3) / (ms * 1e-3) / 1e9;
    Report {
        macro_vs_handwritten: round(f.0.ratio(0, 1), 4),
        fused_unscale_gbps: round(gbps(u.t.median(FUSED)), 2),
        memcpy_gbps: round(gbps(u.t.median(MEMCPY)), 2),
        // Same bytes on both sides: fused GB/s over memcpy GB/s is memcpy time over fused time.
        fused_unscale_vs_memcpy: round(u.t.ratio(MEMCPY, FUSED), 3),
        naive_unscale_vs_fused: round(u.t.ratio(NAIVE, FUSED), 3),
        amp_vs_f32_step: round(s.t.ratio(0, 1), 3),
        linear3d_vs_candle_nn: round(l.0.ratio(0, 1), 3),
        // Same FLOPs on both sides: our GFLOP/s over candle's is candle's time over ours.
        bf16_matmul_vs_candle_f32: round(m.gemm.0.ratio(1, 0), 3),
        conv1x1_train_step_vs_candle: round(m.conv1x1.0.ratio(0, 1), 3),
        adamw_step_vs_candle_nn: round(m.adamw.0.ratio(0, 1), 3),
        attention_vs_composed: round(m.attention.ratio(0, 1), 3),
        gpt_block_bf16_vs_f32: round(m.gpt_block.ratio(0, 1), 3),
        untracked_vs_tracked_step: m.event_tracking.as_ref().map(|t| round(t.ratio(0, 1), 3)),
        untracked_step_ms: m.event_tracking.as_ref().map(|t| round(t.median(0), 2)),
        tracked_step_ms: m.event_tracking.as_ref().map(|t| round(t.median(1), 2)),
        attention_ms: round(m.attention.median(0), 2),
        attention_composed_ms: round(m.attention.median(1), 2),
        gpt_block_bf16_ms: round(m.gpt_block.median(0), 2),
        gpt_block_f32_ms: round(m.gpt_block.median(1), 2),
        adamw_ms: round(m.adamw.0.median(0), 2),
        adamw_candle_nn_ms: round(m.adamw.0.median(1), 2),
        bf16_matmul_gflops: round(gflops(m.gemm.0.median(0)), 1),
        candle_f32_matmul_gflops: round(gflops(m.gemm.0.median(1)), 1),
        conv1x1_ms: round(m.conv1x1.0.median(0), 2),
        conv1x1_candle_ms: round(m.conv1x1.0.median(1), 2),
        step_precision: s.precision,
        macro_ms: round(f.0.median(0), 4),
        handwritten_ms: round(f.0.median(1), 4),
        fused_ms: round(u.t.median(FUSED), 3),
        naive_ms: round(u.t.median(NAIVE), 3),
        memcpy_ms: round(u.t.median(MEMCPY), 3),
        amp_step_ms: round(s.t.median(0), 2),
        f32_step_ms: round(s.t.median(1), 2),
        linear3d_ms: round(l.0.median(0), 2),
        linear3d_candle_nn_ms: round(l.0.median(1), 2),
        amp_skipped_steps: s.amp_skipped,
        unscale_tensors: u.tensors,
        unscale_bytes: u.bytes,
        width: width(args),
        batch: batch(args),
        samples: args.samples,
        forward_samples: args.forward_samples,
        step_samples: args.step_samples,
        device: device_name(&args.device),
        machine: machine(),
    }
}

fn verdict(met: bool) -> &'static str {
    if met {
        "met"
    } else {
        "MISSED"
    }
}

fn print_table(r: &Report) {
    println!(
        "candle-amp bench on {} ({} device; medians of {} runs per side for the forward, {} for \
         the unscale, {} for the steps)\n",
        r.machine, r.device, r.forward_samples, r.samples, r.step_samples
    );
    println!(
        "{:<26} {:>8}  {:<10} {:<7} raw",
        "figure", "value", "target", ""
    );
    println!(
        "{:<26} {:>8.4}  {:<10} {:<7} autocast {:.3} ms, hand-written {:.3} ms",
        "macro_vs_handwritten",
        r.macro_vs_handwritten,
        "<= 1.02",
        verdict(r.macro_vs_handwritten <= 1.02),
        r.macro_ms,
        r.handwritten_ms
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} fused {:.2} GB/s ({:.3} ms), \
         memcpy {:.2} GB/s ({:.3} ms), {:.0} MB",
        "fused_unscale_vs_memcpy",
        r.fused_unscale_vs_memcpy,
        ">= 0.7",
        verdict(r.fused_unscale_vs_memcpy >= 0.7),
        r.fused_unscale_gbps,
        r.fused_ms,
        r.memcpy_gbps,
        r.memcpy_ms,
        r.unscale_bytes as f64 / 1e6
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} naive {:.3} ms, fused {:.3} ms, {} tensors",
        "naive_unscale_vs_fused",
        r.naive_unscale_vs_fused,
        ">= 3",
        verdict(r.naive_unscale_vs_fused >= 3.0),
        r.naive_ms,
        r.fused_ms,
        r.unscale_tensors
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} amp ({}) {:.2} ms, f32 {:.2} ms (width {}, batch {}, {} \
         skipped)",
        "amp_vs_f32_step",
        r.amp_vs_f32_step,
        "< 1",
        verdict(r.amp_vs_f32_step < 1.0),
        r.step_precision,
        r.amp_step_ms,
        r.f32_step_ms,
        r.width,
        r.batch,
        r.amp_skipped_steps
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} candle-amp {:.2} ms, candle-nn {:.2} ms (fwd+bwd, \
         (8, 128, 768) -> 768, f32)",
        "linear3d_vs_candle_nn",
        r.linear3d_vs_candle_nn,
        "<= 1.05",
        verdict(r.linear3d_vs_candle_nn <= 1.05),
        r.linear3d_ms,
        r.linear3d_candle_nn_ms
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} bf16 {:.1} GFLOP/s, candle f32 {:.1} GFLOP/s ({n}^3)",
        "bf16_matmul_vs_candle_f32",
        r.bf16_matmul_vs_candle_f32,
        ">= 1.8",
        verdict(r.bf16_matmul_vs_candle_f32 >= 1.8),
        r.bf16_matmul_gflops,
        r.candle_f32_matmul_gflops,
        n = GEMM_SIZE
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} candle-amp {:.2} ms, candle-nn {:.2} ms (f32 fwd+bwd, \
         1x1 conv 256 -> 256 on 128 x 128)",
        "conv1x1_train_step_vs_candle",
        r.conv1x1_train_step_vs_candle,
        "<= 0.5",
        verdict(r.conv1x1_train_step_vs_candle <= 0.5),
        r.conv1x1_ms,
        r.conv1x1_candle_ms
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} candle-amp {:.2} ms, candle-nn {:.2} ms (3 x {w} x {w} f32)",
        "adamw_step_vs_candle_nn",
        r.adamw_step_vs_candle_nn,
        "<= 0.5",
        verdict(r.adamw_step_vs_candle_nn <= 0.5),
        r.adamw_ms,
        r.adamw_candle_nn_ms,
        w = r.width
    );
    print_transformer_rows(r);
}

/// The table's rows of `bench/transformer.rs`' figures.
fn print_transformer_rows(r: &Report) {
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} op {:.2} ms, composed {:.2} ms (bf16 fwd+bwd, causal, \
         (16, 4, 64, 64))",
        "attention_vs_composed",
        r.attention_vs_composed,
        "<= 0.5",
        verdict(r.attention_vs_composed <= 0.5),
        r.attention_ms,
        r.attention_composed_ms
    );
    println!(
        "{:<26} {:>8.3}  {:<10} {:<7} bf16 {:.2} ms, f32 {:.2} ms (fwd+bwd, width 256, (16, 64))",
        "gpt_block_bf16_vs_f32",
        r.gpt_block_bf16_vs_f32,
        "<= 0.35",
        verdict(r.gpt_block_bf16_vs_f32 <= 0.35),
        r.gpt_block_bf16_ms,
        r.gpt_block_f32_ms
    );
    if let (Some(ratio), Some(off), Some(on)) = (
        r.untracked_vs_tracked_step,
        r.untracked_step_ms,
        r.tracked_step_ms,
    ) {
        println!(
            "{:<26} {:>8.3}  {:<10} {:<7} tracking off {off:.2} ms, on {on:.2} ms (fp16 step, \
             width 1024, batch 256)",
            "untracked_vs_tracked_step", ratio, "-", ""
        );
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    if cfg!(debug_assertions) {
        return Err(candle_core::Error::Msg(
            "bench: debug build; timings only mean something in release: \
             `cargo run --release --example bench`"
                .into(),
        ));
    }
    let dev = args.device.clone();
    let progress = |what: &str| {
        if !args.json {
            eprintln!("measuring {what} ...");
        }
    };
    progress("the forward: #[autocast(fp16)] vs hand-written");
    let forward = measure_forward(&args, &dev)?;
    progress("the gradient unscale: fused vs naive vs memcpy");
    let unscale = measure_unscale(&args, &dev)?;
    progress("the training step: AMP vs f32");
    let step = measure_step(&args, &dev)?;
    progress("Linear on a rank-3 input: candle-amp vs candle-nn");
    let linear3d = measure_linear3d(&args, &dev)?;
    progress("matmul at 1024^3: candle-amp bf16 vs candle f32");
    let gemm = measure_gemm(&args, &dev)?;
    progress("a 1x1 conv layer, f32 fwd+bwd: candle-amp vs candle-nn");
    let conv1x1 = measure_conv1x1(&args, &dev)?;
    progress("an AdamW step: candle-amp vs candle-nn");
    let adamw = measure_adamw(&args, &dev)?;
    progress("attention, bf16 fwd+bwd: the op vs composed ops");
    let attention = transformer::measure_attention(&args, &dev)?;
    progress("a GPT decoder block fwd+bwd: bf16 vs f32");
    let gpt_block = transformer::measure_gpt_block(&args, &dev)?;
    #[cfg(feature = "cuda")]
    let event_tracking = {
        if dev.is_cuda() {
            progress("an fp16 step bound by launches: event tracking off vs on");
        }
        launches::measure_event_tracking(&args, &dev)?
    };
    #[cfg(not(feature = "cuda"))]
    let event_tracking = None;
    let r = report(
        &args,
        &Measured {
            forward,
            unscale,
            step,
            linear3d,
            gemm,
            conv1x1,
            adamw,
            attention,
            gpt_block,
            event_tracking,
        },
    );
    if args.json {
        println!(
            "{}",
            serde_json::to_string(&r).map_err(candle_core::Error::wrap)?
        );
    } else {
        print_table(&r);
    }
    Ok(())
}
