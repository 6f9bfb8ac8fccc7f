//! Prefill attention at depth: `NEW` queries after `PAST` cached keys on Qwen3.5-35B-A3B's attention
//! shape (16 query heads, 2 KV heads, head dim 256, f32 KV in 256-token pages), three runs, seconds and
//! GFLOP/s (4·NEW·(PAST + NEW/2)·heads·head_dim flops). What a turn of a long conversation pays per
//! attention layer for its new tokens (docs/benchmarks.md, issue 53).
//!
//! Run: `cargo run --release -p osprey-kernels --example attention_depth -- 463 57000`

use osprey_kernels::attention::{causal_attention_paged, AttnShape, PagedKv};

fn main() {
    let args: Vec<usize> = std::env::args().skip(1).filter_map(|a| a.parse().ok()).collect();
    let [n, past] = args[..] else {
        eprintln!("usage: attention_depth NEW PAST");
        std::process::exit(2);
    };
    let s = AttnShape { heads: 16, kv_heads: 2, head_dim: 256 };
    let (page, row) = (256, s.kv_heads * s.head_dim);
    let t = n + past;
    let val = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
    let q: Vec<f32> = (0..n * s.heads * s.head_dim).map(val).collect();
    let pages: Vec<Vec<f32>> =
        (0..t.div_ceil(page)).map(|p| (0..page * row).map(|i| val(i + p * 7)).collect()).collect();
    let refs: Vec<&[f32]> = pages.iter().map(|p| p.as_slice()).collect();
    let mut out = vec![0f32; q.len()];
    let flop = 4.0 * n as f64 * (past as f64 + n as f64 / 2.0) * (s.heads * s.head_dim) as f64;
    for _ in 0..3 {
        let t0 = std::time::Instant::now();
        causal_attention_paged(&q, PagedKv { k: &refs, v: &refs, page }, past, s, 0.0625, &mut out);
        let dt = t0.elapsed().as_secs_f64();
        println!("new {n} past {past}: {dt:.3} s, {:.1} GFLOP/s", flop / dt / 1e9);
    }
}
