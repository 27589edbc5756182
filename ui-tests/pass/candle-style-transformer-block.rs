//! A transformer block written as candle-transformers writes one, ported by adding the attribute
//! and the type names: helper methods, token ids and an optional mask as candle tensors, a
//! parameter used twice, candle's shape and scalar idioms, a `Vec<Box<dyn AmpModule>>` MLP,
//! `.apply`, a foreign op by class, and the whole block as a `candle_nn::Module`.
use candle_amp::nn::{self, Embedding, LayerNorm, Linear};
use candle_amp::{autocast, ops, AmpModule, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, Result, D};
use candle_nn::{VarBuilder, VarMap};

struct Attention {
    qkv: Linear,
    out: Linear,
    heads: usize,
}

#[autocast]
impl Attention {
    fn split(&self, x: &AmpTensor) -> Result<AmpTensor> {
        let (b, t, c) = x.dims3()?;
        x.reshape((b, t, self.heads, c / self.heads))?.transpose(1, 2)?.contiguous()
    }

    fn forward(&self, x: &Tensor<F32>, mask: Option<&candle_core::Tensor>) -> Result<Tensor<F32>> {
        let (b, t, c) = x.dims3()?;
        let qkv = self.qkv.forward(x)?;
        let q = self.split(&qkv.narrow(D::Minus1, 0, c)?)?;
        let k = self.split(&qkv.narrow(D::Minus1, c, c)?)?;
        let v = self.split(&qkv.narrow(D::Minus1, 2 * c, c)?)?;
        let scale = 1.0 / ((c / self.heads) as f64).sqrt();
        let mut att = (q.matmul(&k.t()?)? * scale)?;
        if let Some(mask) = mask {
            att = att.broadcast_add(mask)?;
        }
        let att = ops::softmax(&att, D::Minus1)?;
        let y = att.matmul(&v)?.transpose(1, 2)?.reshape((b, t, c))?;
        self.out.forward(&y)
    }
}

struct Block {
    ln: LayerNorm,
    attn: Attention,
    mlp: Vec<Box<dyn AmpModule>>,
}

#[autocast]
impl Block {
    fn forward(&self, x: &Tensor<F32>, mask: Option<&candle_core::Tensor>) -> Result<Tensor<F32>> {
        let h = (x + &self.attn.forward(&self.ln.forward(x)?, mask)?)?;
        let mut m = h.apply(&self.ln)?;
        for layer in &self.mlp {
            m = layer.forward(&m)?.preserve_op(candle_nn::ops::silu)?;
        }
        Ok(((&h + &m)? / 2.0)?)
    }
}

/// The block as a candle module over embeddings, with a causal mask.
struct Causal {
    block: Block,
}

#[autocast(bf16)]
impl candle_nn::Module for Causal {
    fn forward(&self, xs: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let t = xs.dim(1)?;
        let mask = candle_core::Tensor::tril2(t, DType::F32, xs.device())?;
        let mask = ((1.0 - mask)? * -1e4)?;
        let y = self.block.forward(xs, Some(&mask))?;
        Ok(y)
    }
}

/// Token ids in, a plain candle tensor: the embedding is on no autocast list.
struct Lm {
    emb: Embedding,
    causal: Causal,
}

#[autocast(bf16)]
impl Lm {
    fn forward(&self, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
        let x = self.emb.forward(ids)?;
        Ok(x.apply(&self.causal)?.to_dtype(DType::F32)?)
    }
}

fn main() -> Result<()> {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let lm = Lm {
        emb: nn::embedding(10, 8, vb.pp("emb"))?,
        causal: Causal { block: Block {
            ln: nn::layer_norm(8, 1e-5, vb.pp("ln"))?,
            attn: Attention {
                qkv: nn::linear(8, 24, vb.pp("qkv"))?,
                out: nn::linear(8, 8, vb.pp("out"))?,
                heads: 2,
            },
            mlp: vec![
                Box::new(nn::linear(8, 16, vb.pp("fc1"))?),
                Box::new(nn::linear(16, 8, vb.pp("fc2"))?),
            ],
        } },
    };
    let ids = candle_core::Tensor::new(&[[1u32, 2, 3, 4]], &dev)?;
    let y = lm.forward(&ids)?;
    assert_eq!(y.dims(), &[1, 4, 8]);
    assert_eq!(y.dtype(), DType::F32);
    Ok(())
}
