//! The fused gradient unscale (`kernels::unscale::unscale_in_place`, one multi-threaded pass
//! over every gradient) against a plain memcpy of the same bytes and against the naive
//! per-tensor candle-ops version. Run with `cargo bench --bench unscale`; criterion prints
//! GB/s for each, measured side by side in one run.
//!
//! The gradient set is `fixtures::unscale_gradients` (127 MB, larger than the caches), so both
//! sides stream from memory.

mod fixtures;

use candle_amp::kernels::unscale::{naive_unscale, unscale_in_place};
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

fn unscale(c: &mut Criterion) {
    let mut grads = fixtures::unscale_gradients(&Device::Cpu).unwrap();
    let mut naive = grads.clone();
    let n: usize = grads.iter().map(Tensor::elem_count).sum();
    let src = vec![1.0f32; n];
    let mut dst = vec![0.0f32; n];
    let mut g = c.benchmark_group(format!("unscale {} tensors, {n} f32", grads.len()));
    g.throughput(Throughput::Bytes((n * 4) as u64));
    g.bench_function("memcpy", |b| {
        b.iter(|| dst.copy_from_slice(black_box(&src)));
    });
    // inv_scale 1: the same work as any other factor, and the values stay put across iterations.
    g.bench_function("fused", |b| {
        b.iter(|| black_box(unscale_in_place(&mut grads, 1.0).unwrap()));
    });
    g.bench_function("naive candle ops", |b| {
        b.iter(|| black_box(naive_unscale(&mut naive, 1.0).unwrap()));
    });
    g.finish();
}

criterion_group!(benches, unscale);
criterion_main!(benches);
