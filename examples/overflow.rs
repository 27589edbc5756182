//! The overflow locator: a small model whose fp16 activations pass 65504 on one line, trained
//! with a `GradScaler` that skips step after step, and the line that did it.
//!
//! ```text
//! cargo run --release --example overflow                        # the finding, in words
//! cargo run --release --example overflow -- --json              # one JSON line
//! cargo run --release --example overflow -- --precision-report  # also the per-op report
//! ```
//!
//! In PyTorch this is the "GradScaler skips every step" thread: the scale backs off and off, and
//! finding the op means forward hooks and prints. Here the finite check
//! (`report::set_check_finite(true)`, or `CANDLE_AMP_CHECK_FINITE=1` in the environment) checks
//! every routed op's output and keeps the first op that turned finite inputs into inf or NaN,
//! with its source line (from `#[autocast]`, which knows every op call's span); the scaler
//! names the parameters whose gradients were non-finite. `--json` prints
//! `{"first_nonfinite": {"file", "line", "column", "function", "op", "dtype", "input_absmax",
//! "output_absmax"}, "nonfinite_grads": [..], "skipped_steps": n}` (`output_absmax` null when
//! no value of the op's output was finite).

use candle_amp::nn::{self, loss};
use candle_amp::optim::{Optimizer, SGD};
use candle_amp::report;
use candle_amp::{autocast, GradScaler, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;

/// Trains a model with a planted fp16 overflow and prints where it is.
#[derive(Parser, Debug)]
struct Args {
    /// Training steps (each one is skipped: the overflow is in the forward pass).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Print one JSON line instead of the text.
    #[arg(long)]
    json: bool,
    /// Also print the precision report of one more training step.
    #[arg(long)]
    precision_report: bool,
}

/// Embeds 16 features into 64, scores every pair of rows (an attention-like product), mixes the
/// scores back and projects to 4 outputs.
struct Scorer {
    embed: nn::Linear,
    out: nn::Linear,
}

#[autocast(fp16)]
impl Scorer {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.embed.forward(x)?.relu()?;
        let scores = h.matmul(&h.t()?)?; // planted overflow
        let mixed = candle_amp::ops::softmax(&scores, 1)?.matmul(&h)?;
        Ok(self.out.forward(&mixed)?)
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let run = train(args.steps, args.precision_report)?;
    if args.json {
        println!("{}", run.json());
        return Ok(());
    }
    println!(
        "{} steps, {} skipped by the GradScaler (scale now {})",
        args.steps, run.skipped_steps, run.final_scale
    );
    match &run.found {
        Some(f) => println!("{f}"),
        None => println!("no op produced inf/NaN from finite inputs"),
    }
    println!(
        "parameters with non-finite gradients: {:?}",
        run.nonfinite_grads
    );
    if let Some(rep) = &run.report {
        println!("\n{rep}");
    }
    Ok(())
}

/// What a run found.
#[derive(Debug)]
pub struct Run {
    pub found: Option<report::NonFinite>,
    pub nonfinite_grads: Vec<String>,
    pub skipped_steps: u64,
    pub final_scale: f32,
    /// With `precision_report`, the report of one more training step.
    pub report: Option<report::PrecisionReport>,
}

impl Run {
    /// The `--json` line.
    pub fn json(&self) -> serde_json::Value {
        let first = self.found.as_ref().map(|f| {
            let site = f.site;
            serde_json::json!({
                "file": site.map(|s| s.file),
                "line": site.map(|s| s.line),
                "column": site.map(|s| s.column),
                "function": site.map(|s| s.function),
                "op": f.op,
                "dtype": format!("{:?}", f.dtype).to_lowercase(),
                "input_absmax": f.input_absmax,
                "output_absmax": f.output_absmax,
            })
        });
        serde_json::json!({
            "first_nonfinite": first,
            "nonfinite_grads": self.nonfinite_grads,
            "skipped_steps": self.skipped_steps,
        })
    }
}

/// Trains `steps` fp16 steps with the finite check on.
pub fn train(steps: usize, precision_report: bool) -> Result<Run> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let model = Scorer {
        embed: nn::linear(16, 64, vb.pp("embed"))?,
        out: nn::linear(64, 4, vb.pp("out"))?,
    };
    let mut opt = SGD::new(vars.all_vars(), 0.01)?;
    let mut scaler = GradScaler::new();
    // Features of magnitude ~100 (unnormalised inputs): the embedding stays well inside f16,
    // but the 64-term dot products of the scores reach ~10^5.
    let x = (Tensor::<F32>::rand(0.0, 1.0, (32, 16), &dev)? * 100.0)?;
    let y = Tensor::<F32>::zeros((32, 4), &dev)?;

    report::set_check_finite(true);
    report::take_first_nonfinite();
    let step = |opt: &mut SGD, scaler: &mut GradScaler| -> Result<bool> {
        let l = loss::mse(&model.forward(&x)?, &y)?;
        let outcome = scaler.step(opt, scaler.scale(l.as_candle())?.backward()?)?;
        scaler.update()?;
        Ok(outcome.is_skipped())
    };
    let mut nonfinite_grads = Vec::new();
    for _ in 0..steps {
        if step(&mut opt, &mut scaler)? && nonfinite_grads.is_empty() {
            nonfinite_grads = scaler.nonfinite_params(&vars);
        }
    }
    let found = report::first_nonfinite();
    let (skipped_steps, final_scale) = (scaler.skipped_steps(), scaler.scale_value());
    let report = if precision_report {
        let (ran, rep) = report::record(|| step(&mut opt, &mut scaler));
        ran?;
        Some(rep)
    } else {
        None
    };
    report::set_check_finite(false);
    Ok(Run {
        found,
        nonfinite_grads,
        skipped_steps,
        final_scale,
        report,
    })
}
