//! A Llama-style decoder written as candle-transformers' `llama.rs` writes it: candle's
//! `Tensor` everywhere, candle-nn's layers (`RmsNorm`, `Embedding`, bias-free `Linear`),
//! rotary embeddings by `candle_nn::rotary_emb::rope` from f32 tables in the cache, SwiGLU
//! (`candle_nn::ops::silu`), grouped-query attention with a KV cache (`Tensor::cat` onto the
//! cached keys and values, then `repeat_kv`), a `u8` causal mask with `masked_fill` and
//! `softmax_last_dim` on the explicit path, a fused-attention path where upstream calls
//! `candle_flash_attn::flash_attn`, and an LM head tied to the embeddings or not.
//!
//! Ported to mixed precision by the `#[autocast]` lines and the `use candle_amp::{autocast,
//! ops};` line; the one other change is the body of `flash_attn`, which calls candle-amp's
//! attention op where upstream calls the flash-attention crate (same `(b, t, heads, d)`
//! arguments). In a region every op runs in its class: the projections and both attention
//! products in the half dtype, the norms, the softmax and the loss in f32, rope, the cache's
//! concat and the head repeat in the dtype they are given (rope's tables read in f32). Upstream
//! returns the last position's logits only; training needs all of them, which `logits` gives
//! (`forward` is upstream's, on top of it).
//!
//! Shared by `examples/llama.rs` and its test (`tests/llama.rs`), which use different parts.
#![allow(dead_code)]

use std::collections::HashMap;

use candle_amp::{autocast, ops};
use candle_core::{DType, Device, IndexOp, Result, Tensor};
use candle_nn::{embedding, Embedding, Linear, Module, RmsNorm, VarBuilder};

#[derive(Debug, Clone)]
pub struct Config {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub use_flash_attn: bool,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
}

impl Config {
    /// The default of `examples/llama.rs`: 2 layers, 4 query heads sharing 2 key/value heads.
    pub fn tiny(vocab_size: usize) -> Self {
        Self {
            hidden_size: 64,
            intermediate_size: 172,
            vocab_size,
            num_hidden_layers: 2,
            num_attention_heads: 4,
            num_key_value_heads: 2,
            use_flash_attn: true,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            max_position_embeddings: 128,
            tie_word_embeddings: false,
        }
    }
}

#[derive(Debug, Clone)]
pub struct Cache {
    masks: HashMap<usize, Tensor>,
    pub use_kv_cache: bool,
    kvs: Vec<Option<(Tensor, Tensor)>>,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

fn calculate_default_inv_freq(cfg: &Config) -> Vec<f32> {
    let head_dim = cfg.hidden_size / cfg.num_attention_heads;
    (0..head_dim)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / head_dim as f32))
        .collect()
}

impl Cache {
    pub fn new(use_kv_cache: bool, dtype: DType, config: &Config, device: &Device) -> Result<Self> {
        // precompute freqs_cis
        let theta = calculate_default_inv_freq(config);
        let theta = Tensor::new(theta, device)?;
        let idx_theta = Tensor::arange(0, config.max_position_embeddings as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((config.max_position_embeddings, 1))?
            .matmul(&theta.reshape((1, theta.elem_count()))?)?;
        let cos = idx_theta.cos()?.to_dtype(dtype)?;
        let sin = idx_theta.sin()?.to_dtype(dtype)?;
        Ok(Self {
            masks: HashMap::new(),
            use_kv_cache,
            kvs: vec![None; config.num_hidden_layers],
            device: device.clone(),
            cos,
            sin,
        })
    }

    fn mask(&mut self, t: usize) -> Result<Tensor> {
        if let Some(mask) = self.masks.get(&t) {
            Ok(mask.clone())
        } else {
            let mask: Vec<_> = (0..t)
                .flat_map(|i| (0..t).map(move |j| u8::from(j > i)))
                .collect();
            let mask = Tensor::from_slice(&mask, (t, t), &self.device)?;
            self.masks.insert(t, mask.clone());
            Ok(mask)
        }
    }
}

#[autocast]
fn flash_attn(
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    softmax_scale: f32,
    causal: bool,
) -> Result<Tensor> {
    // candle_flash_attn's arguments, `(b, t, heads, d)`, on candle-amp's attention op.
    let (q, k, v) = (q.transpose(1, 2)?, k.transpose(1, 2)?, v.transpose(1, 2)?);
    let scale = Some(f64::from(softmax_scale));
    ops::scaled_dot_product_attention(&q, &k, &v, None, scale, causal)?.transpose(1, 2)
}

#[autocast]
fn masked_fill(on_false: &Tensor, mask: &Tensor, on_true: f32) -> Result<Tensor> {
    let shape = mask.shape();
    let on_true = Tensor::new(on_true, on_false.device())?.broadcast_as(shape.dims())?;
    let m = mask.where_cond(&on_true, on_false)?;
    Ok(m)
}

#[autocast]
pub fn repeat_kv(xs: Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        Ok(xs)
    } else {
        let (b_sz, n_kv_head, seq_len, head_dim) = xs.dims4()?;
        // Using cat is faster than a broadcast as it avoids going through a potentially
        // strided copy.
        Tensor::cat(&vec![&xs; n_rep], 2)?.reshape((b_sz, n_kv_head * n_rep, seq_len, head_dim))
    }
}

#[derive(Debug, Clone)]
struct CausalSelfAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    use_flash_attn: bool,
}

#[autocast]
impl CausalSelfAttention {
    fn apply_rotary_emb(&self, x: &Tensor, index_pos: usize, cache: &Cache) -> Result<Tensor> {
        let (_b_sz, _, seq_len, _hidden_size) = x.dims4()?;
        let cos = cache.cos.narrow(0, index_pos, seq_len)?;
        let sin = cache.sin.narrow(0, index_pos, seq_len)?;
        candle_nn::rotary_emb::rope(x, &cos, &sin)
    }

    fn forward(
        &self,
        x: &Tensor,
        index_pos: usize,
        block_idx: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let (b_sz, seq_len, hidden_size) = x.dims3()?;
        let q = self.q_proj.forward(x)?;
        let k = self.k_proj.forward(x)?;
        let v = self.v_proj.forward(x)?;

        let q = q
            .reshape((b_sz, seq_len, self.num_attention_heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let k = k
            .reshape((b_sz, seq_len, self.num_key_value_heads, self.head_dim))?
            .transpose(1, 2)?
            .contiguous()?;
        let mut v = v
            .reshape((b_sz, seq_len, self.num_key_value_heads, self.head_dim))?
            .transpose(1, 2)?;

        let q = self.apply_rotary_emb(&q, index_pos, cache)?;
        let mut k = self.apply_rotary_emb(&k, index_pos, cache)?;

        if cache.use_kv_cache {
            if let Some((cache_k, cache_v)) = &cache.kvs[block_idx] {
                k = Tensor::cat(&[cache_k, &k], 2)?.contiguous()?;
                v = Tensor::cat(&[cache_v, &v], 2)?.contiguous()?;
            }
            cache.kvs[block_idx] = Some((k.clone(), v.clone()))
        }

        let k = self.repeat_kv(k)?;
        let v = self.repeat_kv(v)?;

        let y = if self.use_flash_attn {
            // flash-attn expects (b_sz, seq_len, nheads, head_dim)
            let q = q.transpose(1, 2)?;
            let k = k.transpose(1, 2)?;
            let v = v.transpose(1, 2)?;
            let softmax_scale = 1f32 / (self.head_dim as f32).sqrt();
            flash_attn(&q, &k, &v, softmax_scale, seq_len > 1)?.transpose(1, 2)?
        } else {
            let in_dtype = q.dtype();
            let q = q.to_dtype(DType::F32)?;
            let k = k.to_dtype(DType::F32)?;
            let v = v.to_dtype(DType::F32)?;
            let att = (q.matmul(&k.t()?)? / (self.head_dim as f64).sqrt())?;
            let att = if seq_len == 1 {
                att
            } else {
                let mask = cache.mask(seq_len)?.broadcast_as(att.shape())?;
                masked_fill(&att, &mask, f32::NEG_INFINITY)?
            };
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            // Convert to contiguous as matmul doesn't support strided vs for now.
            att.matmul(&v.contiguous()?)?.to_dtype(in_dtype)?
        };
        let y = y.transpose(1, 2)?.reshape(&[b_sz, seq_len, hidden_size])?;
        let y = self.o_proj.forward(&y)?;
        Ok(y)
    }

    fn repeat_kv(&self, x: Tensor) -> Result<Tensor> {
        repeat_kv(x, self.num_attention_heads / self.num_key_value_heads)
    }

    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let size_in = cfg.hidden_size;
        let size_q = (cfg.hidden_size / cfg.num_attention_heads) * cfg.num_attention_heads;
        let size_kv = (cfg.hidden_size / cfg.num_attention_heads) * cfg.num_key_value_heads;
        let q_proj = candle_nn::linear_no_bias(size_in, size_q, vb.pp("q_proj"))?;
        let k_proj = candle_nn::linear_no_bias(size_in, size_kv, vb.pp("k_proj"))?;
        let v_proj = candle_nn::linear_no_bias(size_in, size_kv, vb.pp("v_proj"))?;
        let o_proj = candle_nn::linear_no_bias(size_q, size_in, vb.pp("o_proj"))?;
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            num_attention_heads: cfg.num_attention_heads,
            num_key_value_heads: cfg.num_key_value_heads,
            head_dim: cfg.hidden_size / cfg.num_attention_heads,
            use_flash_attn: cfg.use_flash_attn,
        })
    }
}

#[derive(Debug, Clone)]
struct Mlp {
    c_fc1: Linear,
    c_fc2: Linear,
    c_proj: Linear,
}

#[autocast]
impl Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = (candle_nn::ops::silu(&self.c_fc1.forward(x)?)? * self.c_fc2.forward(x)?)?;
        self.c_proj.forward(&x)
    }

    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let h_size = cfg.hidden_size;
        let i_size = cfg.intermediate_size;
        let c_fc1 = candle_nn::linear_no_bias(h_size, i_size, vb.pp("gate_proj"))?;
        let c_fc2 = candle_nn::linear_no_bias(h_size, i_size, vb.pp("up_proj"))?;
        let c_proj = candle_nn::linear_no_bias(i_size, h_size, vb.pp("down_proj"))?;
        Ok(Self {
            c_fc1,
            c_fc2,
            c_proj,
        })
    }
}

#[derive(Debug, Clone)]
struct Block {
    rms_1: RmsNorm,
    attn: CausalSelfAttention,
    rms_2: RmsNorm,
    mlp: Mlp,
}

#[autocast]
impl Block {
    fn forward(
        &self,
        x: &Tensor,
        index_pos: usize,
        block_idx: usize,
        cache: &mut Cache,
    ) -> Result<Tensor> {
        let residual = x;
        let x = self.rms_1.forward(x)?;
        let x = (self.attn.forward(&x, index_pos, block_idx, cache)? + residual)?;
        let residual = &x;
        let x = (self.mlp.forward(&self.rms_2.forward(&x)?)? + residual)?;
        Ok(x)
    }

    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let attn = CausalSelfAttention::load(vb.pp("self_attn"), cfg)?;
        let mlp = Mlp::load(vb.pp("mlp"), cfg)?;
        let rms_1 =
            candle_nn::rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("input_layernorm"))?;
        let rms_2 = candle_nn::rms_norm(
            cfg.hidden_size,
            cfg.rms_norm_eps,
            vb.pp("post_attention_layernorm"),
        )?;
        Ok(Self {
            rms_1,
            attn,
            rms_2,
            mlp,
        })
    }
}

#[derive(Debug, Clone)]
pub struct Llama {
    wte: Embedding,
    blocks: Vec<Block>,
    ln_f: RmsNorm,
    lm_head: Linear,
}

#[autocast]
impl Llama {
    /// The logits of every position `(b, t, vocab)`, in f32.
    pub fn logits(&self, x: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let mut x = self.wte.forward(x)?;
        for (block_idx, block) in self.blocks.iter().enumerate() {
            x = block.forward(&x, index_pos, block_idx, cache)?;
        }
        let x = self.ln_f.forward(&x)?;
        let logits = self.lm_head.forward(&x)?;
        logits.to_dtype(DType::F32)
    }

    pub fn forward(&self, x: &Tensor, index_pos: usize, cache: &mut Cache) -> Result<Tensor> {
        let (_b_sz, seq_len) = x.dims2()?;
        let logits = self.logits(x, index_pos, cache)?;
        logits.i((.., seq_len - 1, ..))?.contiguous()
    }

    pub fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let wte = embedding(cfg.vocab_size, cfg.hidden_size, vb.pp("model.embed_tokens"))?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(wte.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(cfg.hidden_size, cfg.vocab_size, vb.pp("lm_head"))?
        };
        let ln_f = candle_nn::rms_norm(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("model.norm"))?;
        let blocks: Vec<_> = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(vb.pp(format!("model.layers.{i}")), cfg))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            wte,
            blocks,
            ln_f,
            lm_head,
        })
    }
}

/// Next-token cross-entropy of `ids` `(b, t + 1)`.
#[autocast]
fn next_token_loss(m: &Llama, cache: &mut Cache, ids: &Tensor) -> Result<Tensor> {
    let t = ids.dim(1)? - 1;
    let logits = m.logits(&ids.narrow(1, 0, t)?, 0, cache)?;
    let (b, t, v) = logits.dims3()?;
    candle_nn::loss::cross_entropy(
        &logits.reshape((b * t, v))?,
        &ids.narrow(1, 1, t)?.flatten_all()?,
    )
}

/// The training loss under each precision: f32 (the model called from plain code), and the
/// same model from an fp16 and a bf16 region.
pub fn loss_f32(m: &Llama, cache: &mut Cache, ids: &Tensor) -> Result<Tensor> {
    next_token_loss(m, cache, ids)
}

#[autocast(fp16)]
pub fn loss_fp16(m: &Llama, cache: &mut Cache, ids: &Tensor) -> Result<Tensor> {
    next_token_loss(m, cache, ids)
}

#[autocast(bf16)]
pub fn loss_bf16(m: &Llama, cache: &mut Cache, ids: &Tensor) -> Result<Tensor> {
    next_token_loss(m, cache, ids)
}

/// Greedy generation of `n` tokens after `prompt` with the KV cache (`cache` must have it on
/// and be empty): the prompt in one call, then one token per call. Returns the tokens and the
/// last-position logits of each call.
fn generate(
    m: &Llama,
    cache: &mut Cache,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let (mut tokens, mut seen) = (prompt.to_vec(), Vec::new());
    let mut input = prompt.to_vec();
    for _ in 0..n {
        let index_pos = tokens.len() - input.len();
        let ids = Tensor::new(input.as_slice(), &cache.device)?.unsqueeze(0)?;
        let last: Vec<f32> = m.forward(&ids, index_pos, cache)?.squeeze(0)?.to_vec1()?;
        let next = last
            .iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .map_or(0, |(i, _)| i as u32);
        seen.push(last);
        tokens.push(next);
        input = vec![next];
    }
    Ok((tokens, seen))
}

/// The last-position logits of each prefix of `tokens` of length `from..=tokens.len()`, each by
/// a full forward without the KV cache: what [`generate`]'s cached calls must reproduce.
fn recomputed(m: &Llama, cache: &mut Cache, tokens: &[u32], from: usize) -> Result<Vec<Vec<f32>>> {
    (from..=tokens.len())
        .map(|n| {
            let ids = Tensor::new(&tokens[..n], &cache.device)?.unsqueeze(0)?;
            m.forward(&ids, 0, cache)?.squeeze(0)?.to_vec1()
        })
        .collect()
}

/// Greedy generation of `n` tokens after `prompt` with the KV cache, and the largest difference
/// of its logits from full recomputes of the same prefixes without it.
pub fn generate_checked(
    m: &Llama,
    cfg: &Config,
    dev: &Device,
    prompt: &[u32],
    n: usize,
) -> Result<(Vec<u32>, f32)> {
    let mut cache = Cache::new(true, DType::F32, cfg, dev)?;
    let (tokens, cached) = generate(m, &mut cache, prompt, n)?;
    let mut no_cache = Cache::new(false, DType::F32, cfg, dev)?;
    let full = recomputed(m, &mut no_cache, &tokens[..tokens.len() - 1], prompt.len())?;
    assert_eq!(full.len(), cached.len(), "a recompute per cached call");
    let diff = cached
        .iter()
        .flatten()
        .zip(full.iter().flatten())
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    Ok((tokens, diff))
}
