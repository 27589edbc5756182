//! `bench`'s transformer figures, forward and backward on the device:
//!
//! - `attention_vs_composed` (target <= 0.5): `ops::scaled_dot_product_attention` (causal) over
//!   the same math composed of routed ops (`q.matmul(&k.t())`, the scale, an additive causal
//!   mask, `ops::softmax_last_dim`, the second `matmul`), both in a bf16 region on bf16 heads of
//!   `examples/gpt.rs`' shape at `--width 256 --seq 64 --batch 16`: `(16, 4, 64, 64)`.
//! - `gpt_block_bf16_vs_f32` (target <= 0.35): one decoder block of `examples/gpt.rs` (layer
//!   norms, attention, the GELU MLP, residuals; width 256, 4 heads) on `(16, 64, 256)`, called
//!   from a bf16 region over the same block called from plain f32 code.

use std::cell::RefCell;
use std::hint::black_box;

use candle_amp::{autocast, ops, Tensor, BF16, F32};
use candle_core::{DType, Device, Result, Var};
use candle_nn::{VarBuilder, VarMap};

use super::gpt_model::{Block, Config};
use super::{interleaved, Args, Samples};

/// Batch, heads, length and head size of the attention figure.
const SHAPE: (usize, usize, usize, usize) = (16, 4, 64, 64);

#[autocast(bf16)]
fn attention_op(q: &Tensor<BF16>, k: &Tensor<BF16>, v: &Tensor<BF16>) -> Result<Tensor<F32>> {
    ops::scaled_dot_product_attention(q, k, v, None, None, true)
}

#[autocast(bf16)]
fn attention_composed(
    q: &Tensor<BF16>,
    k: &Tensor<BF16>,
    v: &Tensor<BF16>,
    mask: &candle_core::Tensor,
) -> Result<Tensor<F32>> {
    let scale = 1.0 / (SHAPE.3 as f64).sqrt();
    let att = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
    ops::softmax_last_dim(&att)?.matmul(v)
}

/// Side 0: the attention op, side 1: the composed math.
pub(super) fn measure_attention(args: &Args, dev: &Device) -> Result<Samples> {
    let head = || -> Result<(Var, Tensor<BF16>)> {
        let t = candle_core::Tensor::randn(0f32, 1.0, SHAPE, dev)?.to_dtype(DType::BF16)?;
        let var = Var::from_tensor(&t)?;
        let typed = Tensor::<BF16>::from_candle(var.as_tensor().clone())?;
        Ok((var, typed))
    };
    let ((_q, q), (_k, k), (_v, v)) = (head()?, head()?, head()?);
    let mask = ops::causal_mask(SHAPE.2, 0, dev)?;
    let mut by_op = || -> Result<()> {
        let y = attention_op(black_box(&q), &k, &v)?;
        black_box(y.as_candle().sum_all()?.backward()?);
        Ok(())
    };
    let mut composed = || -> Result<()> {
        let y = attention_composed(black_box(&q), &k, &v, &mask)?;
        black_box(y.as_candle().sum_all()?.backward()?);
        Ok(())
    };
    interleaved(
        dev,
        args.warmup,
        args.step_samples,
        &mut [&mut by_op, &mut composed],
    )
}

#[autocast(bf16)]
fn block_bf16(block: &mut Block, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    block.forward(x, true, false)
}

/// Side 0: the block from a bf16 region, side 1: from f32 code.
pub(super) fn measure_gpt_block(args: &Args, dev: &Device) -> Result<Samples> {
    let vars = VarMap::new();
    let cfg = Config {
        n_embd: 256,
        ..Config::small(16)
    };
    let block = RefCell::new(Block::new(
        &cfg,
        VarBuilder::from_varmap(&vars, DType::F32, dev),
    )?);
    let x = Tensor::<F32>::randn(0.0, 1.0, (16, 64, cfg.n_embd), dev)?;
    let mut bf16 = || -> Result<()> {
        let y = block_bf16(&mut block.borrow_mut(), black_box(&x))?;
        black_box(y.as_candle().sqr()?.mean_all()?.backward()?);
        Ok(())
    };
    let mut f32 = || -> Result<()> {
        let y = block.borrow_mut().forward(black_box(&x), true, false)?;
        black_box(y.as_candle().sqr()?.mean_all()?.backward()?);
        Ok(())
    };
    interleaved(
        dev,
        args.warmup,
        args.step_samples,
        &mut [&mut bf16, &mut f32],
    )
}
