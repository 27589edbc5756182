//! A GPT-BigCode-style decoder written as candle-transformers writes it, ported by adding the
//! attribute and the type names: `&mut self` forwards holding a KV cache in a field as
//! `Option<(AmpTensor, AmpTensor)>`, grown with `Tensor::cat`; an additive f32 mask passed as
//! `Option<&candle_core::Tensor>`; blocks walked by `&mut`; a `Vec<Box<dyn AmpModule>>`
//! MLP; `.apply`; candle's shape and scalar idioms; a parameter used twice.
//!
//! Expectations: the attention matmuls run in the policy's lower precision (f16, bf16, f32 with
//! `enabled = false`), and generation with the cache gives the logits of a full recompute.

use candle_amp::nn::{self, Embedding, LayerNorm, Linear};
use candle_amp::{autocast, ops, AmpModule, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, IndexOp, Result, D};
use candle_nn::{VarBuilder, VarMap};

struct Attention {
    c_attn: Linear,
    c_proj: Linear,
    heads: usize,
    kv_cache: Option<(AmpTensor, AmpTensor)>,
    /// The dtype each attention-score matmul ran in.
    score_dtypes: Vec<DType>,
}

#[autocast]
impl Attention {
    fn split_heads(&self, x: &AmpTensor) -> Result<AmpTensor> {
        let (b, t, c) = x.dims3()?;
        x.reshape((b, t, self.heads, c / self.heads))?
            .transpose(1, 2)?
            .contiguous()
    }

    fn forward(
        &mut self,
        x: &Tensor<F32>,
        mask: Option<&candle_core::Tensor>,
    ) -> Result<Tensor<F32>> {
        let (b, t, c) = x.dims3()?;
        let qkv = self.c_attn.forward(x)?;
        let q = self.split_heads(&qkv.narrow(D::Minus1, 0, c)?)?;
        let k = self.split_heads(&qkv.narrow(D::Minus1, c, c)?)?;
        let v = self.split_heads(&qkv.narrow(D::Minus1, 2 * c, c)?)?;
        let (k, v) = match &self.kv_cache {
            Some((past_k, past_v)) => (
                Tensor::cat(&[past_k, &k], 2)?,
                Tensor::cat(&[past_v, &v], 2)?,
            ),
            None => (k, v),
        };
        self.kv_cache = Some((k.clone(), v.clone()));
        let (_, _, _, head_dim) = q.dims4()?;
        let scale = 1.0 / (head_dim as f64).sqrt();
        let att = (q * scale)?.matmul(&k.t()?)?;
        self.score_dtypes.push(att.dtype());
        let att = match mask {
            Some(mask) => att.broadcast_add(mask)?,
            None => att,
        };
        let att = ops::softmax(&att, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        self.c_proj.forward(&y)
    }
}

struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Vec<Box<dyn AmpModule>>,
}

#[autocast]
impl Block {
    fn forward(
        &mut self,
        x: &Tensor<F32>,
        mask: Option<&candle_core::Tensor>,
    ) -> Result<Tensor<F32>> {
        let h = (x + self.attn.forward(&x.apply(&self.ln_1)?, mask)?)?;
        let mut m = self.ln_2.forward(&h)?;
        for (i, layer) in self.mlp.iter().enumerate() {
            m = layer.forward(&m)?;
            if i + 1 < self.mlp.len() {
                m = m.gelu()?;
            }
        }
        // `(z - 1.0)?` and `(x / 8.0)?` as candle code writes scalars: here a no-op pair.
        let z = ((m + 1.0)? - 1.0)?;
        Ok((h + ((z * 8.0)? / 8.0)?)?)
    }
}

struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
}

/// The additive causal mask of `t` new positions after `past` cached ones, `(t, past + t)`.
fn causal_mask(t: usize, past: usize, device: &Device) -> Result<candle_core::Tensor> {
    let mask: Vec<f32> = (0..t)
        .flat_map(|i| (0..past + t).map(move |j| if j > past + i { -1e9 } else { 0.0 }))
        .collect();
    candle_core::Tensor::from_vec(mask, (t, past + t), device)
}

#[autocast]
impl Gpt {
    fn forward(&mut self, ids: &candle_core::Tensor, past: usize) -> Result<Tensor<F32>> {
        let (_b, t) = ids.dims2()?;
        let positions = candle_core::Tensor::arange(past as u32, (past + t) as u32, ids.device())?;
        let x = self
            .wte
            .forward(ids)?
            .broadcast_add(&self.wpe.forward(&positions)?)?;
        let mask = if t > 1 {
            Some(causal_mask(t, past, ids.device())?)
        } else {
            None
        };
        let mut h = x;
        // candle-transformers writes `self.blocks.iter_mut()`: the same `&mut Block` receivers.
        for block in &mut self.blocks {
            h = block.forward(&h, mask.as_ref())?;
        }
        self.lm_head.forward(&self.ln_f.forward(&h)?)
    }

    fn clear_kv_cache(&mut self) {
        for block in &mut self.blocks {
            block.attn.kv_cache = None;
        }
    }

    fn score_dtypes(&self) -> Vec<DType> {
        self.blocks
            .iter()
            .flat_map(|b| b.attn.score_dtypes.iter().copied())
            .collect()
    }
}

const VOCAB: usize = 11;
const WIDTH: usize = 8;

fn gpt(vb: VarBuilder) -> Result<Gpt> {
    let blocks = (0..2)
        .map(|i| {
            let vb = vb.pp(format!("h.{i}"));
            Ok(Block {
                ln_1: nn::layer_norm(WIDTH, 1e-5, vb.pp("ln_1"))?,
                attn: Attention {
                    c_attn: nn::linear(WIDTH, 3 * WIDTH, vb.pp("attn.c_attn"))?,
                    c_proj: nn::linear(WIDTH, WIDTH, vb.pp("attn.c_proj"))?,
                    heads: 2,
                    kv_cache: None,
                    score_dtypes: Vec::new(),
                },
                ln_2: nn::layer_norm(WIDTH, 1e-5, vb.pp("ln_2"))?,
                mlp: vec![
                    Box::new(nn::linear(WIDTH, 4 * WIDTH, vb.pp("mlp.c_fc"))?),
                    Box::new(nn::linear(4 * WIDTH, WIDTH, vb.pp("mlp.c_proj"))?),
                ],
            })
        })
        .collect::<Result<_>>()?;
    Ok(Gpt {
        wte: nn::embedding(VOCAB, WIDTH, vb.pp("wte"))?,
        wpe: nn::embedding(16, WIDTH, vb.pp("wpe"))?,
        blocks,
        ln_f: nn::layer_norm(WIDTH, 1e-5, vb.pp("ln_f"))?,
        lm_head: nn::linear(WIDTH, VOCAB, vb.pp("lm_head"))?,
    })
}

macro_rules! policy_run {
    ($name:ident, $($policy:tt)*) => {
        /// A call from a region: the model, held mutably, takes this region's policy.
        #[autocast($($policy)*)]
        fn $name(m: &mut Gpt, ids: &candle_core::Tensor, past: usize) -> Result<Tensor<F32>> {
            m.forward(ids, past)
        }
    };
}
policy_run!(run_fp16, fp16);
policy_run!(run_bf16, bf16);
policy_run!(run_disabled, fp16, enabled = false);

type Run = fn(&mut Gpt, &candle_core::Tensor, usize) -> Result<Tensor<F32>>;

/// Prefill `prompt` then decode `extra` tokens one at a time with the cache; the last
/// position's logits at each step, and the same from a full recompute of the sequence so far.
/// The last position's logits at each step.
type Logits = Vec<Vec<f32>>;

fn cached_and_recomputed(m: &mut Gpt, run: Run) -> Result<(Logits, Logits)> {
    let dev = Device::Cpu;
    let tokens = [1u32, 5, 2, 7, 3, 9];
    let prompt = 3;
    let (mut cached, mut full) = (Vec::new(), Vec::new());
    m.clear_kv_cache();
    let ids = candle_core::Tensor::new(&tokens[..prompt], &dev)?.unsqueeze(0)?;
    let logits = run(m, &ids, 0)?;
    cached.push(logits.as_candle().i((0, prompt - 1))?.to_vec1()?);
    for n in prompt..tokens.len() {
        let ids = candle_core::Tensor::new(&tokens[n..=n], &dev)?.unsqueeze(0)?;
        let logits = run(m, &ids, n)?;
        assert_eq!(logits.dims(), &[1, 1, VOCAB]);
        cached.push(logits.as_candle().i((0, 0))?.to_vec1()?);
    }
    for n in prompt..=tokens.len() {
        m.clear_kv_cache();
        let ids = candle_core::Tensor::new(&tokens[..n], &dev)?.unsqueeze(0)?;
        full.push(run(m, &ids, 0)?.as_candle().i((0, n - 1))?.to_vec1()?);
    }
    Ok((cached, full))
}

fn max_abs_diff(a: &Logits, b: &Logits) -> f32 {
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Replaces candle-nn's random initialisation (a fresh draw each run) by fixed weights, so the
/// half-precision tolerances below are checked on the same model every run: matrices
/// uniform-like in +-1/sqrt(fan-in) from a hash of their name and index, biases zero, norm gains
/// as initialised (ones).
fn fixed_weights(vars: &VarMap) -> Result<()> {
    let data = vars.data().lock().expect("the VarMap's lock");
    for (name, var) in data.iter() {
        let dims = var.dims().to_vec();
        if dims.len() < 2 && !name.ends_with("bias") {
            continue;
        }
        let fan_in = *dims.last().expect("a rank >= 1 weight");
        let bound = 1.0 / (fan_in as f32).sqrt();
        let seed = name
            .bytes()
            .fold(17u64, |h, b| h.wrapping_mul(31).wrapping_add(u64::from(b)));
        let values: Vec<f32> = (0..var.elem_count() as u64)
            .map(|i| {
                if dims.len() < 2 {
                    return 0.0;
                }
                let h = (seed ^ i).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 40;
                (h as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * bound
            })
            .collect();
        var.set(&candle_core::Tensor::from_vec(values, dims, &Device::Cpu)?)?;
    }
    Ok(())
}

#[test]
fn a_mut_self_kv_cache_decoder_runs_in_the_policys_precision_and_matches_a_full_recompute(
) -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let mut m = gpt(vb)?;
    fixed_weights(&vars)?;
    let (mut reference, mut per_policy) = (None, Vec::new());
    for (run, lower) in [
        (run_disabled as Run, DType::F32),
        (run_fp16, DType::F16),
        (run_bf16, DType::BF16),
    ] {
        for b in &mut m.blocks {
            b.attn.score_dtypes.clear();
        }
        let (cached, full) = cached_and_recomputed(&mut m, run)?;
        // 1 prefill + 3 decode steps, then 4 recomputes, per block.
        assert_eq!(m.score_dtypes(), vec![lower; 2 * 8], "under {lower:?}");
        let (tol, against_f32) = match lower {
            DType::F32 => (1e-5, f32::NAN),
            DType::F16 => (2e-2, 2e-2),
            _ => (1e-1, 1e-1),
        };
        let drift = max_abs_diff(&cached, &full);
        assert!(drift < tol, "{lower:?}: cached vs recompute {drift}");
        match &reference {
            None => reference = Some(full),
            Some(f32_logits) => {
                let d = max_abs_diff(&full, f32_logits);
                assert!(d < against_f32, "{lower:?} vs f32: {d}");
            }
        }
        per_policy.push(drift);
    }
    // The cache holds region values of the last run's precision: 6 positions, 2 heads.
    let (k, _) = m.blocks[0].attn.kv_cache.as_ref().expect("filled");
    assert_eq!((k.dims(), k.dtype()), (&[1, 2, 6, 4][..], DType::BF16));
    // Outside any region the model is a plain f32 program, called directly.
    m.clear_kv_cache();
    let ids = candle_core::Tensor::new(&[[1u32, 5]], &Device::Cpu)?;
    assert_eq!(m.forward(&ids, 0)?.dtype(), DType::F32);
    Ok(())
}
