//! Llama under autocast: a Llama-style decoder (`examples/transformers/llama_model.rs`, written
//! as candle-transformers' `llama.rs` writes it: RMSNorm, rotary embeddings, SwiGLU,
//! grouped-query attention with a KV cache, no biases) trained on a synthetic next-token task in
//! f32, fp16 (with `GradScaler`) and bf16, from the same initial weights and batches; then greedy
//! generation with the KV cache, checked against a full recompute.
//!
//! `cargo run --release --example llama` prints a table (ms/step, final loss, peak memory,
//! skipped steps per mode), writes `llama_loss.png` into `--out` and prints the generated text.
//! `--seeds N` trains every mode from N seeds of initial weights (seeds `--seed..--seed + N`)
//! and reports each mode's median final loss; `--json` prints one line `{"f32": {"final_loss",
//! "ms_per_step", ..}, "fp16": {..}, "bf16": {..}, "kv_cache_max_abs_diff": x}` (with several
//! seeds: the median final loss and step time, and each seed's final losses in
//! `"final_losses"`).
//!
//! The task is `gpt`'s: sequences that count up by a stride (1, 2, 3 or 5) modulo the
//! vocabulary, written as letters.

#[path = "common/mod.rs"]
mod common;
#[path = "transformers/counting.rs"]
mod counting;
// The model keeps candle-transformers' style, not this crate's lints; it imports candle-nn's
// `Module` for `layer.forward(..)`, which in a region are module calls that do not name the trait.
#[allow(unused_imports, clippy::pedantic)]
#[path = "transformers/llama_model.rs"]
mod llama_model;

use std::path::PathBuf;

use candle_amp::optim::{AdamW, Optimizer, ParamsAdamW};
use candle_amp::{Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use clap::Parser;
use common::modes::{self, Mode, ModeResult};
use counting::Counting;
use llama_model::{Cache, Config, Llama};

/// Trains a small Llama in f32, fp16 and bf16 and generates with its KV cache.
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
    /// Vocabulary size (letters a, b, c, ...; at most 26).
    #[arg(long, default_value_t = 16, value_parser = common::positive)]
    vocab: usize,
    /// Width of the model (a multiple of 4, the query heads).
    #[arg(long, default_value_t = 64, value_parser = common::positive)]
    width: usize,
    /// Tie the LM head to the token embeddings (`tie_word_embeddings`).
    #[arg(long)]
    tied: bool,
    /// Attend with upstream's explicit path (`repeat_kv`, f32 `matmul`, `masked_fill`,
    /// `softmax_last_dim`) instead of the attention op (upstream's `use_flash_attn`).
    #[arg(long)]
    explicit_attention: bool,
    /// AdamW learning rate.
    #[arg(long, default_value_t = 3e-3)]
    lr: f64,
    /// Seed of the initial weights (every mode starts from the same ones).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// How many seeds to train from (`--seed` and the ones after it); the reported final loss
    /// is each mode's median over them.
    #[arg(long, default_value_t = 1, value_parser = common::positive)]
    seeds: usize,
    /// Print one JSON line on stdout instead of the table.
    #[arg(long)]
    json: bool,
    /// Where `llama_loss.png` goes.
    #[arg(long, default_value = "target/examples-out")]
    out: PathBuf,
    /// Device: `cpu`, or `cuda` / `cuda:N` in a build with `--features cuda`.
    #[arg(long, default_value = "cpu", value_parser = common::parse_device)]
    device: Device,
}

/// The loss of one batch in `mode`.
fn loss(
    mode: Mode,
    m: &Llama,
    cache: &mut Cache,
    ids: &candle_core::Tensor,
) -> Result<Tensor<F32>> {
    let l = match mode {
        Mode::F32 => llama_model::loss_f32(m, cache, ids),
        Mode::Fp16 => llama_model::loss_fp16(m, cache, ids),
        Mode::Bf16 => llama_model::loss_bf16(m, cache, ids),
    }?;
    Tensor::<F32>::from_candle(l)
}

/// Trains a fresh model from `init` in `mode`; returns the figures and the trained model.
fn train(
    args: &Args,
    cfg: &Config,
    init: &common::Init,
    mode: Mode,
    quiet: bool,
) -> Result<(ModeResult, Llama)> {
    let dev = &args.device;
    let peak = common::Peak::start(dev)?;
    let mut vars = VarMap::new();
    let model = Llama::load(VarBuilder::from_varmap(&vars, DType::F32, dev), cfg)?;
    vars.set(init.iter().map(|(name, t)| (name, t)))?;
    let params = ParamsAdamW {
        lr: args.lr,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(vars.all_vars(), params)?;
    let mut scaler = modes::scaler(mode)?;
    let mut cache = Cache::new(false, DType::F32, cfg, dev)?;
    let mut data = Counting::new(args.vocab, 7);
    let result = modes::run_steps(
        mode,
        0..args.steps,
        quiet,
        &peak,
        &mut opt,
        &mut scaler,
        |_, _| {
            let ids = data.batch(args.batch, args.seq + 1, dev)?;
            loss(mode, &model, &mut cache, &ids)
        },
    )?;
    Ok((result, model))
}

fn letters(tokens: &[u32]) -> String {
    tokens
        .iter()
        .map(|&t| char::from(b'a' + t as u8).to_string())
        .collect::<Vec<_>>()
        .join(" ")
}

/// One seed's results, mode by mode.
type Run = Vec<(Mode, ModeResult)>;

/// Every mode trained from each of the `--seeds` seeds, one run per seed; and the first seed's
/// f32 model.
fn train_seeds(args: &Args, cfg: &Config) -> Result<(Vec<Run>, Llama)> {
    let init_of = |seed: u64| {
        common::seeded_init(seed, &args.device, |vb| {
            Llama::load(vb.clone(), cfg).map(|_| ())
        })
    };
    // One untimed step of each mode first: the thread pool and gemm's buffers stay allocated
    // afterwards, which would otherwise count in the first mode's peak only.
    let warm = Args {
        steps: 1,
        ..args.clone()
    };
    let init = init_of(args.seed)?;
    for mode in Mode::ALL {
        train(&warm, cfg, &init, mode, true)?;
    }
    let mut runs = Vec::new();
    let mut f32_model = None;
    for s in 0..args.seeds as u64 {
        let init = init_of(args.seed + s)?;
        let mut results = Vec::new();
        for mode in Mode::ALL {
            let (r, model) = train(args, cfg, &init, mode, args.json || s > 0)?;
            if mode == Mode::F32 && s == 0 {
                f32_model = Some(model);
            }
            results.push((mode, r));
        }
        runs.push(results);
    }
    Ok((runs, f32_model.expect("f32 ran")))
}

/// The first seed's results with the median final loss and step time over all seeds, and each
/// mode's final losses, seed by seed.
fn medians(mut runs: Vec<Run>) -> (Run, Vec<Vec<f32>>) {
    let per_seed: Vec<Vec<f32>> = (0..Mode::ALL.len())
        .map(|i| runs.iter().map(|r| r[i].1.final_loss).collect())
        .collect();
    let times: Vec<Vec<f64>> = (0..Mode::ALL.len())
        .map(|i| runs.iter().map(|r| r[i].1.ms_per_step).collect())
        .collect();
    let mut results = runs.swap_remove(0);
    for (i, (_, r)) in results.iter_mut().enumerate() {
        let mut losses: Vec<f64> = per_seed[i].iter().map(|&l| f64::from(l)).collect();
        r.final_loss = common::median(&mut losses) as f32;
        r.ms_per_step = common::median(&mut times[i].clone());
    }
    (results, per_seed)
}

fn main() -> Result<()> {
    common::keep_freed_memory();
    let args = Args::parse();
    if args.vocab > 26 {
        candle_core::bail!("--vocab is at most 26 (the tokens print as letters)");
    }
    let heads = Config::tiny(args.vocab).num_attention_heads;
    if args.width % (2 * heads) != 0 {
        candle_core::bail!(
            "--width must be a multiple of {} (the heads, each of even width)",
            2 * heads
        );
    }
    let cfg = Config {
        hidden_size: args.width,
        intermediate_size: (8 * args.width / 3).next_multiple_of(4),
        max_position_embeddings: args.seq.max(32) + 32,
        tie_word_embeddings: args.tied,
        use_flash_attn: !args.explicit_attention,
        ..Config::tiny(args.vocab)
    };
    let (runs, model) = train_seeds(&args, &cfg)?;
    let prompt = [0u32, 2, 4];
    let (tokens, kv_diff) = llama_model::generate_checked(&model, &cfg, &args.device, &prompt, 12)?;
    let (results, per_seed) = medians(runs);

    if args.json {
        let mut extra = vec![("kv_cache_max_abs_diff", f64::from(kv_diff).into())];
        if args.seeds > 1 {
            let losses: serde_json::Map<String, serde_json::Value> = Mode::ALL
                .iter()
                .zip(&per_seed)
                .map(|(m, l)| (m.name().to_string(), serde_json::json!(l)))
                .collect();
            extra.push(("final_losses", losses.into()));
        }
        println!("{}", modes::json(&results, &extra)?);
        return modes::check_finite(&results);
    }
    println!(
        "Llama ({} layers, width {}, {} query / {} key-value heads, {} head), {} steps of batch \
         {} x {} tokens, AdamW lr {}, {} attention",
        cfg.num_hidden_layers,
        cfg.hidden_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        if cfg.tie_word_embeddings {
            "tied"
        } else {
            "untied"
        },
        args.steps,
        args.batch,
        args.seq,
        args.lr,
        if cfg.use_flash_attn { "op" } else { "explicit" },
    );
    if args.seeds > 1 {
        let seeds = args.seed..args.seed + args.seeds as u64;
        println!("median final loss and step time over seeds {seeds:?}:");
    }
    modes::print_table(&results);
    modes::check_finite(&results)?;
    for (mode, r) in &results[1..] {
        let ratio = r.final_loss / results[0].1.final_loss;
        println!("{} final loss / f32: {ratio:.4}", mode.name());
    }
    println!(
        "\nprompt: {}\ngenerated (f32 model, KV cache): {}\nKV-cached logits vs full recompute: \
         max |diff| {kv_diff:.2e}",
        letters(&prompt),
        letters(&tokens)
    );
    modes::draw(
        &args.out,
        "llama_loss.png",
        "llama: training loss (next-token cross-entropy)",
        &results,
    )
}
