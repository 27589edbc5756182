//! Zero cost of `#[autocast]`: a 3-layer MLP forward (batch 64, width 512) annotated with
//! `#[autocast(fp16)]`, against the same forward hand-written with the typed tensors (cast the
//! input, each weight and bias once, f16 matmuls, cast back): the same kernels on both sides. Both perform 8 casts. Run with
//! `cargo bench --bench autocast_overhead`; compare the two times of one run.

mod fixtures;

use candle_amp::{Tensor, F32};
use candle_core::{DType, Device};
use candle_nn::{VarBuilder, VarMap};
use criterion::{criterion_group, criterion_main, Criterion};
use fixtures::Mlp;
use std::hint::black_box;

fn mlp_forward(c: &mut Criterion) {
    let dev = Device::Cpu;
    let vars = VarMap::new();
    let mlp = Mlp::new(512, &VarBuilder::from_varmap(&vars, DType::F32, &dev)).unwrap();
    let x = Tensor::<F32>::randn(0.0, 1.0, (64, 512), &dev).unwrap();
    let mut g = c.benchmark_group("mlp 3x512 batch 64, fp16 forward");
    g.bench_function("hand-written", |b| {
        b.iter(|| black_box(mlp.forward_by_hand(&x).unwrap()));
    });
    g.bench_function("#[autocast(fp16)]", |b| {
        b.iter(|| black_box(mlp.forward(&x).unwrap()));
    });
    g.finish();
}

criterion_group!(benches, mlp_forward);
criterion_main!(benches);
