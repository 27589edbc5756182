//! A GPT-2-style decoder written as candle-transformers writes one (`gpt2`/`bigcode`): token and
//! learned position embeddings, pre-norm blocks, multi-head causal self-attention split into
//! helper methods (in training one op over the packed projection,
//! `ops::scaled_dot_product_attention_packed`, flash attention's `qkvpacked` form; with the KV
//! cache the heads as views of it and `ops::scaled_dot_product_attention`), a GELU MLP (its first
//! layer and the GELU one op, `nn::LinearAct`), a final
//! norm and an LM head tied to the token embeddings, and a KV cache held in each attention layer
//! as `Option<(AmpTensor, AmpTensor)>`.
//!
//! Ported from candle code by adding `#[autocast]` to the impls and writing `Tensor<F32>` for
//! activations (`candle_core::Tensor` stays for token ids and masks). The model runs in whatever
//! precision the calling region asks for: f32 called directly, fp16 or bf16 from
//! `#[autocast(fp16)]`/`#[autocast(bf16)]` training steps.
//!
//! Shared by `examples/gpt.rs` and its test (`tests/gpt.rs`), which use different parts.
#![allow(dead_code)]

use std::cell::Cell;

use candle_amp::nn::{self, Dropout, Embedding, LayerNorm, Linear};
use candle_amp::{autocast, loss, ops, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, IndexOp, Result};
use candle_nn::VarBuilder;

#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab_size: usize,
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub dropout: f32,
    pub layer_norm_epsilon: f64,
}

impl Config {
    /// The default of `examples/gpt.rs`.
    pub fn small(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            n_positions: 64,
            n_embd: 64,
            n_layer: 2,
            n_head: 4,
            dropout: 0.0,
            layer_norm_epsilon: 1e-5,
        }
    }
}

pub struct Attention {
    c_attn: Linear,
    c_proj: Linear,
    n_head: usize,
    kv_cache: Option<(AmpTensor, AmpTensor)>,
    use_cache: bool,
    /// The dtype the last call's attention ran in (for the dtype test).
    pub last_dtype: Cell<Option<DType>>,
}

#[autocast]
impl Attention {
    fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            c_attn: nn::linear(cfg.n_embd, 3 * cfg.n_embd, vb.pp("c_attn"))?,
            c_proj: nn::linear(cfg.n_embd, cfg.n_embd, vb.pp("c_proj"))?,
            n_head: cfg.n_head,
            kv_cache: None,
            use_cache: false,
            last_dtype: Cell::new(None),
        })
    }

    /// The attention of queries `(b, heads, t, d)` over keys and values `(b, heads, past + t,
    /// d)`, causal when `causal` (query `i` sees keys up to `past + i`), as `(b, t, heads, d)`:
    /// one op, whose products run in the region's half dtype and whose softmax runs in f32.
    fn attn(&self, q: &AmpTensor, k: &AmpTensor, v: &AmpTensor, causal: bool) -> Result<AmpTensor> {
        let y = ops::scaled_dot_product_attention(q, k, v, None, None, causal)?;
        y.transpose(1, 2)
    }

    fn forward(&mut self, x: &Tensor<F32>, causal: bool) -> Result<Tensor<F32>> {
        let (b, t, c) = x.dims3()?;
        // `(b, t, 3, heads, d)`: the queries, keys and values of every head, packed.
        let qkv = self
            .c_attn
            .forward(x)?
            .reshape((b, t, 3, self.n_head, c / self.n_head))?;
        let y = if self.use_cache {
            self.cached(&qkv, causal)?
        } else {
            // Without a cache, one op reads the packed projection in place and writes
            // `(b, t, heads, d)`: no split into heads or merge back in the graph.
            let options = ops::Attention {
                causal,
                ..Default::default()
            };
            ops::scaled_dot_product_attention_packed(&qkv, &options)?
        };
        self.last_dtype.set(Some(y.dtype()));
        self.c_proj.forward(&y.reshape((b, t, c))?)
    }

    /// Attention with the KV cache: the heads of `qkv` as `(b, heads, t, d)` views, the keys
    /// and values appended to the cache's.
    fn cached(&mut self, qkv: &AmpTensor, causal: bool) -> Result<AmpTensor> {
        let head = |i: usize| qkv.i((.., .., i))?.transpose(1, 2);
        let (q, k, v) = (head(0)?, head(1)?, head(2)?);
        let (k, v) = match &self.kv_cache {
            Some((past_k, past_v)) => (
                Tensor::cat(&[past_k, &k], 2)?,
                Tensor::cat(&[past_v, &v], 2)?,
            ),
            None => (k, v),
        };
        self.kv_cache = Some((k.clone(), v.clone()));
        self.attn(&q, &k, &v, causal)
    }
}

pub struct Mlp {
    /// The first layer and its GELU as one op (`nn::LinearAct`).
    c_fc: nn::LinearAct,
    c_proj: Linear,
}

#[autocast]
impl Mlp {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        self.c_proj.forward(&self.c_fc.forward(x)?)
    }
}

pub struct Block {
    ln_1: LayerNorm,
    pub attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
    dropout: Dropout,
}

#[autocast]
impl Block {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            ln_1: nn::layer_norm(cfg.n_embd, cfg.layer_norm_epsilon, vb.pp("ln_1"))?,
            attn: Attention::new(cfg, vb.pp("attn"))?,
            ln_2: nn::layer_norm(cfg.n_embd, cfg.layer_norm_epsilon, vb.pp("ln_2"))?,
            mlp: Mlp {
                c_fc: nn::LinearAct::new(
                    nn::linear(cfg.n_embd, 4 * cfg.n_embd, vb.pp("mlp.c_fc"))?,
                    nn::Activation::NewGelu,
                )?,
                c_proj: nn::linear(4 * cfg.n_embd, cfg.n_embd, vb.pp("mlp.c_proj"))?,
            },
            dropout: Dropout::new(cfg.dropout),
        })
    }

    pub fn forward(&mut self, x: &Tensor<F32>, causal: bool, train: bool) -> Result<Tensor<F32>> {
        let a = self.attn.forward(&self.ln_1.forward(x)?, causal)?;
        let x = (x + self.dropout.forward(&a, train)?)?;
        let m = self.mlp.forward(&self.ln_2.forward(&x)?)?;
        Ok((&x + self.dropout.forward(&m, train)?)?)
    }
}

pub struct Gpt {
    wte: Embedding,
    wpe: Embedding,
    pub blocks: Vec<Block>,
    ln_f: LayerNorm,
    dropout: Dropout,
}

#[autocast]
impl Gpt {
    pub fn new(cfg: &Config, vb: VarBuilder) -> Result<Self> {
        let blocks = (0..cfg.n_layer)
            .map(|i| Block::new(cfg, vb.pp(format!("h.{i}"))))
            .collect::<Result<_>>()?;
        Ok(Self {
            wte: nn::embedding(cfg.vocab_size, cfg.n_embd, vb.pp("wte"))?,
            wpe: nn::embedding(cfg.n_positions, cfg.n_embd, vb.pp("wpe"))?,
            blocks,
            ln_f: nn::layer_norm(cfg.n_embd, cfg.layer_norm_epsilon, vb.pp("ln_f"))?,
            dropout: Dropout::new(cfg.dropout),
        })
    }

    /// Logits `(b, t, vocab)` for token ids `(b, t)` at positions `past..past + t` (`past`: the
    /// length already in the KV cache, 0 without one).
    pub fn forward(
        &mut self,
        ids: &candle_core::Tensor,
        past: usize,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let (_b, t) = ids.dims2()?;
        let positions = candle_core::Tensor::arange(past as u32, (past + t) as u32, ids.device())?;
        let x = self
            .wte
            .forward(ids)?
            .broadcast_add(&self.wpe.forward(&positions)?)?;
        let mut h = self.dropout.forward(&x, train)?;
        // Causal attention, the mask aligned to the cache's end: query `i` (at position
        // `past + i`) sees keys `0..=past + i`.
        for block in &mut self.blocks {
            h = block.forward(&h, t > 1, train)?;
        }
        let h = self.ln_f.forward(&h)?;
        // The LM head is the token embedding, transposed (weight tying, as GPT-2).
        let (b, t, c) = h.dims3()?;
        let w = self.wte.embeddings().as_tensor();
        Ok(h.reshape((b * t, c))?
            .matmul(&w.t()?)?
            .reshape((b, t, ()))?)
    }

    pub fn set_use_cache(&mut self, on: bool) {
        for b in &mut self.blocks {
            b.attn.use_cache = on;
            b.attn.kv_cache = None;
        }
    }
}

impl Gpt {
    /// The device the weights live on (inputs are made there).
    pub fn device(&self) -> Device {
        self.wte.embeddings().device().clone()
    }
}

/// Next-token cross-entropy of `ids` `(b, t + 1)`.
fn next_token_loss(m: &mut Gpt, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    let t = ids.dim(1)? - 1;
    let logits = m.forward(&ids.narrow(1, 0, t)?, 0, true)?;
    let (b, t, v) = logits.dims3()?;
    loss::cross_entropy(
        &logits.reshape((b * t, v))?,
        &ids.narrow(1, 1, t)?.flatten_all()?,
    )
}

/// The training loss under each precision: f32 (the model called from plain code), and the
/// same model from an fp16 and a bf16 region.
pub fn loss_f32(m: &mut Gpt, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    next_token_loss(m, ids)
}

#[autocast(fp16)]
pub fn loss_fp16(m: &mut Gpt, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    next_token_loss(m, ids)
}

#[autocast(bf16)]
pub fn loss_bf16(m: &mut Gpt, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    next_token_loss(m, ids)
}

/// Greedy generation of `n` tokens after `prompt` with the KV cache: the prompt in one call,
/// then one token per call. Returns the tokens and the last-position logits of each call.
pub fn generate(m: &mut Gpt, prompt: &[u32], n: usize) -> Result<(Vec<u32>, Vec<Vec<f32>>)> {
    let dev = m.device();
    m.set_use_cache(true);
    let (mut tokens, mut logits_seen) = (prompt.to_vec(), Vec::new());
    let mut input = prompt.to_vec();
    for _ in 0..n {
        let past = tokens.len() - input.len();
        let ids = candle_core::Tensor::new(input.as_slice(), &dev)?.unsqueeze(0)?;
        let logits = m.forward(&ids, past, false)?;
        let last: Vec<f32> = logits.as_candle().i((0, input.len() - 1))?.to_vec1()?;
        let next = argmax(&last);
        logits_seen.push(last);
        tokens.push(next);
        input = vec![next];
    }
    m.set_use_cache(false);
    Ok((tokens, logits_seen))
}

/// The last-position logits of each prefix of `tokens` of length `from..=tokens.len()`, each by
/// a full forward without the cache: what [`generate`]'s cached calls must reproduce (given the
/// generated tokens less the last, which was never an input).
pub fn recomputed(m: &mut Gpt, tokens: &[u32], from: usize) -> Result<Vec<Vec<f32>>> {
    let dev = m.device();
    m.set_use_cache(false);
    (from..=tokens.len())
        .map(|n| {
            let ids = candle_core::Tensor::new(&tokens[..n], &dev)?.unsqueeze(0)?;
            m.forward(&ids, 0, false)?
                .as_candle()
                .i((0, n - 1))?
                .to_vec1()
        })
        .collect()
}

fn argmax(v: &[f32]) -> u32 {
    v.iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |(i, _)| i as u32)
}

/// The largest absolute difference between two lists of logits of the same shape.
pub fn max_abs_diff(a: &[Vec<f32>], b: &[Vec<f32>]) -> f32 {
    assert_eq!(a.len(), b.len(), "as many logits on both sides");
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}
