//! A model generic over its layers with the one public bound, `AmpModule` (called with
//! `.apply`, as candle code calls a generic `M: Module`), and a stack of `Box<dyn AmpModule>`
//! (called with `.forward`); both take the calling region's policy.
use candle_amp::nn::{self, Linear};
use candle_amp::{autocast, AmpModule, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

struct Residual<M> {
    inner: M,
}

#[autocast]
impl<M: AmpModule> Residual<M> {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        Ok((x + x.apply(&self.inner)?)?)
    }
}

struct Net {
    blocks: Vec<Box<dyn AmpModule>>,
}

#[autocast(bf16)]
impl Net {
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for b in &self.blocks {
            h = b.forward(&h)?;
        }
        // The last block is a `Linear`: lower precision. (A residual add of an f32 input and a
        // bf16 branch promotes to f32, as in PyTorch.)
        assert_eq!(h.dtype(), DType::BF16);
        Ok(h)
    }
}

fn main() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let net = Net {
        blocks: vec![
            Box::new(Residual { inner: nn::linear(3, 3, vb.pp("a"))? }),
            Box::new(Residual { inner: Residual { inner: nn::linear(3, 3, vb.pp("b"))? } }),
            Box::new(nn::linear(3, 3, vb.pp("c"))?) as Box<dyn AmpModule>,
        ],
    };
    let _: &Linear = &nn::linear(3, 3, vb.pp("d"))?;
    let x = Tensor::<F32>::ones((2, 3), &Device::Cpu)?;
    assert_eq!(net.forward(&x)?.dtype(), DType::F32);
    Ok(())
}
