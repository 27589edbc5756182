//! `&mut self` modules called from regions: a KV cache in a field as region values, grown with
//! `Tensor::cat`; a stack walked with `iter_mut()`; a model held by `&mut` in a free region.
use candle_amp::nn::{self, Linear};
use candle_amp::{autocast, AmpTensor, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};

struct Cached {
    proj: Linear,
    cache: Option<AmpTensor>,
}

#[autocast]
impl Cached {
    fn forward(&mut self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let h = self.proj.forward(x)?;
        let all = match &self.cache {
            Some(past) => Tensor::cat(&[past, &h], 0)?,
            None => h,
        };
        self.cache = Some(all.clone());
        Ok(all.sum_keepdim(0)?)
    }
}

struct Model {
    layers: Vec<Cached>,
    head: Cached,
}

#[autocast]
impl Model {
    fn forward(&mut self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for layer in self.layers.iter_mut() {
            h = layer.forward(&h)?;
        }
        self.head.forward(&h)
    }
}

#[autocast(bf16)]
fn step(m: &mut Model, x: &Tensor<F32>) -> Result<Tensor<F32>> {
    m.forward(x)
}

fn main() -> Result<()> {
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &Device::Cpu);
    let cached = |name: &str| -> Result<Cached> {
        Ok(Cached { proj: nn::linear(4, 4, vb.pp(name))?, cache: None })
    };
    let mut m = Model { layers: vec![cached("a")?, cached("b")?], head: cached("head")? };
    let x = Tensor::<F32>::ones((1, 4), &Device::Cpu)?;
    step(&mut m, &x)?;
    step(&mut m, &x)?;
    assert_eq!(m.head.cache.as_ref().map(|c| c.dims().to_vec()), Some(vec![2, 4]));
    Ok(())
}
