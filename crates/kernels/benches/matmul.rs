//! Weight-streaming matmul microbenchmarks: throughput in weight bytes per second for the decode (GEMV)
//! and prefill (GEMM) paths, per weight format, on Qwen3.5-35B-A3B expert and attention shapes.
//! Run: `cargo bench -p osprey-kernels` (compare with `osprey bench membw` in the same session).

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use osprey_kernels::{matmul, WeightView};

/// (name, out features, in features): expert gate/up, expert down, attention q (with gate).
const SHAPES: [(&str, usize, usize); 3] =
    [("expert_gate_up_512x2048", 512, 2048), ("expert_down_2048x512", 2048, 512), ("attn_q_8192x2048", 8192, 2048)];

fn bench(c: &mut Criterion) {
    for &(name, n, k) in &SHAPES {
        let f32w: Vec<f32> = (0..n * k).map(|i| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3).collect();
        let bf16w: Vec<u16> = f32w.iter().map(|v| half::bf16::from_f32(*v).to_bits()).collect();
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
        let formats: [(&str, WeightView<'_>, usize); 3] = [
            ("f32", WeightView::F32(&f32w), n * k * 4),
            ("bf16", WeightView::Bf16(&bf16w), n * k * 2),
            ("nvfp4", WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.01 }, n * k / 2 + n * k / 16),
        ];
        for m in [1usize, 64] {
            let mut g = c.benchmark_group(format!("{name}/rows{m}"));
            g.sample_size(20);
            let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01).collect();
            let mut out = vec![0f32; m * n];
            for (fmt, view, bytes) in formats {
                g.throughput(Throughput::Bytes(bytes as u64));
                g.bench_with_input(BenchmarkId::from_parameter(fmt), &view, |b, v| {
                    b.iter(|| matmul(&x, m, *v, n, k, &mut out))
                });
            }
            g.finish();
        }
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
