//! A BERT-style encoder written as candle-transformers writes its models: layers behind
//! `tracing` wrappers that implement candle-nn's `Module`, a `Dropout` of its own, an activation
//! enum, attention heads split by a helper method, an additive mask made from an optional
//! candle tensor by a plain helper fn, `candle_nn::ops::softmax`; ported to mixed precision by
//! the `#[autocast]` lines and the `use candle_amp::autocast;` line only.
use candle::{DType, Module, Result, Tensor};
use candle_amp::autocast;
use candle_nn::{Embedding, VarBuilder};

/// candle-transformers' `with_tracing` wrappers: a span per layer.
pub mod with_tracing {
    use super::*;

    pub struct Linear {
        inner: candle_nn::Linear,
        span: tracing::Span,
    }

    pub fn linear(d1: usize, d2: usize, vb: VarBuilder) -> Result<Linear> {
        let inner = candle_nn::linear(d1, d2, vb)?;
        let span = tracing::span!(tracing::Level::TRACE, "linear");
        Ok(Linear { inner, span })
    }

    #[autocast]
    impl Module for Linear {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let _enter = self.span.enter();
            self.inner.forward(xs)
        }
    }

    pub struct LayerNorm {
        inner: candle_nn::LayerNorm,
        span: tracing::Span,
    }

    pub fn layer_norm(size: usize, eps: f64, vb: VarBuilder) -> Result<LayerNorm> {
        let inner = candle_nn::layer_norm(size, eps, vb)?;
        let span = tracing::span!(tracing::Level::TRACE, "layer-norm");
        Ok(LayerNorm { inner, span })
    }

    #[autocast]
    impl Module for LayerNorm {
        fn forward(&self, xs: &Tensor) -> Result<Tensor> {
            let _enter = self.span.enter();
            self.inner.forward(xs)
        }
    }
}

use with_tracing::{layer_norm, linear, LayerNorm, Linear};

#[derive(Clone, Copy, Debug)]
pub enum HiddenAct {
    Gelu,
    GeluApproximate,
    Relu,
}

struct HiddenActLayer {
    act: HiddenAct,
    span: tracing::Span,
}

#[autocast]
impl HiddenActLayer {
    fn new(act: HiddenAct) -> Self {
        let span = tracing::span!(tracing::Level::TRACE, "hidden-act");
        Self { act, span }
    }

    fn forward(&self, xs: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        match self.act {
            HiddenAct::Gelu => xs.gelu_erf(),
            HiddenAct::GeluApproximate => xs.gelu(),
            HiddenAct::Relu => xs.relu(),
        }
    }
}

/// Dropout as candle-transformers' BERT keeps it: the identity at inference.
struct Dropout {
    #[allow(dead_code)]
    pr: f64,
}

impl Dropout {
    fn new(pr: f64) -> Self {
        Self { pr }
    }
}

#[autocast]
impl Module for Dropout {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        Ok(x.clone())
    }
}

#[derive(Clone, Debug)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: HiddenAct,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub layer_norm_eps: f64,
    pub hidden_dropout_prob: f64,
}

struct Embeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
    dropout: Dropout,
    span: tracing::Span,
}

#[autocast]
impl Embeddings {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let embedding = |n, name| candle_nn::embedding(n, config.hidden_size, vb.pp(name));
        Ok(Self {
            word_embeddings: embedding(config.vocab_size, "word_embeddings")?,
            position_embeddings: embedding(config.max_position_embeddings, "position_embeddings")?,
            token_type_embeddings: embedding(config.type_vocab_size, "token_type_embeddings")?,
            layer_norm: layer_norm(
                config.hidden_size,
                config.layer_norm_eps,
                vb.pp("LayerNorm"),
            )?,
            dropout: Dropout::new(config.hidden_dropout_prob),
            span: tracing::span!(tracing::Level::TRACE, "embeddings"),
        })
    }

    fn forward(&self, input_ids: &Tensor, token_type_ids: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        let (_bsize, seq_len) = input_ids.dims2()?;
        let input_embeddings = self.word_embeddings.forward(input_ids)?;
        let token_type_embeddings = self.token_type_embeddings.forward(token_type_ids)?;
        let mut embeddings = (&input_embeddings + token_type_embeddings)?;
        let position_ids = (0..seq_len as u32).collect::<Vec<_>>();
        let position_ids = Tensor::new(&position_ids[..], input_ids.device())?;
        embeddings = embeddings.broadcast_add(&self.position_embeddings.forward(&position_ids)?)?;
        let embeddings = self.layer_norm.forward(&embeddings)?;
        self.dropout.forward(&embeddings)
    }
}

struct SelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    dropout: Dropout,
    num_attention_heads: usize,
    attention_head_size: usize,
    span: tracing::Span,
    span_softmax: tracing::Span,
}

#[autocast]
impl SelfAttention {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let attention_head_size = config.hidden_size / config.num_attention_heads;
        let all_head_size = config.num_attention_heads * attention_head_size;
        let hidden_size = config.hidden_size;
        Ok(Self {
            query: linear(hidden_size, all_head_size, vb.pp("query"))?,
            key: linear(hidden_size, all_head_size, vb.pp("key"))?,
            value: linear(hidden_size, all_head_size, vb.pp("value"))?,
            dropout: Dropout::new(config.hidden_dropout_prob),
            num_attention_heads: config.num_attention_heads,
            attention_head_size,
            span: tracing::span!(tracing::Level::TRACE, "self-attn"),
            span_softmax: tracing::span!(tracing::Level::TRACE, "softmax"),
        })
    }

    fn transpose_for_scores(&self, xs: &Tensor) -> Result<Tensor> {
        let mut new_x_shape = xs.dims().to_vec();
        new_x_shape.pop();
        new_x_shape.push(self.num_attention_heads);
        new_x_shape.push(self.attention_head_size);
        let xs = xs.reshape(new_x_shape.as_slice())?.transpose(1, 2)?;
        xs.contiguous()
    }

    fn forward(&self, hidden_states: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let _enter = self.span.enter();
        let query_layer = self.query.forward(hidden_states)?;
        let key_layer = self.key.forward(hidden_states)?;
        let value_layer = self.value.forward(hidden_states)?;

        let query_layer = self.transpose_for_scores(&query_layer)?;
        let key_layer = self.transpose_for_scores(&key_layer)?;
        let value_layer = self.transpose_for_scores(&value_layer)?;

        let attention_scores = query_layer.matmul(&key_layer.t()?)?;
        let attention_scores = (attention_scores / (self.attention_head_size as f64).sqrt())?;
        let attention_scores = attention_scores.broadcast_add(attention_mask)?;
        let attention_probs = {
            let _enter_sm = self.span_softmax.enter();
            candle_nn::ops::softmax(&attention_scores, candle::D::Minus1)?
        };
        let attention_probs = self.dropout.forward(&attention_probs)?;

        let context_layer = attention_probs.matmul(&value_layer)?;
        let context_layer = context_layer.transpose(1, 2)?.contiguous()?;
        context_layer.flatten_from(candle::D::Minus2)
    }
}

struct Layer {
    attention: SelfAttention,
    attention_output: Linear,
    attention_norm: LayerNorm,
    intermediate: Linear,
    act: HiddenActLayer,
    output: Linear,
    output_norm: LayerNorm,
    dropout: Dropout,
}

#[autocast]
impl Layer {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let (h, i, eps) = (
            config.hidden_size,
            config.intermediate_size,
            config.layer_norm_eps,
        );
        Ok(Self {
            attention: SelfAttention::load(vb.pp("attention.self"), config)?,
            attention_output: linear(h, h, vb.pp("attention.output.dense"))?,
            attention_norm: layer_norm(h, eps, vb.pp("attention.output.LayerNorm"))?,
            intermediate: linear(h, i, vb.pp("intermediate.dense"))?,
            act: HiddenActLayer::new(config.hidden_act),
            output: linear(i, h, vb.pp("output.dense"))?,
            output_norm: layer_norm(h, eps, vb.pp("output.LayerNorm"))?,
            dropout: Dropout::new(config.hidden_dropout_prob),
        })
    }

    fn forward(&self, hidden_states: &Tensor, attention_mask: &Tensor) -> Result<Tensor> {
        let attention = self.attention.forward(hidden_states, attention_mask)?;
        let attention = self
            .dropout
            .forward(&self.attention_output.forward(&attention)?)?;
        let attention = self.attention_norm.forward(&(attention + hidden_states)?)?;
        let intermediate = self.act.forward(&self.intermediate.forward(&attention)?)?;
        let output = self.dropout.forward(&self.output.forward(&intermediate)?)?;
        self.output_norm.forward(&(output + attention)?)
    }
}

/// `1` where a token is attended to, `0` elsewhere, as a large negative bias on the scores.
fn get_extended_attention_mask(attention_mask: &Tensor, dtype: DType) -> Result<Tensor> {
    let attention_mask = match attention_mask.rank() {
        3 => attention_mask.unsqueeze(1)?,
        2 => attention_mask.unsqueeze(1)?.unsqueeze(1)?,
        _ => candle::bail!(
            "Wrong shape for input_ids, shape {:?}",
            attention_mask.shape()
        ),
    };
    let attention_mask = attention_mask.to_dtype(dtype)?;
    (attention_mask.ones_like()? - &attention_mask)?
        .broadcast_mul(&Tensor::try_from(f32::MIN)?.to_device(attention_mask.device())?)
}

pub struct Encoder {
    embeddings: Embeddings,
    layers: Vec<Layer>,
    span: tracing::Span,
}

#[autocast]
impl Encoder {
    pub fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let embeddings = Embeddings::load(vb.pp("embeddings"), config)?;
        let layers = (0..config.num_hidden_layers)
            .map(|index| Layer::load(vb.pp(format!("encoder.layer.{index}")), config))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embeddings,
            layers,
            span: tracing::span!(tracing::Level::TRACE, "model"),
        })
    }

    /// Hidden states `(b, t, hidden)` for token ids `(b, t)`.
    pub fn forward(
        &self,
        input_ids: &Tensor,
        token_type_ids: &Tensor,
        attention_mask: Option<&Tensor>,
    ) -> Result<Tensor> {
        let _enter = self.span.enter();
        let embedding_output = self.embeddings.forward(input_ids, token_type_ids)?;
        let attention_mask = match attention_mask {
            Some(attention_mask) => attention_mask.clone(),
            None => input_ids.ones_like()?,
        };
        let attention_mask = get_extended_attention_mask(&attention_mask, DType::F32)?;
        let mut hidden_states = embedding_output;
        for layer in self.layers.iter() {
            hidden_states = layer.forward(&hidden_states, &attention_mask)?
        }
        Ok(hidden_states)
    }
}
