//! A BERT encoder with a masked-language-model head, written as candle-transformers writes one
//! (`models/bert.rs`): `BertEmbeddings` (word, position and token-type embeddings, LayerNorm,
//! dropout), `BertSelfAttention` with an additive padding mask, `BertSelfOutput`,
//! `BertIntermediate` (dense + GELU), `BertOutput`, `BertLayer`, `BertEncoder`, `BertModel`, and
//! `BertForMaskedLM`, whose prediction head (dense + GELU + LayerNorm) decodes with the word
//! embeddings, transposed (tied weights, as BERT does), plus an output bias.
//!
//! Ported from candle code by adding `#[autocast]` to the impls and writing `Tensor<F32>` for
//! activations (`candle_core::Tensor` stays for token ids and masks, which are never cast). The
//! model runs in whatever precision the calling region asks for: f32 called directly, fp16 or
//! bf16 from the `#[autocast(fp16)]`/`#[autocast(bf16)]` loss functions at the end of this file.
//!
//! Also here: [`MaskedCounting`], a synthetic masked-LM task generated in code, and the loss
//! functions. Shared by `examples/bert.rs` and `tests/bert.rs`.

use std::cell::Cell;

use candle_amp::nn::{self, Dropout, Embedding, LayerNorm, Linear};
use candle_amp::{autocast, loss, ops, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, IndexOp, Result, D};
use candle_nn::VarBuilder;

/// The additive mask value at padded keys. In f32 it zeroes those keys' softmax weights as
/// surely as `-inf` does, and it stays finite should a mask ever be cast to f16 (whose largest
/// value is 65504), where `f32::MIN` would become `-inf`.
pub const MASKED_SCORE: f64 = -1e4;

/// The hyper-parameters, named as in Hugging Face's `BertConfig`.
#[derive(Clone, Copy, Debug)]
pub struct Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub intermediate_size: usize,
    pub hidden_act: nn::Activation,
    pub hidden_dropout_prob: f32,
    pub attention_probs_dropout_prob: f32,
    pub max_position_embeddings: usize,
    pub type_vocab_size: usize,
    pub initializer_range: f64,
    pub layer_norm_eps: f64,
}

impl Config {
    /// The default of `examples/bert.rs`: one layer of width 64 with 4 heads, and no dropout
    /// (BERT's 0.1 slows this small model's training down and makes the three precisions' runs
    /// differ by their random dropout masks, not only by their arithmetic).
    pub fn small(vocab_size: usize) -> Self {
        Self {
            vocab_size,
            hidden_size: 64,
            num_hidden_layers: 1,
            num_attention_heads: 4,
            intermediate_size: 256,
            hidden_act: nn::Activation::Gelu,
            hidden_dropout_prob: 0.0,
            attention_probs_dropout_prob: 0.0,
            max_position_embeddings: 64,
            type_vocab_size: 2,
            initializer_range: 0.02,
            layer_norm_eps: 1e-12,
        }
    }
}

/// The `(b, t)` attention mask (1 at tokens, 0 at padding) as the additive `(b, 1, 1, t)` f32
/// mask the attention scores take: 0 where a key may be attended to, [`MASKED_SCORE`] at padded
/// keys (Hugging Face's `get_extended_attention_mask`).
pub fn get_extended_attention_mask(
    attention_mask: &candle_core::Tensor,
) -> Result<candle_core::Tensor> {
    attention_mask
        .to_dtype(DType::F32)?
        .affine(-MASKED_SCORE, MASKED_SCORE)?
        .unsqueeze(1)?
        .unsqueeze(2)
}

/// An embedding table drawn from `N(0, initializer_range^2)`, as BERT initializes its
/// embeddings for pre-training (`nn::embedding` draws from `N(0, 1)`, which makes the tied
/// decoder's first logits large).
fn embedding(vocab: usize, config: &Config, vb: VarBuilder) -> Result<Embedding> {
    let init = candle_nn::Init::Randn {
        mean: 0.,
        stdev: config.initializer_range,
    };
    let table = vb.get_with_hints((vocab, config.hidden_size), "weight", init)?;
    Embedding::new(candle_core::Var::from_tensor(&table)?)
}

pub struct BertEmbeddings {
    word_embeddings: Embedding,
    position_embeddings: Embedding,
    token_type_embeddings: Embedding,
    layer_norm: LayerNorm,
    dropout: Dropout,
}

#[autocast]
impl BertEmbeddings {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            word_embeddings: embedding(config.vocab_size, config, vb.pp("word_embeddings"))?,
            position_embeddings: embedding(
                config.max_position_embeddings,
                config,
                vb.pp("position_embeddings"),
            )?,
            token_type_embeddings: embedding(
                config.type_vocab_size,
                config,
                vb.pp("token_type_embeddings"),
            )?,
            layer_norm: nn::layer_norm(
                config.hidden_size,
                config.layer_norm_eps,
                vb.pp("LayerNorm"),
            )?,
            dropout: Dropout::new(config.hidden_dropout_prob),
        })
    }

    /// `(b, t, hidden)` for `(b, t)` token ids and token-type (segment) ids.
    fn forward(
        &self,
        input_ids: &candle_core::Tensor,
        token_type_ids: &candle_core::Tensor,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let (_bsize, seq_len) = input_ids.dims2()?;
        let input_embeddings = self.word_embeddings.forward(input_ids)?;
        let token_type_embeddings = self.token_type_embeddings.forward(token_type_ids)?;
        let position_ids = candle_core::Tensor::arange(0u32, seq_len as u32, input_ids.device())?;
        let position_embeddings = self.position_embeddings.forward(&position_ids)?;
        let embeddings =
            (&input_embeddings + &token_type_embeddings)?.broadcast_add(&position_embeddings)?;
        let embeddings = self.layer_norm.forward(&embeddings)?;
        self.dropout.forward(&embeddings, train)
    }
}

pub struct BertSelfAttention {
    query: Linear,
    key: Linear,
    value: Linear,
    dropout: Dropout,
    num_attention_heads: usize,
    attention_head_size: usize,
    /// The dtype the last call's attention ran in (for the dtype test).
    pub last_dtype: Cell<Option<DType>>,
}

#[autocast]
impl BertSelfAttention {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let attention_head_size = config.hidden_size / config.num_attention_heads;
        let all_head_size = config.num_attention_heads * attention_head_size;
        let hidden_size = config.hidden_size;
        Ok(Self {
            query: nn::linear(hidden_size, all_head_size, vb.pp("query"))?,
            key: nn::linear(hidden_size, all_head_size, vb.pp("key"))?,
            value: nn::linear(hidden_size, all_head_size, vb.pp("value"))?,
            dropout: Dropout::new(config.attention_probs_dropout_prob),
            num_attention_heads: config.num_attention_heads,
            attention_head_size,
            last_dtype: Cell::new(None),
        })
    }

    /// `(b, t, all_head_size)` to `(b, heads, t, head_size)`: a view, which the attention op
    /// reads in place.
    fn transpose_for_scores(&self, xs: &AmpTensor) -> Result<AmpTensor> {
        let (b, t, _) = xs.dims3()?;
        xs.reshape((b, t, self.num_attention_heads, self.attention_head_size))?
            .transpose(1, 2)
    }

    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        attention_mask: Option<&candle_core::Tensor>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let query_layer = self.transpose_for_scores(&self.query.forward(hidden_states)?)?;
        let key_layer = self.transpose_for_scores(&self.key.forward(hidden_states)?)?;
        let value_layer = self.transpose_for_scores(&self.value.forward(hidden_states)?)?;

        // One lower-precision op: the products in f16 or bf16 under a half policy, the additive
        // f32 mask, the softmax and the dropout on the probabilities in f32 between them.
        let options = ops::Attention {
            mask: attention_mask,
            dropout: if train { self.dropout.p() } else { 0.0 },
            ..ops::Attention::default()
        };
        let context_layer = ops::scaled_dot_product_attention_with(
            &query_layer,
            &key_layer,
            &value_layer,
            &options,
        )?;
        self.last_dtype.set(Some(context_layer.dtype()));
        context_layer.transpose(1, 2)?.flatten_from(D::Minus2)
    }
}

pub struct BertSelfOutput {
    dense: Linear,
    layer_norm: LayerNorm,
    dropout: Dropout,
}

#[autocast]
impl BertSelfOutput {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            dense: nn::linear(config.hidden_size, config.hidden_size, vb.pp("dense"))?,
            layer_norm: nn::layer_norm(
                config.hidden_size,
                config.layer_norm_eps,
                vb.pp("LayerNorm"),
            )?,
            dropout: Dropout::new(config.hidden_dropout_prob),
        })
    }

    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        input_tensor: &Tensor<F32>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let hidden_states = self.dense.forward(hidden_states)?;
        let hidden_states = self.dropout.forward(&hidden_states, train)?;
        self.layer_norm.forward(&(&hidden_states + input_tensor)?)
    }
}

pub struct BertAttention {
    self_attention: BertSelfAttention,
    self_output: BertSelfOutput,
}

#[autocast]
impl BertAttention {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            self_attention: BertSelfAttention::load(vb.pp("self"), config)?,
            self_output: BertSelfOutput::load(vb.pp("output"), config)?,
        })
    }

    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        attention_mask: Option<&candle_core::Tensor>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let self_outputs = self
            .self_attention
            .forward(hidden_states, attention_mask, train)?;
        self.self_output
            .forward(&self_outputs, hidden_states, train)
    }
}

pub struct BertIntermediate {
    dense: Linear,
    intermediate_act: nn::Activation,
}

#[autocast]
impl BertIntermediate {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            dense: nn::linear(config.hidden_size, config.intermediate_size, vb.pp("dense"))?,
            intermediate_act: config.hidden_act,
        })
    }

    fn forward(&self, hidden_states: &Tensor<F32>) -> Result<Tensor<F32>> {
        let hidden_states = self.dense.forward(hidden_states)?;
        self.intermediate_act.forward(&hidden_states)
    }
}

pub struct BertOutput {
    dense: Linear,
    layer_norm: LayerNorm,
    dropout: Dropout,
}

#[autocast]
impl BertOutput {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            dense: nn::linear(config.intermediate_size, config.hidden_size, vb.pp("dense"))?,
            layer_norm: nn::layer_norm(
                config.hidden_size,
                config.layer_norm_eps,
                vb.pp("LayerNorm"),
            )?,
            dropout: Dropout::new(config.hidden_dropout_prob),
        })
    }

    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        input_tensor: &Tensor<F32>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let hidden_states = self.dense.forward(hidden_states)?;
        let hidden_states = self.dropout.forward(&hidden_states, train)?;
        self.layer_norm.forward(&(&hidden_states + input_tensor)?)
    }
}

pub struct BertLayer {
    attention: BertAttention,
    intermediate: BertIntermediate,
    output: BertOutput,
}

#[autocast]
impl BertLayer {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            attention: BertAttention::load(vb.pp("attention"), config)?,
            intermediate: BertIntermediate::load(vb.pp("intermediate"), config)?,
            output: BertOutput::load(vb.pp("output"), config)?,
        })
    }

    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        attention_mask: Option<&candle_core::Tensor>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let attention_output = self
            .attention
            .forward(hidden_states, attention_mask, train)?;
        let intermediate_output = self.intermediate.forward(&attention_output)?;
        self.output
            .forward(&intermediate_output, &attention_output, train)
    }
}

pub struct BertEncoder {
    layers: Vec<BertLayer>,
}

#[autocast]
impl BertEncoder {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        let layers = (0..config.num_hidden_layers)
            .map(|index| BertLayer::load(vb.pp(format!("layer.{index}")), config))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self { layers })
    }

    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        attention_mask: Option<&candle_core::Tensor>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let mut hidden_states = hidden_states.clone();
        for layer in &self.layers {
            hidden_states = layer.forward(&hidden_states, attention_mask, train)?;
        }
        Ok(hidden_states)
    }
}

/// The encoder: embeddings, then the layers.
pub struct BertModel {
    embeddings: BertEmbeddings,
    encoder: BertEncoder,
}

#[autocast]
impl BertModel {
    pub fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            embeddings: BertEmbeddings::load(vb.pp("embeddings"), config)?,
            encoder: BertEncoder::load(vb.pp("encoder"), config)?,
        })
    }

    /// The last hidden states `(b, t, hidden)`; `attention_mask` `(b, t)` is 1 at tokens and 0
    /// at padding (`None`: every position is a token).
    pub fn forward(
        &self,
        input_ids: &candle_core::Tensor,
        token_type_ids: &candle_core::Tensor,
        attention_mask: Option<&candle_core::Tensor>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let embedding_output = self.embeddings.forward(input_ids, token_type_ids, train)?;
        let extended_attention_mask = match attention_mask {
            Some(mask) => Some(get_extended_attention_mask(mask)?),
            None => None,
        };
        self.encoder
            .forward(&embedding_output, extended_attention_mask.as_ref(), train)
    }
}

pub struct BertPredictionHeadTransform {
    dense: Linear,
    transform_act_fn: nn::Activation,
    layer_norm: LayerNorm,
}

#[autocast]
impl BertPredictionHeadTransform {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            dense: nn::linear(config.hidden_size, config.hidden_size, vb.pp("dense"))?,
            transform_act_fn: config.hidden_act,
            layer_norm: nn::layer_norm(
                config.hidden_size,
                config.layer_norm_eps,
                vb.pp("LayerNorm"),
            )?,
        })
    }

    fn forward(&self, hidden_states: &Tensor<F32>) -> Result<Tensor<F32>> {
        let hidden_states = self.dense.forward(hidden_states)?;
        let hidden_states = self.transform_act_fn.forward(&hidden_states)?;
        self.layer_norm.forward(&hidden_states)
    }
}

/// The MLM prediction head. Its decoder is the word-embedding table, passed in at each call
/// (weight tying); only the output bias is its own.
pub struct BertLMPredictionHead {
    transform: BertPredictionHeadTransform,
    bias: candle_core::Tensor,
}

#[autocast]
impl BertLMPredictionHead {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            transform: BertPredictionHeadTransform::load(vb.pp("transform"), config)?,
            bias: vb.get_with_hints(config.vocab_size, "bias", candle_nn::Init::Const(0.))?,
        })
    }

    /// Logits `(b, t, vocab)` from hidden states `(b, t, hidden)` and the `(vocab, hidden)` word
    /// embeddings.
    fn forward(
        &self,
        hidden_states: &Tensor<F32>,
        word_embeddings: &candle_core::Tensor,
    ) -> Result<Tensor<F32>> {
        let hidden_states = self.transform.forward(hidden_states)?;
        let (b, t, c) = hidden_states.dims3()?;
        // One 2-D GEMM for the decoder (lower precision under a half policy), then the f32 bias.
        Ok(hidden_states
            .reshape((b * t, c))?
            .matmul(&word_embeddings.t()?)?
            .broadcast_add(&self.bias)?
            .reshape((b, t, ()))?)
    }
}

pub struct BertOnlyMLMHead {
    predictions: BertLMPredictionHead,
}

#[autocast]
impl BertOnlyMLMHead {
    fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            predictions: BertLMPredictionHead::load(vb.pp("predictions"), config)?,
        })
    }

    fn forward(
        &self,
        sequence_output: &Tensor<F32>,
        word_embeddings: &candle_core::Tensor,
    ) -> Result<Tensor<F32>> {
        self.predictions.forward(sequence_output, word_embeddings)
    }
}

/// BERT with its masked-LM head (Hugging Face's `BertForMaskedLM`): weights under `bert.*` and
/// `cls.predictions.*`.
pub struct BertForMaskedLM {
    bert: BertModel,
    cls: BertOnlyMLMHead,
}

#[autocast]
impl BertForMaskedLM {
    pub fn load(vb: VarBuilder, config: &Config) -> Result<Self> {
        Ok(Self {
            bert: BertModel::load(vb.pp("bert"), config)?,
            cls: BertOnlyMLMHead::load(vb.pp("cls"), config)?,
        })
    }

    /// Logits `(b, t, vocab)` at every position; see [`BertModel::forward`] for the arguments.
    pub fn forward(
        &self,
        input_ids: &candle_core::Tensor,
        token_type_ids: &candle_core::Tensor,
        attention_mask: Option<&candle_core::Tensor>,
        train: bool,
    ) -> Result<Tensor<F32>> {
        let sequence_output =
            self.bert
                .forward(input_ids, token_type_ids, attention_mask, train)?;
        let word_embeddings = self
            .bert
            .embeddings
            .word_embeddings
            .embeddings()
            .as_tensor();
        self.cls.forward(&sequence_output, word_embeddings)
    }
}

impl BertForMaskedLM {
    /// The dtype each layer's attention ran in during the last forward (`None` before the
    /// first).
    pub fn attention_dtypes(&self) -> Vec<Option<DType>> {
        self.bert
            .encoder
            .layers
            .iter()
            .map(|l| l.attention.self_attention.last_dtype.get())
            .collect()
    }
}

/// A padded batch of the masked-LM task; every tensor is a `candle_core::Tensor` of integers.
#[derive(Debug)]
pub struct MlmBatch {
    /// `(b, t)` u32 token ids, some replaced by `[MASK]`.
    pub input_ids: candle_core::Tensor,
    /// `(b, t)` u32 segment ids: 0 for `[CLS] A [SEP]` (and the padding), 1 for `B [SEP]`.
    pub token_type_ids: candle_core::Tensor,
    /// `(b, t)` u8: 1 at tokens, 0 at padding.
    pub attention_mask: candle_core::Tensor,
    /// `(n,)` u32 indices into the flattened `(b * t)` positions of the positions to predict.
    pub masked_positions: candle_core::Tensor,
    /// `(n,)` u32 original tokens at those positions.
    pub labels: candle_core::Tensor,
}

/// A synthetic masked-LM task with structure to learn. Each sequence is
/// `[CLS] A [SEP] B [SEP]`, then padding to the batch's longest. Segment A runs up the alphabet
/// from a random letter (`c d e f`), modulo the number of letters (`... o p a b ...`). As in
/// BERT's pre-training data, B is A's continuation half of the time and random text otherwise:
/// either B runs back down from A's last letter (`f e d c b`), or its letters are drawn
/// uniformly. The segments' lengths vary (2 to `(max_len - 3) / 2` letters each).
///
/// So a masked letter of A follows from its neighbours, and one of B from its neighbours and
/// its segment (its token type: down in B) once the visible letters show that B continues A; in
/// a random B, nothing predicts it, and the best guess is uniform over the letters. The
/// best achievable loss is therefore well above 0 (the random B letters, about a quarter of
/// the predictions, cost `ln(letters)` each), which is what every precision converges to.
///
/// 15% of the letters, and at least one per sequence, are chosen for prediction and replaced by
/// `[MASK]` (BERT also leaves 10% of them as they are and replaces 10% by random letters, which
/// prepares a model for fine-tuning on unmasked text; this task has no fine-tuning, and those
/// cases only slow this small model's training down).
///
/// Token ids: the letters are `0..letters`, then `[PAD]`, `[CLS]`, `[SEP]`, `[MASK]`. The
/// generator is deterministic: the same seed gives the same batches.
#[derive(Debug)]
pub struct MaskedCounting {
    state: u64,
    pub letters: usize,
}

impl MaskedCounting {
    /// The fraction of the letters chosen for prediction.
    pub const MASK_PROB: f64 = 0.15;

    pub fn new(letters: usize, seed: u64) -> Self {
        Self {
            state: seed
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407)
                | 1,
            letters,
        }
    }

    pub fn pad(&self) -> u32 {
        self.letters as u32
    }

    pub fn cls(&self) -> u32 {
        self.letters as u32 + 1
    }

    pub fn sep(&self) -> u32 {
        self.letters as u32 + 2
    }

    pub fn mask(&self) -> u32 {
        self.letters as u32 + 3
    }

    /// The model's vocabulary: the letters and the four special tokens.
    pub fn vocab_size(&self) -> usize {
        self.letters + 4
    }

    fn next(&mut self) -> u64 {
        // xorshift64*
        self.state ^= self.state >> 12;
        self.state ^= self.state << 25;
        self.state ^= self.state >> 27;
        self.state.wrapping_mul(0x2545_f491_4f6c_dd1d) >> 11
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// A uniform number in `[0, 1)`.
    fn uniform(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 53) as f64
    }

    /// `[CLS] A [SEP] B [SEP]` with B continuing A: segments of `len_a` and `len_b` letters, A
    /// starting at letter `start`; and the token types.
    pub fn sequence_of(&self, start: usize, len_a: usize, len_b: usize) -> (Vec<u32>, Vec<u32>) {
        let letter = |i: usize| ((start + i) % self.letters) as u32;
        let mut tokens = vec![self.cls()];
        tokens.extend((0..len_a).map(letter));
        tokens.push(self.sep());
        // Down from A's last letter: letter(len_a - 1 - j), kept non-negative modulo `letters`.
        let top = len_a - 1 + self.letters * len_b.div_ceil(self.letters);
        tokens.extend((0..len_b).map(|j| letter(top - j)));
        tokens.push(self.sep());
        let types = (0..tokens.len())
            .map(|i| u32::from(i > len_a + 1))
            .collect();
        (tokens, types)
    }

    /// One random unmasked sequence of at most `max_len` tokens (at least 7) and its token
    /// types: B continues A or, half of the time, is random letters.
    pub fn sequence(&mut self, max_len: usize) -> (Vec<u32>, Vec<u32>) {
        let longest = (max_len.max(7) - 3) / 2;
        let len_a = 2 + self.below(longest - 1);
        let len_b = 2 + self.below(longest - 1);
        let start = self.below(self.letters);
        let (mut tokens, types) = self.sequence_of(start, len_a, len_b);
        if self.below(2) == 0 {
            for t in &mut tokens[len_a + 2..len_a + 2 + len_b] {
                *t = self.below(self.letters) as u32;
            }
        }
        (tokens, types)
    }

    /// Chooses the positions to predict in `tokens` and masks them; returns the
    /// `(position, original token)` pairs.
    fn mask_letters(&mut self, tokens: &mut [u32]) -> Vec<(usize, u32)> {
        let letters: Vec<usize> = (0..tokens.len())
            .filter(|&i| (tokens[i] as usize) < self.letters)
            .collect();
        let mut chosen: Vec<usize> = letters
            .iter()
            .copied()
            .filter(|_| self.uniform() < Self::MASK_PROB)
            .collect();
        if chosen.is_empty() {
            chosen.push(letters[self.below(letters.len())]);
        }
        chosen
            .into_iter()
            .map(|i| (i, std::mem::replace(&mut tokens[i], self.mask())))
            .collect()
    }

    /// A batch of `b` sequences of at most `max_len` tokens, padded to the longest.
    pub fn batch(&mut self, b: usize, max_len: usize, dev: &Device) -> Result<MlmBatch> {
        let seqs: Vec<_> = (0..b).map(|_| self.sequence(max_len)).collect();
        let t = seqs.iter().map(|(s, _)| s.len()).max().unwrap_or(0);
        let (mut ids, mut types, mut mask) = (Vec::new(), Vec::new(), Vec::new());
        let (mut positions, mut labels) = (Vec::new(), Vec::new());
        for (row, (mut tokens, segment)) in seqs.into_iter().enumerate() {
            for (i, label) in self.mask_letters(&mut tokens) {
                positions.push((row * t + i) as u32);
                labels.push(label);
            }
            let pad = t - tokens.len();
            mask.extend(std::iter::repeat_n(1u8, tokens.len()).chain(std::iter::repeat_n(0, pad)));
            ids.extend(
                tokens
                    .into_iter()
                    .chain(std::iter::repeat_n(self.pad(), pad)),
            );
            types.extend(segment.into_iter().chain(std::iter::repeat_n(0, pad)));
        }
        let n = positions.len();
        Ok(MlmBatch {
            input_ids: candle_core::Tensor::from_vec(ids, (b, t), dev)?,
            token_type_ids: candle_core::Tensor::from_vec(types, (b, t), dev)?,
            attention_mask: candle_core::Tensor::from_vec(mask, (b, t), dev)?,
            masked_positions: candle_core::Tensor::from_vec(positions, n, dev)?,
            labels: candle_core::Tensor::from_vec(labels, n, dev)?,
        })
    }
}

/// Cross-entropy of the predictions at the masked positions only (the rows of the flattened
/// logits that `masked_positions` selects).
fn masked_lm_loss(m: &BertForMaskedLM, batch: &MlmBatch) -> Result<Tensor<F32>> {
    let logits = m.forward(
        &batch.input_ids,
        &batch.token_type_ids,
        Some(&batch.attention_mask),
        true,
    )?;
    let (b, t, v) = logits.dims3()?;
    let predicted = logits
        .reshape((b * t, v))?
        .index_select(&batch.masked_positions, 0)?;
    loss::cross_entropy(&predicted, &batch.labels)
}

/// The training loss under each precision: f32 (the model called from plain code), and the
/// same model from an fp16 and a bf16 region.
pub fn loss_f32(m: &BertForMaskedLM, batch: &MlmBatch) -> Result<Tensor<F32>> {
    masked_lm_loss(m, batch)
}

#[autocast(fp16)]
pub fn loss_fp16(m: &BertForMaskedLM, batch: &MlmBatch) -> Result<Tensor<F32>> {
    masked_lm_loss(m, batch)
}

#[autocast(bf16)]
pub fn loss_bf16(m: &BertForMaskedLM, batch: &MlmBatch) -> Result<Tensor<F32>> {
    masked_lm_loss(m, batch)
}

/// The model's most likely token at each `[MASK]` of one sequence (`tokens`, `types`), in
/// evaluation mode (no dropout).
pub fn fill_masks(
    m: &BertForMaskedLM,
    tokens: &[u32],
    types: &[u32],
    mask: u32,
) -> Result<Vec<u32>> {
    let dev = Device::Cpu;
    let ids = candle_core::Tensor::new(tokens, &dev)?.unsqueeze(0)?;
    let types = candle_core::Tensor::new(types, &dev)?.unsqueeze(0)?;
    let logits = m.forward(&ids, &types, None, false)?;
    let logits = logits.as_candle().i(0)?;
    tokens
        .iter()
        .enumerate()
        .filter(|&(_, &t)| t == mask)
        .map(|(i, _)| logits.i(i)?.argmax(0)?.to_scalar::<u32>())
        .collect()
}
