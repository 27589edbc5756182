//! A GPT-BigCode-style decoder written as candle-transformers writes its models (candle's
//! `Tensor` everywhere, candle-nn's layers, multi-query attention with a KV cache in a
//! `&mut self` forward, a `u8` causal mask, `where_cond` with a `-inf` fill,
//! `candle_nn::ops::softmax_last_dim`, `Tensor::cat`), ported to mixed precision by the
//! `#[autocast]` lines and the `use candle_amp::autocast;` line only.
use candle::{DType, Device, IndexOp, Result, Tensor, D};
use candle_amp::autocast;
use candle_nn::{embedding, Embedding, LayerNorm, Linear, Module, VarBuilder};

fn linear(size1: usize, size2: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    let weight = vb.get_with_hints(
        (size2, size1),
        "weight",
        candle_nn::init::DEFAULT_KAIMING_NORMAL,
    )?;
    let bias = if bias {
        Some(vb.get_with_hints(size2, "bias", candle_nn::Init::Const(0.))?)
    } else {
        None
    };
    Ok(Linear::new(weight, bias))
}

fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
    let weight = vb.get_with_hints(size, "weight", candle_nn::Init::Const(1.))?;
    let bias = vb.get_with_hints(size, "bias", candle_nn::Init::Const(0.))?;
    Ok(LayerNorm::new(weight, bias, eps))
}

fn causal_mask(t: usize, device: &Device) -> Result<Tensor> {
    let mask: Vec<u8> = (0..t)
        .flat_map(|i| (0..t).map(move |j| u8::from(j <= i)))
        .collect();
    Tensor::from_slice(&mask, (t, t), device)
}

#[derive(Debug, Clone)]
pub struct Config {
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub num_hidden_layers: usize,
    pub hidden_size: usize,
    pub layer_norm_epsilon: f64,
    pub n_inner: Option<usize>,
    pub num_attention_heads: usize,
    pub multi_query: bool,
    pub use_cache: bool,
}

struct Attention {
    c_attn: Linear,
    c_proj: Linear,
    kv_cache: Option<Tensor>,
    use_cache: bool,
    embed_dim: usize,
    kv_dim: usize,
    num_heads: usize,
    head_dim: usize,
}

#[autocast]
impl Attention {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let head_dim = cfg.hidden_size / cfg.num_attention_heads;
        let kv_heads = if cfg.multi_query {
            1
        } else {
            cfg.num_attention_heads
        };
        let kv_dim = kv_heads * head_dim;
        let c_attn = linear(
            cfg.hidden_size,
            cfg.hidden_size + 2 * kv_dim,
            true,
            vb.pp("c_attn"),
        )?;
        let c_proj = linear(cfg.hidden_size, cfg.hidden_size, true, vb.pp("c_proj"))?;
        Ok(Self {
            c_attn,
            c_proj,
            kv_cache: None,
            use_cache: cfg.use_cache,
            embed_dim: cfg.hidden_size,
            kv_dim,
            num_heads: cfg.num_attention_heads,
            head_dim,
        })
    }

    /// Multi-query attention: every head of `query` `(b, t, embed)` against the one key
    /// `(b, head_dim, s)` and value `(b, s, head_dim)`.
    fn attn(&self, query: &Tensor, key: &Tensor, value: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let scale = 1f64 / (self.head_dim as f64).sqrt();
        let query_shape = query.shape();
        let key_len = key.dim(D::Minus1)?;
        let (b_sz, query_len, _) = query.dims3()?;
        let query = query.reshape((b_sz, query_len * self.num_heads, self.head_dim))?;
        let attn_shape = (b_sz, query_len, self.num_heads, key_len);
        let attn_view = (b_sz, query_len * self.num_heads, key_len);
        let weights = (query.matmul(&key.contiguous()?)? * scale)?.reshape(attn_shape)?;
        let mask = mask.broadcast_as(attn_shape)?;
        let fill = Tensor::new(f32::NEG_INFINITY, query.device())?.broadcast_as(attn_shape)?;
        let weights = mask.where_cond(&weights, &fill)?;
        let weights = candle_nn::ops::softmax_last_dim(&weights)?;
        let value = value.contiguous()?;
        weights
            .reshape(attn_view)?
            .matmul(&value)?
            .reshape(query_shape)
    }

    fn forward(&mut self, hidden_states: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let qkv = self.c_attn.forward(hidden_states)?;
        let query = qkv.i((.., .., ..self.embed_dim))?;
        let mut key_value = qkv.i((.., .., self.embed_dim..self.embed_dim + 2 * self.kv_dim))?;
        if self.use_cache {
            if let Some(kv_cache) = &self.kv_cache {
                key_value = Tensor::cat(&[kv_cache, &key_value], D::Minus2)?.contiguous()?;
            }
            self.kv_cache = Some(key_value.clone())
        }
        let key = key_value.narrow(D::Minus1, 0, self.head_dim)?;
        let value = key_value.narrow(D::Minus1, self.head_dim, self.head_dim)?;
        let attn_output = self.attn(&query, &key.t()?, &value, mask)?;
        self.c_proj.forward(&attn_output)
    }
}

struct Mlp {
    c_fc: Linear,
    c_proj: Linear,
}

#[autocast]
impl Mlp {
    fn load(inner_dim: usize, vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let c_fc = linear(cfg.hidden_size, inner_dim, true, vb.pp("c_fc"))?;
        let c_proj = linear(inner_dim, cfg.hidden_size, true, vb.pp("c_proj"))?;
        Ok(Self { c_fc, c_proj })
    }

    fn forward(&mut self, hidden_states: &Tensor) -> Result<Tensor> {
        let hidden_states = self.c_fc.forward(hidden_states)?.gelu()?;
        self.c_proj.forward(&hidden_states)
    }
}

struct Block {
    ln_1: LayerNorm,
    attn: Attention,
    ln_2: LayerNorm,
    mlp: Mlp,
}

#[autocast]
impl Block {
    fn load(vb: VarBuilder, cfg: &Config) -> Result<Self> {
        let inner_dim = cfg.n_inner.unwrap_or(4 * cfg.hidden_size);
        Ok(Self {
            ln_1: layer_norm(cfg.hidden_size, cfg.layer_norm_epsilon, vb.pp("ln_1"))?,
            attn: Attention::load(vb.pp("attn"), cfg)?,
            ln_2: layer_norm(cfg.hidden_size, cfg.layer_norm_epsilon, vb.pp("ln_2"))?,
            mlp: Mlp::load(inner_dim, vb.pp("mlp"), cfg)?,
        })
    }

    fn forward(&mut self, hidden_states: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let residual = hidden_states;
        let hidden_states = self.ln_1.forward(hidden_states)?;
        let attn_outputs = self.attn.forward(&hidden_states, mask)?;
        let hidden_states = (&attn_outputs + residual)?;
        let residual = &hidden_states;
        let hidden_states = self.ln_2.forward(&hidden_states)?;
        let hidden_states = self.mlp.forward(&hidden_states)?;
        &hidden_states + residual
    }
}

pub struct Decoder {
    wte: Embedding,
    wpe: Embedding,
    blocks: Vec<Block>,
    ln_f: LayerNorm,
    lm_head: Linear,
    bias: Tensor,
    config: Config,
}

#[autocast]
impl Decoder {
    pub fn load(vb: VarBuilder, cfg: Config) -> Result<Self> {
        let vb_t = vb.pp("transformer");
        let wte = embedding(cfg.vocab_size, cfg.hidden_size, vb_t.pp("wte"))?;
        let wpe = embedding(cfg.max_position_embeddings, cfg.hidden_size, vb_t.pp("wpe"))?;
        let blocks = (0..cfg.num_hidden_layers)
            .map(|i| Block::load(vb_t.pp(format!("h.{i}")), &cfg))
            .collect::<Result<Vec<_>>>()?;
        let ln_f = layer_norm(cfg.hidden_size, cfg.layer_norm_epsilon, vb_t.pp("ln_f"))?;
        let lm_head = linear(cfg.hidden_size, cfg.vocab_size, false, vb_t.pp("lm_head"))?;
        let bias = causal_mask(cfg.max_position_embeddings, vb.device())?;
        Ok(Self {
            wte,
            wpe,
            blocks,
            ln_f,
            lm_head,
            bias,
            config: cfg,
        })
    }

    /// Logits `(b, t, vocab)` for token ids `(b, t)` at positions `past_len..`.
    pub fn forward(&mut self, input_ids: &Tensor, past_len: usize) -> Result<Tensor> {
        let dev = input_ids.device();
        let (b_sz, seq_len) = input_ids.dims2()?;
        let key_len = past_len + seq_len;
        let mask = self.bias.i((past_len..key_len, ..key_len))?.unsqueeze(0)?;
        let mask = mask.unsqueeze(2)?;
        let position_ids = Tensor::arange(past_len as u32, key_len as u32, dev)?;
        let position_ids = position_ids.unsqueeze(0)?.broadcast_as((b_sz, seq_len))?;
        let input_embeds = self.wte.forward(input_ids)?;
        let position_embeds = self.wpe.forward(&position_ids)?;
        let mut hidden_states = (&input_embeds + &position_embeds)?;
        for block in self.blocks.iter_mut() {
            hidden_states = block.forward(&hidden_states, &mask)?;
        }
        let hidden_states = self.ln_f.forward(&hidden_states)?;
        let hidden_states = hidden_states.reshape((b_sz, seq_len, self.config.hidden_size))?;
        self.lm_head.forward(&hidden_states)
    }

    pub fn clear_cache(&mut self) {
        for block in self.blocks.iter_mut() {
            block.attn.kv_cache = None
        }
    }

    pub fn dtype(&self) -> DType {
        DType::F32
    }
}
