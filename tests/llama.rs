//! `examples/llama.rs` at tiny size: a Llama-style decoder written as candle-transformers
//! writes it, under `#[autocast]`. Each op runs in its class (rope in the half dtype it is
//! given, the projections and attention in the half dtype, the norms, softmax and loss in f32);
//! every parameter gets a gradient, the query and key projections included (candle-nn's rope
//! has no backward); the attention op and upstream's explicit attention agree; KV-cached
//! generation reproduces a full recompute; and over 8 seeds the median final loss of bf16 and
//! fp16 training is within 3% of f32's.

#[path = "../examples/transformers/counting.rs"]
mod counting;
// The model keeps candle-transformers' style, not this crate's lints; it imports candle-nn's
// `Module` for `layer.forward(..)`, which in a region are module calls that do not name the trait.
#[allow(unused_imports, clippy::pedantic)]
#[path = "../examples/transformers/llama_model.rs"]
mod llama_model;

mod common;

use candle_amp::report::{self, PrecisionReport};
use candle_amp::{GradScaler, OpClass};
use candle_core::{DType, Device, Result, Tensor, Var};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};
use counting::Counting;
use llama_model::{Cache, Config, Llama};

type Loss = fn(&Llama, &mut Cache, &Tensor) -> Result<Tensor>;

const MODES: [(&str, Loss, DType); 3] = [
    ("f32", llama_model::loss_f32 as Loss, DType::F32),
    ("fp16", llama_model::loss_fp16, DType::F16),
    ("bf16", llama_model::loss_bf16, DType::BF16),
];

fn tiny(use_flash_attn: bool, tie_word_embeddings: bool) -> Config {
    Config {
        hidden_size: 32,
        intermediate_size: 88,
        num_hidden_layers: 2,
        num_attention_heads: 4,
        num_key_value_heads: 2,
        max_position_embeddings: 32,
        use_flash_attn,
        tie_word_embeddings,
        ..Config::tiny(12)
    }
}

/// A model with weights drawn from `seed` (uniform, `1 / sqrt(fan_in)` for matrices; the norms'
/// scales kept at 1), the same on every run.
fn seeded(cfg: &Config, seed: u64) -> Result<(Llama, VarMap)> {
    let vars = VarMap::new();
    let m = Llama::load(
        VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu),
        cfg,
    )?;
    let data = vars.data().lock().unwrap();
    let mut named: Vec<_> = data.iter().collect();
    named.sort_by(|a, b| a.0.cmp(b.0));
    for (i, (_, var)) in named.into_iter().enumerate() {
        let t = var.as_tensor();
        if t.rank() == 2 {
            let bound = 1.0 / (t.dim(1)? as f32).sqrt();
            let u: Vec<f32> = common::values(t.elem_count(), seed * 1_000 + i as u64)
                .iter()
                .map(|v| v * bound)
                .collect();
            var.set(&Tensor::from_vec(u, t.shape(), t.device())?)?;
        }
    }
    drop(data);
    Ok((m, vars))
}

/// Every lower-precision op in `lower`, every fp32-class op in f32, and `named` among them.
fn assert_classes(rep: &PrecisionReport, lower: DType, named: &[&str]) {
    for e in &rep.entries {
        match e.class {
            OpClass::LowerPrecision => assert_eq!(e.output, lower, "{} in {rep}", e.op),
            OpClass::Fp32 => assert_eq!(e.output, DType::F32, "{} in {rep}", e.op),
            OpClass::Promote | OpClass::Preserve => {}
        }
    }
    for op in named {
        assert!(rep.op(op).next().is_some(), "no `{op}` in {rep}");
    }
}

#[test]
fn each_op_runs_in_its_class_and_every_parameter_gets_a_gradient() -> Result<()> {
    let ids = Counting::new(12, 1).batch(2, 9, &Device::Cpu)?;
    for flash in [true, false] {
        let cfg = tiny(flash, false);
        let (m, vars) = seeded(&cfg, 0)?;
        let attention: &[&str] = if flash {
            &["scaled_dot_product_attention"]
        } else {
            &["matmul", "softmax", "where_cond"]
        };
        for (name, loss, lower) in MODES {
            let mut cache = Cache::new(false, DType::F32, &cfg, &Device::Cpu)?;
            let (l, rep) = report::record(|| loss(&m, &mut cache, &ids));
            let l = l?;
            assert_eq!(l.dtype(), DType::F32, "{name}: the loss leaves in f32");
            if lower != DType::F32 {
                let named = [
                    &["linear", "rope", "rms_norm", "silu", "cross_entropy", "cat"][..],
                    attention,
                ]
                .concat();
                assert_classes(&rep, lower, &named);
                // Rope keeps the half dtype of the projections it is given (its tables are f32).
                for e in rep.op("rope") {
                    assert_eq!(e.output, lower, "{name}: {rep}");
                }
            }
            let grads = l.backward()?;
            let data = vars.data().lock().unwrap();
            assert_eq!(data.len(), 2 * 9 + 3, "{name}: parameters");
            for (param, var) in data.iter() {
                let g = grads
                    .get(var)
                    .unwrap_or_else(|| panic!("{name}: no gradient reached `{param}`"));
                assert_eq!(g.dtype(), DType::F32, "{name}: `{param}`");
                let v = g.flatten_all()?.to_vec1::<f32>()?;
                assert!(v.iter().all(|x| x.is_finite()), "{name}: `{param}`");
                // The query and key projections reach the loss only through rope.
                assert!(v.iter().any(|x| *x != 0.0), "{name}: `{param}` all zero");
            }
        }
    }
    Ok(())
}

/// The attention op (upstream's flash-attention path) and upstream's explicit attention
/// (`repeat_kv`, `matmul`, `masked_fill`, `softmax_last_dim`) are the same function: equal
/// logits in f32 from the same weights, tied head or not.
#[test]
fn the_attention_op_and_the_explicit_path_agree_in_f32() -> Result<()> {
    let ids = Counting::new(12, 2).batch(2, 10, &Device::Cpu)?;
    for tied in [false, true] {
        let logits = |flash: bool| -> Result<Tensor> {
            let cfg = tiny(flash, tied);
            let (m, _) = seeded(&cfg, 3)?;
            let mut cache = Cache::new(false, DType::F32, &cfg, &Device::Cpu)?;
            m.logits(&ids, 0, &mut cache)
        };
        let diff = (logits(true)? - logits(false)?)?
            .abs()?
            .max_all()?
            .to_scalar::<f32>()?;
        assert!(diff < 1e-5, "tied {tied}: {diff}");
    }
    Ok(())
}

/// Greedy generation with the KV cache (keys and values grown by `Tensor::cat`, queries at
/// `index_pos` seeing the cached keys) gives the last-position logits of full recomputes.
#[test]
fn cached_generation_matches_a_full_recompute() -> Result<()> {
    for flash in [true, false] {
        let cfg = tiny(flash, false);
        let (m, _) = seeded(&cfg, 5)?;
        let (tokens, diff) = llama_model::generate_checked(&m, &cfg, &Device::Cpu, &[1, 3, 5], 6)?;
        assert_eq!(tokens.len(), 9);
        assert!(diff < 1e-4, "flash {flash}: {diff}");
    }
    Ok(())
}

/// The mean loss of the last 5 of `steps` AdamW steps from seed `seed`'s weights, in `loss`'s
/// mode (fp16 with a GradScaler).
fn final_loss(cfg: &Config, seed: u64, loss: Loss, fp16: bool, steps: usize) -> Result<f32> {
    let (m, vars) = seeded(cfg, seed)?;
    let params = ParamsAdamW {
        lr: 3e-3,
        weight_decay: 0.0,
        ..ParamsAdamW::default()
    };
    let mut opt = AdamW::new(vars.all_vars(), params)?;
    let mut scaler = GradScaler::builder().enabled(fp16).build()?;
    let mut cache = Cache::new(false, DType::F32, cfg, &Device::Cpu)?;
    let mut data = Counting::new(cfg.vocab_size, 7);
    let mut losses = Vec::new();
    for _ in 0..steps {
        let ids = data.batch(8, 17, &Device::Cpu)?;
        let l = loss(&m, &mut cache, &ids)?;
        let grads = scaler.scale(&l)?.backward()?;
        let _ = scaler.step(&mut opt, grads)?;
        scaler.update()?;
        losses.push(l.to_scalar::<f32>()?);
    }
    let tail = &losses[steps - 5..];
    Ok(tail.iter().sum::<f32>() / tail.len() as f32)
}

fn median(mut v: Vec<f32>) -> f32 {
    v.sort_by(f32::total_cmp);
    f32::midpoint(v[v.len() / 2 - 1], v[v.len() / 2])
}

#[test]
fn median_final_loss_over_8_seeds_is_within_3_percent_of_f32_in_bf16_and_fp16() -> Result<()> {
    let cfg = tiny(true, false);
    let steps = 40;
    let mut medians = Vec::new();
    for (name, loss, dtype) in MODES {
        let finals = (0..8)
            .map(|seed| final_loss(&cfg, seed, loss, dtype == DType::F16, steps))
            .collect::<Result<Vec<_>>>()?;
        assert!(finals.iter().all(|l| l.is_finite()), "{name}: {finals:?}");
        medians.push((name, median(finals)));
    }
    let f32_median = medians[0].1;
    // It learned: a uniform guess over 12 tokens is ln 12 = 2.48.
    assert!(f32_median < 1.5, "f32 did not learn: {medians:?}");
    for &(name, m) in &medians[1..] {
        let gap = (m - f32_median).abs() / f32_median;
        assert!(
            gap <= 0.03,
            "{name}: median {m} against f32's {f32_median} ({medians:?})"
        );
    }
    Ok(())
}

/// candle-nn's own rope (no backward) would leave the query and key projections without a
/// gradient: the routed one is the difference, checked directly on one projection.
#[test]
fn rope_in_a_region_passes_the_gradient_candle_nn_s_drops() -> Result<()> {
    let dev = Device::Cpu;
    let x = Var::from_tensor(&Tensor::randn(0f32, 1.0, (1, 2, 4, 8), &dev)?)?;
    let (cos, sin) = {
        let a = Tensor::arange(0f32, 16.0, &dev)?
            .reshape((4, 4))?
            .affine(0.1, 0.0)?;
        (a.cos()?, a.sin()?)
    };
    let candle = candle_nn::rotary_emb::rope(&x, &cos, &sin)?
        .sum_all()?
        .backward()?;
    assert!(
        candle.get(&x).is_none(),
        "candle-nn's rope gives no gradient"
    );
    let routed = rope_bf16(&x, &cos, &sin)?;
    assert_eq!(routed.dtype(), DType::F32);
    let g = routed.sum_all()?.backward()?;
    let gx = g.get(&x).expect("the routed rope's gradient reaches x");
    assert!(gx.abs()?.sum_all()?.to_scalar::<f32>()? > 0.0);
    Ok(())
}

#[candle_amp::autocast(bf16)]
fn rope_bf16(x: &Tensor, cos: &Tensor, sin: &Tensor) -> Result<Tensor> {
    let y = candle_nn::rotary_emb::rope(&x.to_dtype(DType::BF16)?, cos, sin)?;
    assert_eq!(y.dtype(), DType::BF16);
    y.to_dtype(DType::F32)
}
