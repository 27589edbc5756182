//! GPT under autocast: a GPT-2-style decoder (`examples/transformers/gpt_model.rs`, written as
//! candle-transformers writes one) trained on a synthetic next-token task in f32, fp16 (with
//! `GradScaler`) and bf16, from the same initial weights and batches; then greedy generation
//! with the KV cache from a prompt, checked against a full recompute.
//!
//! `cargo run --release --example gpt` prints a table (ms/step, final loss, peak memory, skipped
//! steps per mode), writes `gpt_loss.png` into `--out`, and prints the generated text;
//! `--json` prints one line `{"f32": {..}, "fp16": {..}, "bf16": {..},
//! "kv_cache_max_abs_diff": x}`.
//!
//! The task: sequences that count up by a stride (1, 2, 3 or 5) modulo the vocabulary, written
//! as letters; the next token follows from the context, so a trained model continues `a c e`
//! with `g i k ...`.

#[path = "common/mod.rs"]
mod common;
#[path = "transformers/counting.rs"]
mod counting;
#[path = "transformers/gpt_model.rs"]
mod gpt_model;

use std::path::PathBuf;

use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW};
use candle_amp::{checkpoint, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use common::modes::{self, Mode, ModeResult};
use counting::Counting;
use gpt_model::{Config, Gpt};

/// Trains a small GPT in f32, fp16 and bf16 and generates with its KV cache.
#[derive(Parser, Debug, Clone)]
#[command(about)]
struct Args {
    /// Training steps per mode.
    #[arg(long, default_value_t = 300, value_parser = common::positive)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 16, value_parser = common::positive)]
    batch: usize,
    /// Tokens per training sequence.
    #[arg(long, default_value_t = 32, value_parser = common::positive)]
    seq: usize,
    /// Vocabulary size (letters a, b, c, ...; 5 to 26).
    #[arg(long, default_value_t = 16, value_parser = common::positive)]
    vocab: usize,
    /// Width of the model.
    #[arg(long, default_value_t = 64, value_parser = common::positive)]
    width: usize,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the initial weights (every mode starts from the same ones): a run is
    /// repeatable, as with `torch.manual_seed`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON line on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Where `gpt_loss.png` goes.
    #[arg(long, default_value = "target/examples-out")]
    out: PathBuf,
    /// After training, save each mode's checkpoint (`gpt-f32.safetensors`, ...) in this folder.
    #[arg(long)]
    save: Option<PathBuf>,
    /// Resume each mode from its checkpoint in this folder and train `--steps` more steps: the
    /// same losses, bit for bit, as one run of all the steps.
    #[arg(long)]
    resume: Option<PathBuf>,
    /// Device: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda` (the peak is then
    /// the GPU's memory pool's).
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    device: Device,
}

/// The loss of one batch in `mode`.
fn loss(mode: Mode, m: &mut Gpt, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    match mode {
        Mode::F32 => gpt_model::loss_f32(m, ids),
        Mode::Fp16 => gpt_model::loss_fp16(m, ids),
        Mode::Bf16 => gpt_model::loss_bf16(m, ids),
    }
}

/// Trains a fresh model from `init` in `mode`; returns the figures and the trained model.
fn train(
    args: &Args,
    cfg: &Config,
    init: &common::Init,
    mode: Mode,
    label: bool,
) -> Result<(ModeResult, Gpt)> {
    let dev = &args.device;
    let peak = common::Peak::start(dev)?;
    let mut vars = VarMap::new();
    let mut model = Gpt::new(cfg, VarBuilder::from_varmap(&vars, DType::F32, dev))?;
    vars.set(init.iter().map(|(name, t)| (name, t)))?;
    let params = ParamsAdamW {
        lr: args.lr,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(vars.all_vars(), params)?;
    let mut scaler = modes::scaler(mode)?;
    let file = |dir: &PathBuf| dir.join(format!("gpt-{}.safetensors", mode.name()));
    let start = match &args.resume {
        Some(dir) => {
            let step = checkpoint::load(file(dir), &vars, &mut opt, &mut scaler)?;
            common::note_resumed_rate(opt.learning_rate(), args.lr);
            step as usize
        }
        None => 0,
    };
    let mut data = Counting::new(args.vocab, 7);
    for _ in 0..start {
        data.batch(args.batch, args.seq + 1, dev)?; // the batches the run so far drew
    }
    let quiet = args.json || !label;
    let steps = start..start + args.steps;
    let result = modes::run_steps(mode, steps, quiet, &peak, &mut opt, &mut scaler, |_, _| {
        let ids = data.batch(args.batch, args.seq + 1, dev)?;
        loss(mode, &mut model, &ids)
    })?;
    if let Some(dir) = &args.save {
        std::fs::create_dir_all(dir)?;
        let step = (start + args.steps) as u64;
        checkpoint::save(file(dir), &vars, &opt, &scaler, step)?;
    }
    Ok((result, model))
}

fn letters(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| char::from(b'a' + t as u8).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

fn main() -> Result<()> {
    common::keep_freed_memory();
    let args = Args::parse();
    if !(5..=26).contains(&args.vocab) {
        candle_core::bail!(
            "--vocab must be 5 to 26, got {} (the tokens print as letters, and the generation's \
             prompt is tokens 0, 2 and 4)",
            args.vocab
        );
    }
    let cfg = Config {
        n_embd: args.width,
        n_positions: args.seq.max(32) + 32,
        ..Config::small(args.vocab)
    };
    if cfg.n_embd == 0 || !cfg.n_embd.is_multiple_of(cfg.n_head) {
        candle_core::bail!(
            "--width must be a positive multiple of the {} heads, got {}",
            cfg.n_head,
            args.width
        );
    }
    // One set of initial weights from the seed, copied into each mode's fresh model.
    let init = common::seeded_init(args.seed, &args.device, |vb| {
        Gpt::new(&cfg, vb.clone()).map(|_| ())
    })?;

    // One untimed step of each mode first: the thread pool and gemm's buffers stay allocated
    // afterwards, which would otherwise count in the first mode's peak only.
    let warm = Args {
        steps: 1,
        json: true,
        save: None,
        resume: None,
        ..args.clone()
    };
    for mode in Mode::ALL {
        train(&warm, &cfg, &init, mode, false)?;
    }
    let mut results = Vec::new();
    let mut f32_model = None;
    for mode in Mode::ALL {
        let (r, model) = train(&args, &cfg, &init, mode, true)?;
        if mode == Mode::F32 {
            f32_model = Some(model);
        }
        results.push((mode, r));
    }
    let mut model = f32_model.expect("f32 ran");
    let prompt = [0u32, 2, 4];
    let (tokens, cached) = gpt_model::generate(&mut model, &prompt, 12)?;
    let full = gpt_model::recomputed(&mut model, &tokens[..tokens.len() - 1], prompt.len())?;
    let kv_diff = gpt_model::max_abs_diff(&cached, &full);

    if args.json {
        let kv = ("kv_cache_max_abs_diff", f64::from(kv_diff).into());
        println!("{}", modes::json(&results, &[kv])?);
        return modes::check_finite(&results);
    }
    println!(
        "GPT ({} layers, width {}, {} heads), {} steps of batch {} x {} tokens, AdamW lr {}",
        cfg.n_layer, cfg.n_embd, cfg.n_head, args.steps, args.batch, args.seq, args.lr
    );
    modes::print_table(&results);
    modes::check_finite(&results)?;
    println!(
        "\nprompt: {}\ngenerated (f32 model, KV cache): {}\nKV-cached logits vs full recompute: \
         max |diff| {kv_diff:.2e}",
        letters(&prompt),
        letters(&tokens)
    );
    modes::draw(
        &args.out,
        "gpt_loss.png",
        "gpt: training loss (next-token cross-entropy)",
        &results,
    )?;
    Ok(())
}
