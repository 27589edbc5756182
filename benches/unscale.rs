//! The fused gradient unscale (`kernels::unscale::unscale_in_place`, one multi-threaded pass
//! over every gradient) against a plain memcpy of the same bytes and against the naive
//! per-tensor candle-ops version. Run with `cargo bench --bench unscale`; criterion prints
//! GB/s for each, measured side by side in one run.
//!
//! The gradient set is shaped like a stack of MLP blocks: a few large matrices and many small
//! vectors, 31.7M f32 values (127 MB, four times this machine's 32 MiB L3), so both sides
//! stream from memory.

use candle_amp::kernels::unscale::{naive_unscale, unscale_in_place};
use candle_core::{Device, Tensor};
use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use std::hint::black_box;

fn gradients() -> Vec<Tensor> {
    let mut shapes: Vec<Vec<usize>> = Vec::new();
    for _ in 0..4 {
        shapes.extend([vec![2048, 2048], vec![2048], vec![2048, 1536], vec![1536]]);
        shapes.extend([vec![256, 256], vec![256], vec![256], vec![256]]);
    }
    shapes.extend([vec![4096, 512], vec![4096], vec![512]]);
    shapes
        .iter()
        .map(|s| Tensor::randn(0f32, 1.0, s.as_slice(), &Device::Cpu).unwrap())
        .collect()
}

fn unscale(c: &mut Criterion) {
    let mut grads = gradients();
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
