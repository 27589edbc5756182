//! What the typed layer costs over plain candle: an elided cast (`Tensor<F32>::cast::<F32>`)
//! against a candle handle clone, a real f32 -> f16 cast, and a `Linear` forward through the typed
//! API against candle-nn's `Linear` on the same weights. Run with `cargo bench --bench
//! cast_overhead`; compare the pairs side by side (same run, same machine).

use candle_amp::{nn, Tensor, F16, F32};
use candle_core::{DType, Device, Module, Var};
use criterion::{criterion_group, criterion_main, Criterion};
use std::hint::black_box;

fn casts(c: &mut Criterion) {
    let dev = Device::Cpu;
    let x = Tensor::<F32>::randn(0.0, 1.0, (256, 1024), &dev).unwrap();
    let mut g = c.benchmark_group("cast 256x1024");
    g.bench_function("candle clone", |b| {
        b.iter(|| black_box(x.as_candle().clone()));
    });
    g.bench_function("typed cast F32->F32 (elided)", |b| {
        b.iter(|| black_box(x.cast::<F32>().unwrap()));
    });
    g.bench_function("candle to_dtype f32->f16", |b| {
        b.iter(|| black_box(x.as_candle().to_dtype(DType::F16).unwrap()));
    });
    g.bench_function("typed cast F32->F16", |b| {
        b.iter(|| black_box(x.cast::<F16>().unwrap()));
    });
    g.finish();
}

fn linear(c: &mut Criterion) {
    let dev = Device::Cpu;
    let w = Var::randn(0f32, 0.05, (512, 512), &dev).unwrap();
    let bias = Var::zeros(512, DType::F32, &dev).unwrap();
    let typed = nn::Linear::new(w.clone(), Some(bias.clone())).unwrap();
    let plain = candle_nn::Linear::new(w.as_tensor().clone(), Some(bias.as_tensor().clone()));
    let x = Tensor::<F32>::randn(0.0, 1.0, (128, 512), &dev).unwrap();
    let mut g = c.benchmark_group("linear 128x512x512 f32");
    g.bench_function("candle-nn Linear", |b| {
        b.iter(|| black_box(plain.forward(x.as_candle()).unwrap()));
    });
    g.bench_function("candle-amp Linear", |b| {
        b.iter(|| black_box(typed.forward(&x).unwrap()));
    });
    g.finish();
}

criterion_group!(benches, casts, linear);
criterion_main!(benches);
