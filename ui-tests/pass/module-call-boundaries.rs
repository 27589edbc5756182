//! What module calls from a region take and return, as candle code writes them: ids and an
//! additive mask as candle tensors, an optional typed tensor (`None` needs no annotation), a
//! slice of tensors, plain `usize`/`bool`/`f64`, a parameter used twice, a tuple result, plain
//! values as results beside a tensor or alone.
use candle_amp::nn::{self, Linear};
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

struct Block {
    fc: Linear,
}

#[autocast]
impl Block {
    #[allow(clippy::too_many_arguments)]
    fn forward(
        &self,
        x: &Tensor<F32>,
        ids: &candle_core::Tensor,
        mask: Option<&candle_core::Tensor>,
        context: Option<&Tensor<F32>>,
        extra: &[Tensor<F32>],
        offset: usize,
        train: bool,
        scale: f64,
    ) -> Result<(Tensor<F32>, Tensor<F32>)> {
        assert_eq!(ids.dtype(), DType::U32);
        let mut h = (self.fc.forward(x)? * scale)?;
        if let Some(mask) = mask {
            h = h.broadcast_add(mask)?;
        }
        if let Some(c) = context {
            h = (h + c)?;
        }
        for e in extra {
            h = (h + e)?;
        }
        let h = if train { h.narrow(1, offset, 1)? } else { h };
        Ok((h, (x + x)?))
    }
}

struct Width;

#[autocast]
impl Width {
    fn forward(&self, x: &Tensor<F32>) -> Result<(Tensor<F32>, usize, DType)> {
        let h = x.relu()?;
        let dtype = h.dtype();
        Ok((h, x.dim(1)?, dtype))
    }
}

struct Wide;

#[autocast]
impl Wide {
    fn forward(&self, x: &Tensor<F32>) -> Result<bool> {
        Ok(x.dim(1)? > 1)
    }
}

#[autocast(fp16)]
fn widths(x: &Tensor<F32>) -> Result<(usize, bool)> {
    let h = x.matmul(&x.t()?)?;
    let (_, n, dtype) = Width.forward(&h)?;
    assert_eq!(dtype, DType::F16);
    Ok((n, Wide.forward(&h)?))
}

#[autocast(fp16)]
fn run(b: &Block, x: &Tensor<F32>, ids: &candle_core::Tensor) -> Result<Tensor<F32>> {
    let mask = candle_core::Tensor::zeros((1, 2), DType::F32, &Device::Cpu)?;
    let (h, twice) = b.forward(x, ids, Some(&mask), None, &[], 0, false, 0.5)?;
    let (k, _) = b.forward(x, ids, None, Some(&h), &[h.clone(), twice], 1, true, 1.0)?;
    assert_eq!((h.dtype(), k.dtype()), (DType::F32, DType::F32));
    Ok(k)
}

fn main() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let b = Block { fc: nn::linear(2, 2, vb)? };
    let x = Tensor::<F32>::ones((1, 2), &Device::Cpu)?;
    let ids = candle_core::Tensor::new(&[[1u32, 2]], &Device::Cpu)?;
    assert_eq!(run(&b, &x, &ids)?.dims(), &[1, 1]);
    assert_eq!(widths(&x)?, (1, false));
    assert_eq!(Width.forward(&x)?.1, 2);
    Ok(())
}
