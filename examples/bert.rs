//! BERT under autocast: a BERT encoder with its masked-LM head
//! (`examples/transformers/bert_model.rs`, written as candle-transformers writes one) trained on
//! a synthetic masked-LM task in f32, fp16 (with `GradScaler`) and bf16, from the same initial
//! weights and batches; then the f32 model fills in the masks of a fixed example.
//!
//! `cargo run --release --example bert` prints a table (ms/step, final loss, peak memory, skipped
//! steps per mode), writes `bert_loss.png` into `--out`, and prints the filled-in example;
//! `--json` prints one line `{"f32": {..}, "fp16": {..}, "bf16": {..}}`.
//!
//! The task (`MaskedCounting`): `[CLS] A [SEP] B [SEP]`, where segment A runs up the alphabet
//! (`c d e f`) and segment B, half of the time, back down from A's last letter (`f e d c b`),
//! and is random letters otherwise (as BERT pairs a sentence with its successor or a random
//! one). Sequences have different lengths, so each batch is padded and the attention masks the
//! padding. 15% of the letters are replaced by `[MASK]` and predicted; the loss is the
//! cross-entropy at those positions, and cannot reach 0 (a random B's letters are
//! unpredictable). The final loss is the mean of the last tenth of the steps' losses.
//!
//! The defaults (one layer, no dropout, 700 steps with BERT's linear warm-up and decay of the
//! learning rate) let the model learn the task on two CPU cores in about 15 s for all three
//! modes; a second layer or BERT's dropout of 0.1 (`--layers 2 --dropout 0.1`) need more
//! steps.

#[path = "transformers/bert_model.rs"]
mod bert_model;
#[path = "common/mod.rs"]
mod common;

use std::path::PathBuf;

use bert_model::{BertForMaskedLM, Config, MaskedCounting, MlmBatch};
use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW};
use candle_amp::{Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use common::modes::{self, Mode, ModeResult};

/// Trains a small BERT on masked-LM in f32, fp16 and bf16.
#[derive(Parser, Debug, Clone)]
#[command(about)]
struct Args {
    /// Training steps per mode.
    #[arg(long, default_value_t = 700, value_parser = common::positive)]
    steps: usize,
    /// Sequences per batch.
    #[arg(long, default_value_t = 32, value_parser = common::positive)]
    batch: usize,
    /// Longest sequence, in tokens with `[CLS]` and the two `[SEP]`s (at least 7).
    #[arg(long, default_value_t = 16, value_parser = common::positive)]
    seq: usize,
    /// Number of letters (a, b, c, ...; at most 26); the vocabulary adds 4 special tokens.
    #[arg(long, default_value_t = 16, value_parser = common::positive)]
    letters: usize,
    /// Hidden size of the model (a multiple of 4, the number of heads).
    #[arg(long, default_value_t = 64, value_parser = common::positive)]
    width: usize,
    /// Encoder layers.
    #[arg(long, default_value_t = 1, value_parser = common::positive)]
    layers: usize,
    /// Dropout probability of the hidden states and attention probabilities (BERT's is 0.1).
    #[arg(long, default_value_t = 0.0)]
    dropout: f32,
    /// Peak AdamW learning rate, reached after `--warmup` steps, then decayed linearly to 0.
    #[arg(long, default_value_t = 2e-3)]
    lr: f64,
    /// Linear warm-up steps of the learning rate.
    #[arg(long, default_value_t = 50)]
    warmup: usize,
    /// Seed of the initial weights (every mode starts from the same ones): a run is
    /// repeatable, as with `torch.manual_seed`.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Print one JSON line on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Where `bert_loss.png` goes.
    #[arg(long, default_value = "target/examples-out")]
    out: PathBuf,
    /// Device: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda` (the peak is then
    /// the GPU's memory pool's).
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    device: Device,
}

/// The loss of one batch in `mode`.
fn loss(mode: Mode, m: &BertForMaskedLM, batch: &MlmBatch) -> Result<Tensor<F32>> {
    match mode {
        Mode::F32 => bert_model::loss_f32(m, batch),
        Mode::Fp16 => bert_model::loss_fp16(m, batch),
        Mode::Bf16 => bert_model::loss_bf16(m, batch),
    }
}

/// The dtype the attention ran in during a mode's last step.
type AttentionDtypes = Option<DType>;

/// Trains a fresh model from `init` in `mode`; returns the figures, the attention's dtypes in
/// the last step and the trained model.
fn train(
    args: &Args,
    cfg: &Config,
    init: &common::Init,
    mode: Mode,
    label: bool,
) -> Result<(ModeResult, AttentionDtypes, BertForMaskedLM)> {
    let dev = &args.device;
    let peak = common::Peak::start(dev)?;
    let mut vars = VarMap::new();
    let model = BertForMaskedLM::load(VarBuilder::from_varmap(&vars, DType::F32, dev), cfg)?;
    vars.set(init.iter().map(|(name, t)| (name, t)))?;
    let params = ParamsAdamW {
        lr: args.lr,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(vars.all_vars(), params)?;
    let mut data = MaskedCounting::new(args.letters, 7);
    let quiet = args.json || !label;
    let mut scaler = modes::scaler(mode)?;
    let steps = 0..args.steps;
    let result = modes::run_steps(
        mode,
        steps,
        quiet,
        &peak,
        &mut opt,
        &mut scaler,
        |opt, step| {
            opt.set_learning_rate(learning_rate(args, step));
            let batch = data.batch(args.batch, args.seq, dev)?;
            loss(mode, &model, &batch)
        },
    )?;
    let attention = model.attention_dtypes()[0];
    Ok((result, attention, model))
}

/// BERT's schedule: linear warm-up to `--lr`, then linear decay to 0 at the last step.
fn learning_rate(args: &Args, step: usize) -> f64 {
    if step < args.warmup {
        args.lr * (step + 1) as f64 / args.warmup as f64
    } else {
        args.lr * (args.steps - step) as f64 / (args.steps - args.warmup) as f64
    }
}

/// Tokens as text: letters, and the special tokens by name.
fn text(data: &MaskedCounting, tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| match t {
            t if t == data.pad() => "[PAD]".to_string(),
            t if t == data.cls() => "[CLS]".to_string(),
            t if t == data.sep() => "[SEP]".to_string(),
            t if t == data.mask() => "[MASK]".to_string(),
            t => char::from(b'a' + t as u8).to_string(),
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// A fixed example with a mask in each segment and one at the segments' edge (A runs up from
/// `c`, B back down); returns it, the true letters and the f32 model's guesses at the masks.
fn fill_in(data: &MaskedCounting, model: &BertForMaskedLM) -> Result<(Vec<u32>, String, String)> {
    let (mut tokens, types) = data.sequence_of(2, 6, 6);
    let masked = [3, 6, 10];
    let truth: Vec<u32> = masked.iter().map(|&i| tokens[i]).collect();
    for &i in &masked {
        tokens[i] = data.mask();
    }
    let guesses = bert_model::fill_masks(model, &tokens, &types, data.mask())?;
    Ok((tokens, text(data, &truth), text(data, &guesses)))
}

/// The comparison table, with the run's settings above and the attention's dtypes below.
fn print_table(
    args: &Args,
    cfg: &Config,
    results: &[(Mode, ModeResult)],
    attention: &[AttentionDtypes],
) {
    println!(
        "BERT ({} layer(s), hidden {}, {} heads, dropout {}), {} steps of batch {} x up to {} \
         tokens, AdamW lr {} ({} warm-up steps, linear decay)",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        args.dropout,
        args.steps,
        args.batch,
        args.seq,
        args.lr,
        args.warmup
    );
    modes::print_table(results);
    let dtypes: Vec<String> = results
        .iter()
        .zip(attention)
        .map(|((mode, _), attention)| match attention {
            Some(dtype) => format!("{} {dtype:?}", mode.name()),
            None => format!("{} -", mode.name()),
        })
        .collect();
    println!(
        "attention ran in: {} (ms per step excludes each mode's first step)",
        dtypes.join(", ")
    );
}

fn main() -> Result<()> {
    common::keep_freed_memory();
    let args = Args::parse();
    if args.letters > 26 {
        candle_core::bail!("--letters is at most 26 (the tokens print as letters)");
    }
    if args.seq < 7 {
        candle_core::bail!("--seq is at least 7 (two letters in each segment and 3 specials)");
    }
    let data = MaskedCounting::new(args.letters, 0);
    let cfg = Config {
        hidden_size: args.width,
        num_hidden_layers: args.layers,
        intermediate_size: 4 * args.width,
        hidden_dropout_prob: args.dropout,
        attention_probs_dropout_prob: args.dropout,
        max_position_embeddings: args.seq.max(16),
        ..Config::small(data.vocab_size())
    };
    if cfg.hidden_size == 0 || !cfg.hidden_size.is_multiple_of(cfg.num_attention_heads) {
        candle_core::bail!(
            "--width must be a positive multiple of the {} heads, got {}",
            cfg.num_attention_heads,
            args.width
        );
    }
    // One set of initial weights from the seed, copied into each mode's fresh model.
    let init = common::seeded_init(args.seed, &args.device, |vb| {
        BertForMaskedLM::load(vb.clone(), &cfg).map(|_| ())
    })?;

    // One untimed step of each mode first: the thread pool and gemm's buffers stay allocated
    // afterwards, which would otherwise count in the first mode's peak only.
    let warm = Args {
        steps: 1,
        json: true,
        ..args.clone()
    };
    for mode in Mode::ALL {
        train(&warm, &cfg, &init, mode, false)?;
    }
    let mut results = Vec::new();
    let mut f32_model = None;
    let mut attention = Vec::new();
    for mode in Mode::ALL {
        let (r, dtypes, model) = train(&args, &cfg, &init, mode, true)?;
        if mode == Mode::F32 {
            f32_model = Some(model);
        }
        results.push((mode, r));
        attention.push(dtypes);
    }

    if args.json {
        println!("{}", modes::json(&results, &[])?);
        return modes::check_finite(&results);
    }
    print_table(&args, &cfg, &results, &attention);
    modes::check_finite(&results)?;
    let (masked, truth, guesses) = fill_in(&data, &f32_model.expect("f32 ran"))?;
    println!(
        "\ninput: {}\nmasked letters: {truth}\nf32 model's guesses: {guesses}",
        text(&data, &masked)
    );
    modes::draw(
        &args.out,
        "bert_loss.png",
        "bert: training loss (masked-LM cross-entropy)",
        &results,
    )?;
    Ok(())
}
