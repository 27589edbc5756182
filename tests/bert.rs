//! The BERT example's model (`examples/transformers/bert_model.rs`) at a tiny size, trained a
//! few steps in each precision: every weight gets a finite f32 gradient that is not all zero,
//! and the attention runs where autocast puts it (scores in the policy's half precision,
//! softmax in f32).

#[allow(dead_code)] // the example's demo helpers are not used here
#[path = "../examples/transformers/bert_model.rs"]
mod bert_model;

use bert_model::{BertForMaskedLM, Config, MaskedCounting, MlmBatch};
use candle_amp::{Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{AdamW, Optimizer, ParamsAdamW, VarBuilder, VarMap};

mod common;

#[derive(Clone, Copy, Debug)]
enum Mode {
    F32,
    Fp16,
    Bf16,
}

impl Mode {
    fn loss(self, m: &BertForMaskedLM, batch: &MlmBatch) -> Result<Tensor<F32>> {
        match self {
            Self::F32 => bert_model::loss_f32(m, batch),
            Self::Fp16 => bert_model::loss_fp16(m, batch),
            Self::Bf16 => bert_model::loss_bf16(m, batch),
        }
    }

    /// The attention scores' dtype under this mode (the softmax output is always f32).
    fn scores(self) -> DType {
        match self {
            Self::F32 => DType::F32,
            Self::Fp16 => DType::F16,
            Self::Bf16 => DType::BF16,
        }
    }
}

/// Three AdamW steps of a one-layer, width-16 model with dropout on, checking the gradients and
/// the attention dtypes at each step.
fn train_tiny(mode: Mode, dev: &Device) -> Result<()> {
    let mut data = MaskedCounting::new(6, 3);
    let cfg = Config {
        hidden_size: 16,
        num_attention_heads: 2,
        intermediate_size: 32,
        hidden_dropout_prob: 0.1,
        attention_probs_dropout_prob: 0.1,
        max_position_embeddings: 12,
        ..Config::small(data.vocab_size())
    };
    let vars = VarMap::new();
    let model = BertForMaskedLM::load(VarBuilder::from_varmap(&vars, DType::F32, dev), &cfg)?;
    let mut opt = AdamW::new(vars.all_vars(), ParamsAdamW::default())?;
    let names: Vec<(String, candle_core::Var)> = vars
        .data()
        .lock()
        .expect("unpoisoned")
        .iter()
        .map(|(name, var)| (name.clone(), var.clone()))
        .collect();
    // embeddings (3 tables, LayerNorm), one layer (q, k, v, 3 dense, 2 LayerNorms), head
    // (dense, LayerNorm, bias).
    assert_eq!(names.len(), 5 + 16 + 5, "{names:?}");
    for step in 0..3 {
        let batch = data.batch(4, 12, dev)?;
        let l = mode.loss(&model, &batch)?;
        let value = l.to_scalar::<f32>()?;
        assert!(value.is_finite(), "{mode:?} step {step}: loss {value}");
        assert_eq!(
            model.attention_dtypes(),
            vec![Some(mode.scores())],
            "{mode:?}: the attention op's dtype"
        );
        let grads = l.as_candle().backward()?;
        for (name, var) in &names {
            let g = grads
                .get(var.as_tensor())
                .unwrap_or_else(|| panic!("{mode:?} step {step}: no gradient for {name}"));
            assert_eq!(g.dtype(), DType::F32, "{mode:?}: gradient of {name}");
            let g: Vec<f32> = g.flatten_all()?.to_vec1()?;
            assert!(
                g.iter().all(|x| x.is_finite()),
                "{mode:?} step {step}: non-finite gradient for {name}"
            );
            assert!(
                g.iter().any(|&x| x != 0.0),
                "{mode:?} step {step}: all-zero gradient for {name}"
            );
        }
        opt.step(&grads)?;
    }
    Ok(())
}

fn trains_in_f32(dev: &Device) -> Result<()> {
    train_tiny(Mode::F32, dev)
}

fn trains_in_fp16(dev: &Device) -> Result<()> {
    train_tiny(Mode::Fp16, dev)
}

fn trains_in_bf16(dev: &Device) -> Result<()> {
    train_tiny(Mode::Bf16, dev)
}

test_device!(trains_in_f32, bert_trains_in_f32, bert_trains_in_f32_cuda);
test_device!(
    trains_in_fp16,
    bert_trains_in_fp16,
    bert_trains_in_fp16_cuda
);
test_device!(
    trains_in_bf16,
    bert_trains_in_bf16,
    bert_trains_in_bf16_cuda
);

/// The padding mask: a padded sequence's logits at its tokens do not depend on what the padding
/// holds.
#[test]
fn padding_is_masked() -> Result<()> {
    let dev = Device::Cpu;
    let data = MaskedCounting::new(6, 0);
    let cfg = Config {
        hidden_size: 16,
        num_attention_heads: 2,
        intermediate_size: 32,
        max_position_embeddings: 12,
        ..Config::small(data.vocab_size())
    };
    let vars = VarMap::new();
    let model = BertForMaskedLM::load(VarBuilder::from_varmap(&vars, DType::F32, &dev), &cfg)?;
    let (tokens, types) = data.sequence_of(1, 2, 2);
    let n = tokens.len();
    let logits = |pad: u32| -> Result<Vec<Vec<f32>>> {
        let padded: Vec<u32> = tokens.iter().copied().chain([pad; 3]).collect();
        let types: Vec<u32> = types.iter().copied().chain([0; 3]).collect();
        let mask: Vec<u8> = std::iter::repeat_n(1, n).chain([0; 3]).collect();
        let ids = candle_core::Tensor::new(padded.as_slice(), &dev)?.unsqueeze(0)?;
        let types = candle_core::Tensor::new(types.as_slice(), &dev)?.unsqueeze(0)?;
        let mask = candle_core::Tensor::new(mask.as_slice(), &dev)?.unsqueeze(0)?;
        let out = model.forward(&ids, &types, Some(&mask), false)?;
        out.as_candle().squeeze(0)?.narrow(0, 0, n)?.to_vec2()
    };
    let (a, b) = (logits(data.pad())?, logits(0)?);
    let diff = a
        .iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max);
    assert!(diff < 1e-5, "padding changed the logits by {diff}");
    Ok(())
}
