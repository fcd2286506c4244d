//! One linear layer's product, `x [m, k] · wᵀ` with `w [n, k]` f32: Weft's packed
//! CPU GEMM against MLX's matmul (evaluated), both warm, at decode-sized and
//! prefill-sized row counts, on SmolLM2-135M's shapes.
//!
//! MLX's matmul goes to whatever `cblas_sgemm` the process resolves first; the
//! mlx-cpu wheel links the reference BLAS, so compare against OpenBLAS as
//! `weft` runs it:
//!   LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \
//!     cargo bench -p weft-models --bench gemm
//! A warm benchmark keeps the weights in cache where they fit (L3 here: 32 MB),
//! which favours BLAS's per-call packing; the model-wide pass, where each step
//! streams 540 MB of weights, is `examples/decode_timing.rs`.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use mlx_rs::{ops, Array};
use weft_models::cpu_gemm::PackedWeight;

fn values(len: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
        .collect()
}

fn bench(c: &mut Criterion) {
    // (out, in): fused gate/up, down, the tied output head.
    for (n, k) in [(3072usize, 576usize), (576, 1536), (49152, 576)] {
        let mut g = c.benchmark_group(format!("linear_{n}x{k}"));
        let w = values(n * k);
        let packed = PackedWeight::pack(&w, n, k);
        let wm = Array::from_slice(&w, &[n as i32, k as i32]);
        for m in [1usize, 8, 32, 256] {
            if n * m > 49152 * 32 {
                continue;
            }
            g.throughput(Throughput::Elements((m * n * k) as u64));
            let x = values(m * k);
            let mut y = vec![0f32; m * n];
            g.bench_with_input(BenchmarkId::new("packed", m), &m, |b, &m| {
                b.iter(|| packed.matmul(&x, m, &mut y))
            });
            let xm = Array::from_slice(&x, &[m as i32, k as i32]);
            g.bench_with_input(BenchmarkId::new("mlx", m), &m, |b, _| {
                b.iter(|| {
                    let out = ops::matmul(&xm, wm.t()).expect("matmul");
                    out.eval().expect("eval");
                    out
                })
            });
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
