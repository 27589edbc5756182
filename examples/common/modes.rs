//! The transformer examples' three training modes (f32, fp16 with a GradScaler, bf16 without)
//! from the same initial weights: the step loop, the table, the JSON and the loss curves.

use std::path::Path;
use std::time::Instant;

use candle_amp::{GradScaler, Tensor, F32};
use candle_core::Result;
use candle_nn::Optimizer;
use serde::Serialize;

/// One training mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    F32,
    Fp16,
    Bf16,
}

impl Mode {
    pub const ALL: [Self; 3] = [Self::F32, Self::Fp16, Self::Bf16];

    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Fp16 => "fp16",
            Self::Bf16 => "bf16",
        }
    }
}

/// One mode's figures, the fields of its `--json` object.
#[derive(Serialize, Debug)]
pub struct ModeResult {
    pub ms_per_step: f64,
    pub final_loss: f32,
    pub peak_bytes: usize,
    pub skipped_steps: u64,
    /// Where the host's time of a timed step went.
    pub host_ms: HostMs,
    #[serde(skip)]
    pub losses: Vec<f32>,
}

/// Host time of a step's phases, ms per timed step: `forward` (the loss's graph), `backward`,
/// `step` (the scaler's `step` and `update`: unscaling, its one found-inf read, the optimizer)
/// and `loss_read` (reading the loss back). On a GPU kernels run asynchronously, so the first
/// three are what the host spends launching them, and the reads wait for the device: a step
/// whose time is mostly launching is bound by the host, not by the GPU.
#[derive(Serialize, Debug, Default, Clone, Copy)]
pub struct HostMs {
    pub forward: f64,
    pub backward: f64,
    pub step: f64,
    pub loss_read: f64,
}

impl HostMs {
    /// Runs `f`, adding its host time in ms to `slot`.
    pub fn time<R>(slot: &mut f64, f: impl FnOnce() -> R) -> R {
        let start = Instant::now();
        let r = f();
        *slot += start.elapsed().as_secs_f64() * 1e3;
        r
    }

    /// Adds another step's times.
    pub fn add(&mut self, other: Self) {
        self.forward += other.forward;
        self.backward += other.backward;
        self.step += other.step;
        self.loss_read += other.loss_read;
    }

    /// The totals of `steps` steps, per step.
    pub fn per_step(self, steps: usize) -> Self {
        let per = |ms: f64| ms / steps.max(1) as f64;
        Self {
            forward: per(self.forward),
            backward: per(self.backward),
            step: per(self.step),
            loss_read: per(self.loss_read),
        }
    }
}

/// The GradScaler of `mode`'s loop: enabled for fp16 only (bf16 has f32's range and, as in
/// PyTorch, no loss scaling).
pub fn scaler(mode: Mode) -> Result<GradScaler> {
    GradScaler::builder().enabled(mode == Mode::Fp16).build()
}

/// One training step with the GradScaler loop, `loss(opt)` its forward: the loss's value and
/// where the step's host time went.
pub fn train_step<O: Optimizer>(
    opt: &mut O,
    scaler: &mut GradScaler,
    loss: impl FnOnce(&mut O) -> Result<Tensor<F32>>,
) -> Result<(f32, HostMs)> {
    let mut host = HostMs::default();
    let l = HostMs::time(&mut host.forward, || loss(opt))?;
    let grads = HostMs::time(&mut host.backward, || scaler.scale(&l)?.backward())?;
    HostMs::time(&mut host.step, || -> Result<()> {
        let _ = scaler.step(opt, grads)?;
        scaler.update()
    })?;
    let value = HostMs::time(&mut host.loss_read, || l.to_scalar::<f32>())?;
    Ok((value, host))
}

/// Steps `steps` (`0..n` for a fresh run, `k..k + n` after resuming from step `k`) of
/// `loss(opt, step)` in `mode`, with the GradScaler loop; `loss` may set the optimizer's rate
/// first. The first step is the untimed warm-up; the peak counts from `peak`'s start (read
/// before the model was made). The final loss is the mean of the last tenth of all the steps,
/// `0..steps.end`, so that a resumed run reports what the uninterrupted one does. `quiet`
/// hides the progress bar.
pub fn run_steps<O: Optimizer>(
    mode: Mode,
    steps: std::ops::Range<usize>,
    quiet: bool,
    peak: &super::Peak,
    opt: &mut O,
    scaler: &mut GradScaler,
    mut loss: impl FnMut(&mut O, usize) -> Result<Tensor<F32>>,
) -> Result<ModeResult> {
    let bar = super::progress(steps.len() as u64, mode.name(), quiet);
    // Not `with_capacity(steps)`: `--steps` may be larger than memory, each loss is pushed.
    let (mut losses, mut start) = (Vec::new(), Instant::now());
    let total = steps.end;
    let mut host = HostMs::default();
    for step in steps {
        if losses.len() == 1 {
            start = Instant::now(); // the first step is the untimed warm-up
            host = HostMs::default();
        }
        let (value, phases) = train_step(opt, scaler, |opt| loss(opt, step))?;
        host.add(phases);
        losses.push(value);
        bar.set_message(format!("loss {value:.4}"));
        bar.inc(1);
    }
    bar.finish();
    let timed = losses.len().saturating_sub(1).max(1);
    let tail = (total / 10).clamp(1, losses.len().max(1));
    Ok(ModeResult {
        ms_per_step: start.elapsed().as_secs_f64() * 1e3 / timed as f64,
        host_ms: host.per_step(timed),
        final_loss: super::mean_tail_n(&losses, tail),
        peak_bytes: peak.bytes()?,
        skipped_steps: scaler.skipped_steps(),
        losses,
    })
}

/// [`super::check_finite`] on every mode's final loss.
pub fn check_finite(results: &[(Mode, ModeResult)]) -> Result<()> {
    super::check_finite(results.iter().map(|(m, r)| (m.name(), r.final_loss)))
}

/// The comparison table, one row per mode.
pub fn print_table(results: &[(Mode, ModeResult)]) {
    println!("| mode | ms per step | final loss | peak MiB | skipped steps |");
    println!("|------|-------------|------------|---------------|---------------|");
    for (mode, r) in results {
        println!(
            "| {:<4} | {:>11.2} | {:>10.4} | {:>13.1} | {:>13} |",
            mode.name(),
            r.ms_per_step,
            r.final_loss,
            r.peak_bytes as f64 / (1024.0 * 1024.0),
            r.skipped_steps
        );
    }
}

/// `{"f32": {..}, "fp16": {..}, "bf16": {..}}` plus the `extra` fields, on one line.
pub fn json(results: &[(Mode, ModeResult)], extra: &[(&str, serde_json::Value)]) -> Result<String> {
    let mut json = serde_json::Map::new();
    for (mode, r) in results {
        json.insert(
            mode.name().into(),
            serde_json::to_value(r).map_err(candle_core::Error::wrap)?,
        );
    }
    for (key, value) in extra {
        json.insert((*key).into(), value.clone());
    }
    Ok(serde_json::Value::Object(json).to_string())
}

/// The loss curves of every mode in `out/file`; prints where they went.
pub fn draw(out: &Path, file: &str, title: &str, results: &[(Mode, ModeResult)]) -> Result<()> {
    std::fs::create_dir_all(out).map_err(candle_core::Error::wrap)?;
    let png = out.join(file);
    let curves: Vec<(&str, &[f32])> = results
        .iter()
        .map(|(m, r)| (m.name(), r.losses.as_slice()))
        .collect();
    super::curves::draw_losses(&png, title, &curves)
        .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
    println!("wrote {}", png.display());
    Ok(())
}
