//! Zero cost of `#[autocast]`: a 3-layer MLP forward (batch 64, width 512) annotated with
//! `#[autocast(fp16)]`, against the same forward hand-written with raw candle calls (cast the
//! input, each weight and bias once, f16 matmuls, cast back). Both perform 8 casts. Run with
//! `cargo bench --bench autocast_overhead`; compare the two times of one run.

use candle_amp::nn::{self, Linear};
use candle_amp::{autocast, Tensor, F32};
use candle_core::{DType, Device, Result};
use candle_nn::{VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

struct Mlp {
    layers: Vec<Linear>,
}

impl Mlp {
    #[autocast(fp16)]
    fn forward(&self, x: &Tensor<F32>) -> Result<Tensor<F32>> {
        let mut h = x.clone();
        for (i, layer) in self.layers.iter().enumerate() {
            h = layer.forward(&h)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        Ok(h)
    }

    fn forward_by_hand(&self, x: &candle_core::Tensor) -> Result<candle_core::Tensor> {
        let mut h = x.to_dtype(DType::F16)?;
        for (i, layer) in self.layers.iter().enumerate() {
            let w = layer.weight().as_tensor().to_dtype(DType::F16)?;
            let b = layer.bias().unwrap().as_tensor().to_dtype(DType::F16)?;
            h = h.matmul(&w.t()?)?.broadcast_add(&b)?;
            if i + 1 < self.layers.len() {
                h = h.relu()?;
            }
        }
        h.to_dtype(DType::F32)
    }
}

fn mlp_forward(c: &mut Criterion) {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let vb = VarBuilder::from_varmap(&vars, DType::F32, &dev);
    let layers = (0..3)
        .map(|i| nn::linear(512, 512, vb.pp(format!("l{i}"))))
        .collect::<Result<_>>()
        .unwrap();
    let mlp = Mlp { layers };
    let x = Tensor::<F32>::randn(0.0, 1.0, (64, 512), &dev).unwrap();
    let mut g = c.benchmark_group("mlp 3x512 batch 64, fp16 forward");
    g.bench_function("hand-written candle", |b| {
        b.iter(|| black_box(mlp.forward_by_hand(x.as_candle()).unwrap()));
    });
    g.bench_function("#[autocast(fp16)]", |b| {
        b.iter(|| black_box(mlp.forward(&x).unwrap()));
    });
    g.finish();
}

criterion_group!(benches, mlp_forward);
criterion_main!(benches);
