//! `examples/gpt.rs` at tiny size: the decoder's attention runs in the policy's lower precision
//! with its softmax in f32, every parameter gets a finite gradient in f32, fp16 and bf16, a few
//! steps of each mode train, and KV-cached generation reproduces a full recompute.

#[path = "../examples/transformers/counting.rs"]
mod counting;
#[path = "../examples/transformers/gpt_model.rs"]
mod gpt_model;

use candle_amp::{Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use counting::Counting;
use gpt_model::{Config, Gpt};

mod common;

type Loss = fn(&mut Gpt, &candle_core::Tensor) -> Result<Tensor<F32>>;

fn tiny() -> Config {
    Config {
        vocab_size: 8,
        n_positions: 16,
        n_embd: 16,
        n_layer: 1,
        n_head: 2,
        dropout: 0.1,
        layer_norm_epsilon: 1e-5,
    }
}

fn modes() -> [(&'static str, Loss, DType); 3] {
    [
        ("f32", gpt_model::loss_f32 as Loss, DType::F32),
        ("fp16", gpt_model::loss_fp16, DType::F16),
        ("bf16", gpt_model::loss_bf16, DType::BF16),
    ]
}

fn attention_runs_in_the_lower_precision_and_every_parameter_learns_in_each_mode(
    dev: &Device,
) -> Result<()> {
    let vars = VarMap::new();
    let mut m = Gpt::new(&tiny(), VarBuilder::from_varmap(&vars, DType::F32, dev))?;
    let ids = Counting::new(8, 1).batch(2, 9, dev)?;
    for (name, loss, lower) in modes() {
        let l = loss(&mut m, &ids)?;
        assert_eq!(l.dims(), &[] as &[usize], "{name}: a scalar loss");
        for block in &m.blocks {
            // The attention op is lower precision: it runs in the region's half dtype.
            assert_eq!(block.attn.last_dtype.get(), Some(lower), "{name}");
        }
        let grads = l.as_candle().backward()?;
        let data = vars.data().lock().unwrap();
        assert!(data.len() >= 14, "{name}: {} parameters", data.len());
        for (param, var) in data.iter() {
            let g = grads
                .get(var)
                .unwrap_or_else(|| panic!("{name}: no gradient reached `{param}`"));
            assert_eq!(g.dtype(), DType::F32, "{name}: `{param}`");
            let v = g.flatten_all()?.to_vec1::<f32>()?;
            assert!(
                v.iter().all(|x| x.is_finite()),
                "{name}: `{param}` not finite"
            );
            assert!(v.iter().any(|x| *x != 0.0), "{name}: `{param}` all zero");
        }
    }
    Ok(())
}

test_device!(
    attention_runs_in_the_lower_precision_and_every_parameter_learns_in_each_mode,
    precision_and_learning_cpu,
    precision_and_learning_cuda
);

#[test]
fn cached_generation_matches_a_full_recompute_in_f32() -> Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let mut m = Gpt::new(&tiny(), VarBuilder::from_varmap(&vars, DType::F32, &dev))?;
    let prompt = [1u32, 3, 5];
    let (tokens, cached) = gpt_model::generate(&mut m, &prompt, 5)?;
    assert_eq!(tokens.len(), 8);
    let full = gpt_model::recomputed(&mut m, &tokens[..tokens.len() - 1], prompt.len())?;
    assert_eq!(full.len(), cached.len());
    let diff = gpt_model::max_abs_diff(&cached, &full);
    assert!(diff <= 1e-4, "KV cache vs recompute: {diff}");
    Ok(())
}
