//! PyTorch's "Automatic Mixed Precision" recipe (the `torch.autocast` + `GradScaler` tutorial in
//! PyTorch's recipes, <https://pytorch.org/tutorials/recipes/recipes/amp_recipe.html>), f32 and
//! AMP side by side in one process.
//!
//! The model is the recipe's MLP: Linear(w, w) + ReLU, Linear(w, w) + ReLU, Linear(w, w), trained
//! with MSE against random targets by SGD (lr 1e-3) on random data made once up front from
//! `--seed` (default 0), as are the initial weights: the same batches and weights for both
//! modes, and on every run. The "amp" mode is the recipe's
//! `torch.autocast(device_type, dtype=dtype, enabled=use_amp)` forward plus
//! `GradScaler(enabled=use_amp)` for fp16: one `#[autocast(policy = Pol, enabled = use_amp)]`
//! forward, generic over the policy `Pol`, serves both modes, and the f32 mode runs the same loop
//! with `use_amp = false` and a disabled scaler (an exact pass-through).
//!
//! `--precision bf16|fp16` is the recipe's `dtype`: `main` matches on it once and runs the
//! generic code with `Bf16Policy` or `Fp16Policy`. Without the flag it is PyTorch's autocast
//! default for the device: bf16 on CPU, fp16 on CUDA. Only fp16 scales the loss: bf16 has f32's
//! range, and, as in PyTorch, trains without a `GradScaler` (the scaler is built disabled).
//!
//! ```sh
//! cargo run --release --example amp_recipe                  # smaller defaults, 10-15 s on 2 cores
//! cargo run --release --example amp_recipe -- --precision fp16   # the recipe's float16
//! cargo run --release --example amp_recipe -- --width 4096 --batch 512 --batches 50 --epochs 3
//! cargo run --release --example amp_recipe -- --json        # one JSON line on stdout
//! ```
//!
//! Flags: `--width` (default 1024; the recipe's 4096), `--batch` (256; recipe 512), `--batches`
//! (50, as the recipe), `--epochs` (3, as the recipe), `--precision bf16|fp16` (the AMP run's
//! lower precision; default bf16 on CPU, fp16 on CUDA), `--enabled false` (AMP off in the "amp"
//! run, nothing else changed: it then is the f32 program with a disabled scaler and should match
//! the f32 row), `--json` (print only `{"precision": "bf16", "f32": {...}, "amp": {...}}` and
//! hide the progress bars), `--device cpu`, or `cuda` / `cuda:N` in a build with
//! `--features cuda`, `--seed N`. The table names the AMP row by its precision: `AMP (bf16)`.
//!
//! Measured per mode: milliseconds per training step (forward, loss, scaled backward, unscale,
//! optimizer step, scale update), excluding the mode's first step (it is trained on, just not
//! timed); the peak heap bytes above what was live when the mode started (the data set and the
//! initial weights are shared and not counted); the loss of the last step; the scaler's skipped
//! steps and final scale (0 and 1 when the scaler is disabled, as for bf16). Before either mode,
//! one unmeasured step of each warms up the process (thread pool, gemm's per-thread buffers), so
//! that its one-time allocations count in neither peak: with `--enabled false` the two rows then
//! have the same peak to the byte and the same loss to the bit.
//!
//! What to expect on CPU: the bf16 matmuls run on candle-amp's GEMM, on AMX tiles where the CPU
//! has them (Intel Sapphire Rapids and later) and on `vdpbf16ps` on AVX512-BF16 (Zen 4). On this
//! project's 2-core machines the bf16 step took 0.33-0.55x of the f32 step at the defaults on
//! Zen 4 and 0.10-0.13x on a Xeon with AMX (README, Results), and the two final losses agree to
//! about 4 decimals. fp16, which no x86 CPU multiplies into an f32 sum, is converted to f32 while
//! packing: its step is 0.4-0.9x of f32's, from halved memory traffic and from candle-amp's own
//! GEMM (the f32 run's matmuls are candle's). Peak heap with AMP is 0.6-0.8x of f32's:
//! activations are kept in half precision, and `Linear` keeps no half copy of its f32 weights.
//! The recipe's full size keeps 840 MB of random data up front.

mod common;

use candle_amp::nn::{self, loss};
use candle_amp::optim::{Optimizer, SGD};
use candle_amp::{autocast, Bf16Policy, Fp16Policy, Policy, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::VarBuilder;
use clap::Parser;
use common::AmpPrecision;

/// PyTorch's AMP recipe (3-layer MLP, MSE, SGD) trained in f32 and with AMP (bf16 or fp16) side
/// by side.
///
/// The defaults are smaller than the recipe (`--width 4096 --batch 512 --batches 50 --epochs 3`)
/// so that both modes run in 10-15 s on 2 CPU cores.
#[derive(Parser, Debug)]
struct Args {
    /// Width of the three Linear(w, w) layers (the recipe: 4096).
    #[arg(long, default_value_t = 1024, value_parser = common::positive)]
    width: usize,
    /// Batch size (the recipe: 512).
    #[arg(long, default_value_t = 256, value_parser = common::positive)]
    batch: usize,
    /// Random batches per epoch, made once up front (the recipe: 50).
    #[arg(long, default_value_t = 50, value_parser = common::positive)]
    batches: usize,
    /// Epochs (the recipe: 3).
    #[arg(long, default_value_t = 3, value_parser = common::positive)]
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

/// Linear(w, w) + ReLU, Linear(w, w) + ReLU, Linear(w, w).
struct Mlp {
    l1: nn::Linear,
    l2: nn::Linear,
    l3: nn::Linear,
}

impl Mlp {
    fn new(width: usize, vb: &VarBuilder) -> Result<Self> {
        Ok(Self {
            l1: nn::linear(width, width, vb.pp("l1"))?,
            l2: nn::linear(width, width, vb.pp("l2"))?,
            l3: nn::linear(width, width, vb.pp("l3"))?,
        })
    }

    /// The recipe's forward under `torch.autocast(..., dtype=dtype, enabled=use_amp)`, the dtype
    /// given by the policy `Pol` (`Bf16Policy`: bf16, `Fp16Policy`: f16): half matmuls on half
    /// copies of the f32 masters when `use_amp`, plain f32 otherwise; the output leaves in f32
    /// either way.
    #[autocast(policy = Pol, enabled = use_amp)]
    fn forward<Pol: Policy>(&self, x: &Tensor<F32>, use_amp: bool) -> Result<Tensor<F32>> {
        let h = self.l1.forward(&x)?.relu()?;
        let h = self.l2.forward(&h)?.relu()?;
        self.l3.forward(&h)
    }
}

/// The random batches `(input, target)`, both `(batch, width)` from N(0, 1).
fn data(args: &Args) -> Result<Vec<(Tensor<F32>, Tensor<F32>)>> {
    let shape = (args.batch, args.width);
    let mut rng = common::SeededData::new(args.seed);
    (0..args.batches)
        .map(|_| {
            Ok((
                rng.randn(shape, &args.device)?,
                rng.randn(shape, &args.device)?,
            ))
        })
        .collect()
}

/// One mode of the recipe (see `common::run_mode`): SGD lr 1e-3 on MSE, the batches in order;
/// with `amp`, the forward runs under the policy `Pol`.
fn run_mode<Pol: Policy>(
    label: Option<&str>,
    amp: bool,
    args: &Args,
    init: &common::Init,
    data: &[(Tensor<F32>, Tensor<F32>)],
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
    common::run_mode(
        &mode,
        init,
        &args.device,
        |vb| Mlp::new(args.width, vb),
        |vars| SGD::new(vars, 1e-3),
        |model, step, amp| {
            let (x, target) = &data[step % data.len()];
            loss::mse(&model.forward::<Pol>(x, amp)?, target)
        },
    )
}

/// The f32 run, then the AMP run under the policy `Pol`, from the same weights and batches.
fn train<Pol: Policy>(
    args: &Args,
    init: &common::Init,
    data: &[(Tensor<F32>, Tensor<F32>)],
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
    let init = common::seeded_init(args.seed, &args.device, |vb| {
        Mlp::new(args.width, vb).map(|_| ())
    })?;

    // The policy is a type: pick it once from the flag (PyTorch: `dtype = torch.bfloat16 if
    // args.precision == "bf16" else torch.float16`), the rest is the same generic code.
    let (f32, amp) = match precision {
        AmpPrecision::Bf16 => train::<Bf16Policy>(&args, &init, &data)?,
        AmpPrecision::Fp16 => train::<Fp16Policy>(&args, &init, &data)?,
    };
    let title = format!(
        "amp_recipe: MLP 3x Linear({w}, {w}) + ReLU, batch {b}, {n} batches x {e} epochs, MSE, \
         SGD lr 1e-3, {dev:?}",
        w = args.width,
        b = args.batch,
        n = args.batches,
        e = args.epochs,
        dev = args.device,
    );
    common::report(args.json, args.enabled, precision, &title, &f32, &amp)
}
