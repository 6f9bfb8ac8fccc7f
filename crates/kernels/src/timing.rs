//! Kernel timings as ignored tests (the numbers in docs/benchmarks.md's "int8 GEMM" section):
//! `cargo test -p osprey-kernels --release timing -- --ignored --nocapture --test-threads=1`.
//! Not assertions: speed targets live in benchmarks, never in tests.

use crate::q8_gemm::{gemm, quantize_rows};
use crate::{matmul_with, Precision, WeightView};

/// A seeded NVFP4 `n × k` matrix (any codes, e4m3 block scales 0.5 .. 1.875), another per `seed`.
fn nvfp4(n: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<u8>) {
    let packed = (0..n * k / 2).map(|i| ((i * 131 + seed) % 256) as u8).collect();
    let scales = (0..n * k / 16).map(|i| 0x30 + ((i + seed) % 16) as u8).collect();
    (packed, scales)
}

mod gemm_vs {
    use super::*;

    #[test]
    #[ignore]
    fn against_the_dot_path() {
        for (n, k) in [(512, 2048), (2048, 512)] {
            let (packed, scales) = nvfp4(n, k, 0);
            let view = WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.01 };
            for m in [1usize, 2, 3, 4, 6, 8] {
                let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
                let mut out = vec![0f32; m * n];
                let reps = 300;
                // Under the bf16 ceiling the int8 dot path takes up to 8 rows.
                crate::set_gemm_ceiling(crate::Gemm::Bf16);
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    matmul_with(&x, m, view, n, k, &mut out, Precision::Int8);
                }
                let dot = t.elapsed().as_secs_f64() / reps as f64;
                crate::set_gemm_ceiling(crate::Gemm::Amx);
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    gemm(&quantize_rows(&x, m, k), (&packed, &scales, 0.01), n, &mut out);
                }
                let q8 = t.elapsed().as_secs_f64() / reps as f64;
                let t = std::time::Instant::now();
                for _ in 0..reps {
                    crate::q8_gemv::gemv(&quantize_rows(&x, m, k), (&packed, &scales, 0.01), n, &mut out);
                }
                let gemv = t.elapsed().as_secs_f64() / reps as f64;
                eprintln!(
                    "n={n} k={k} m={m}: dot path {:.3} ms, int8 GEMM {:.3} ms, int8 GEMV {:.3} ms",
                    dot * 1e3,
                    q8 * 1e3,
                    gemv * 1e3
                );
            }
        }
    }

    #[test]
    #[ignore]
    fn against_bf16_tiles() {
        for (m, n, k) in [(512, 2048, 2048), (512, 512, 2048), (64, 512, 2048), (16, 512, 2048), (512, 2048, 512)] {
            let (packed, scales) = nvfp4(n, k, 0);
            let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
            let mut out = vec![0f32; m * n];
            let view = WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.01 };
            let reps = (2_000_000_000 / (m * n * k)).max(3);
            crate::set_gemm_ceiling(crate::Gemm::Bf16);
            let t = std::time::Instant::now();
            for _ in 0..reps {
                matmul_with(&x, m, view, n, k, &mut out, Precision::Int8);
            }
            let bf = t.elapsed().as_secs_f64() / reps as f64;
            crate::set_gemm_ceiling(crate::Gemm::Amx);
            let t = std::time::Instant::now();
            let mut tq = 0.0;
            for _ in 0..reps {
                let tq0 = std::time::Instant::now();
                let a = quantize_rows(&x, m, k);
                tq += tq0.elapsed().as_secs_f64();
                gemm(&a, (&packed, &scales, 0.01), n, &mut out);
            }
            let q8 = t.elapsed().as_secs_f64() / reps as f64;
            let gmac = |s: f64| (m * n * k) as f64 / s / 1e9;
            eprintln!(
                "m={m} n={n} k={k}: bf16 tiles {:.2} ms ({:.1} GMAC/s), int8 {:.2} ms ({:.1} GMAC/s, quantize {:.2} ms)",
                bf * 1e3,
                gmac(bf),
                q8 * 1e3,
                gmac(q8),
                tq / reps as f64 * 1e3
            );
        }
    }
}
mod bf16_weights {
    use super::*;
    #[test]
    #[ignore]
    fn bf16_weights() {
        for (m, n, k) in
            [(512, 2048, 2048), (64, 512, 2048), (512, 512, 2048), (16, 512, 2048), (16, 2048, 512), (1, 2048, 2048)]
        {
            let w: Vec<u16> = (0..n * k).map(|i| half::bf16::from_f32((i % 13) as f32 * 0.01).to_bits()).collect();
            let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
            let mut out = vec![0f32; m * n];
            let reps = (4_000_000_000 / (m * n * k)).max(3);
            let t = std::time::Instant::now();
            for _ in 0..reps {
                matmul_with(&x, m, WeightView::Bf16(&w), n, k, &mut out, Precision::Int8);
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            eprintln!("bf16 m={m} n={n} k={k}: {:.2} ms, {:.1} GMAC/s", s * 1e3, (m * n * k) as f64 / s / 1e9);
        }
    }
}
#[cfg(target_arch = "x86_64")]
mod peak {
    use std::arch::x86_64::*;
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16,avx512vnni")]
    unsafe fn run(iters: usize) -> (f64, f64) {
        unsafe {
            let a = std::mem::transmute::<__m512, __m512bh>(_mm512_set1_ps(1.0));
            let mut acc = [_mm512_setzero_ps(); 12];
            let t = std::time::Instant::now();
            for _ in 0..iters {
                for v in acc.iter_mut() {
                    *v = _mm512_dpbf16_ps(*v, a, a);
                }
            }
            let bf = t.elapsed().as_secs_f64();
            std::hint::black_box(acc);
            let ai = _mm512_set1_epi8(1);
            let mut acci = [_mm512_setzero_si512(); 12];
            let t = std::time::Instant::now();
            for _ in 0..iters {
                for v in acci.iter_mut() {
                    *v = _mm512_dpbusd_epi32(*v, ai, ai);
                }
            }
            let q = t.elapsed().as_secs_f64();
            std::hint::black_box(acci);
            (bf, q)
        }
    }
    #[test]
    #[ignore]
    fn peak() {
        let iters = 100_000_000;
        let (bf, q) = unsafe { run(iters) };
        let n = (iters * 12) as f64;
        eprintln!(
            "vdpbf16ps: {:.2} G/s ({:.1} GMAC/s); vpdpbusd: {:.2} G/s ({:.1} GMAC/s)",
            n / bf / 1e9,
            n * 32.0 / bf / 1e9,
            n / q / 1e9,
            n * 64.0 / q / 1e9
        );
    }
}
/// The bf16 tiles alone on one thread (no pool, no rounding): what the kernel reaches by itself.
mod tile_only {
    #[test]
    #[ignore]
    fn tile_only() {
        use crate::bf16::{gemm_nt, round, Rows};
        for (m, n, k) in [(512, 64, 2048), (16, 64, 2048), (16, 64, 512), (512, 66, 2048), (12, 66, 2048)] {
            let a: Vec<u16> = (0..m * k).map(|i| round((i % 17) as f32 * 0.01 - 0.08)).collect();
            let b: Vec<u16> = (0..n * k).map(|i| round((i % 13) as f32 * 0.01)).collect();
            let mut out = vec![0f32; m * n];
            let reps = (2_000_000_000 / (m * n * k)).max(3);
            let t = std::time::Instant::now();
            for _ in 0..reps {
                gemm_nt(Rows { data: &a, rows: m }, Rows { data: &b, rows: n }, k, 1.0, &mut out, (n, 1));
            }
            let s = t.elapsed().as_secs_f64() / reps as f64;
            eprintln!("tile m={m} n={n} k={k}: {:.3} ms, {:.1} GMAC/s", s * 1e3, (m * n * k) as f64 / s / 1e9);
        }
    }
}
/// Routed-expert shapes on bf16 tiles with weights read cold from DRAM (96 distinct matrices, 192 MiB,
/// past the L3, as a prefill chunk's experts are) against one matrix read again and again (warm).
mod cold_experts {
    use super::*;
    #[test]
    #[ignore]
    fn cold_experts() {
        for (m, n, k) in
            [(16usize, 512usize, 2048usize), (16, 2048, 512), (32, 512, 2048), (1, 2048, 2048), (1, 512, 2048)]
        {
            let ws: Vec<Vec<u16>> = (0..96)
                .map(|e| (0..n * k).map(|i| half::bf16::from_f32(((i + e) % 13) as f32 * 0.01).to_bits()).collect())
                .collect();
            let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
            let mut out = vec![0f32; m * n];
            for cold in [false, true] {
                let t = std::time::Instant::now();
                for r in 0..3 * ws.len() {
                    let w = if cold { &ws[r % ws.len()] } else { &ws[0] };
                    matmul_with(&x, m, WeightView::Bf16(w), n, k, &mut out, Precision::Int8);
                }
                let s = t.elapsed().as_secs_f64() / (3 * ws.len()) as f64;
                eprintln!(
                    "m={m} n={n} k={k} cold={cold}: {:.3} ms, {:.1} GMAC/s",
                    s * 1e3,
                    (m * n * k) as f64 / s / 1e9
                );
            }
        }
    }
}

/// NVFP4 decode (one row, the int8 dot path) with weights read cold from DRAM (128 distinct matrices,
/// 74 MiB, past the L3) against one matrix read again and again.
mod cold_nvfp4_gemv {
    use super::*;
    #[test]
    #[ignore]
    fn cold_nvfp4_gemv() {
        for (n, k) in [(512usize, 2048usize), (2048, 512), (8192, 2048)] {
            let count = (128 * 512 * 2048 / (n * k)).max(8);
            let mats: Vec<(Vec<u8>, Vec<u8>)> = (0..count).map(|e| nvfp4(n, k, e)).collect();
            let x: Vec<f32> = (0..k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
            let mut out = vec![0f32; n];
            for cold in [false, true] {
                let reps = 3 * mats.len();
                let t = std::time::Instant::now();
                for r in 0..reps {
                    let (p, s) = if cold { &mats[r % mats.len()] } else { &mats[0] };
                    let view = WeightView::Nvfp4 { packed: p, scales: s, global: 0.01 };
                    matmul_with(&x, 1, view, n, k, &mut out, Precision::Int8);
                }
                let s = t.elapsed().as_secs_f64() / reps as f64;
                let gb = (n * k) as f64 * 9.0 / 16.0 / s / 1e9;
                eprintln!("nvfp4 1 x {n} x {k} cold={cold}: {:.3} ms, {gb:.1} GB/s of weights", s * 1e3);
            }
        }
    }
}

/// Every prefill GEMM this CPU has, per weight class, on a dense projection and routed-expert shapes
/// (issue 54: AMX tiles against their AVX-512 counterparts), best of 5 after a warm-up.
mod each_gemm {
    use crate::dispatch::{available, kernel_name, Gemm, WeightClass};
    use crate::matmul::run_gemm;
    use crate::WeightView;

    use super::nvfp4;

    #[test]
    #[ignore]
    fn each_gemm() {
        for (m, n, k) in
            [(512, 2048, 2048), (128, 1024, 2048), (32, 512, 2048), (32, 2048, 512), (16, 512, 2048), (1, 512, 2048)]
        {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
            let (packed, scales) = nvfp4(n, k, 0);
            let wb: Vec<u16> =
                (0..n * k).map(|i| crate::bf16::round(((i * 104729 % 89) as f32 / 89.0) - 0.5)).collect();
            let mut out = vec![0f32; m * n];
            for class in WeightClass::ALL {
                let w = match class {
                    WeightClass::Nvfp4 => WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.01 },
                    WeightClass::Bf16 => WeightView::Bf16(&wb),
                };
                let mut line = format!("{} m={m} n={n} k={k}:", class.name());
                for g in Gemm::ALL.into_iter().filter(|&g| available(class, g)) {
                    run_gemm(g, &x, m, w, n, k, &mut out);
                    let s = (0..5)
                        .map(|_| {
                            let t = std::time::Instant::now();
                            run_gemm(g, &x, m, w, n, k, &mut out);
                            t.elapsed().as_secs_f64()
                        })
                        .fold(f64::INFINITY, f64::min);
                    let gmac = (m * n * k) as f64 / s / 1e9;
                    line += &format!(" {} {:.3} ms ({gmac:.0} GMAC/s);", kernel_name(class, g), s * 1e3);
                }
                eprintln!("{line}");
            }
        }
    }
}

/// The chunked delta rule at Qwen3.5-35B-A3B's shapes (16 key heads, 32 value heads, 128 × 128), one
/// 512-token prefill chunk: what one Gated DeltaNet layer's mix costs.
mod gdn_chunked {
    use crate::gdn::{gated_delta_chunked, DeltaInputs, GdnShape};

    #[test]
    #[ignore]
    fn gdn_chunked() {
        let s = GdnShape { nk: 16, nv: 32, dk: 128, dv: 128 };
        // Mild decays, and a fast-forgetting head's (exp(-3) a token: denormals inside a chunk).
        for (n, decay) in [(512usize, 0.1f32), (64, 0.1), (512, 3.0)] {
            let f = |i: usize, m: usize| ((i * 7919 % m) as f32 / m as f32) - 0.5;
            let mut q: Vec<f32> = (0..n * s.nk * s.dk).map(|i| f(i, 97)).collect();
            let mut k: Vec<f32> = (0..n * s.nk * s.dk).map(|i| f(i, 89)).collect();
            crate::norm::l2_norm(&mut q, s.dk, 1e-6);
            crate::norm::l2_norm(&mut k, s.dk, 1e-6);
            let v: Vec<f32> = (0..n * s.nv * s.dv).map(|i| f(i, 83)).collect();
            let g: Vec<f32> = (0..n * s.nv).map(|i| -decay - f(i, 13).abs() * 0.2).collect();
            let beta: Vec<f32> = (0..n * s.nv).map(|i| 0.5 + f(i, 11)).collect();
            let inp = DeltaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            let mut st = vec![0f32; s.state_len()];
            let mut out = vec![0f32; n * s.nv * s.dv];
            gated_delta_chunked(s, inp, &mut st, &mut out);
            let best = (0..5)
                .map(|_| {
                    let t = std::time::Instant::now();
                    gated_delta_chunked(s, inp, &mut st, &mut out);
                    t.elapsed().as_secs_f64()
                })
                .fold(f64::INFINITY, f64::min);
            eprintln!("gdn chunked n={n} decay {decay}: {:.2} ms", best * 1e3);
        }
    }
}

/// A batch of decodes' routed experts (issue 54 item 4): 4 layers × 58 distinct NVFP4 experts of
/// Qwen3.5-35B-A3B's shapes (410 MiB, read cold as a decode step reads them), one activation row each:
/// the dot path (a pair, then the down projection), the int8 GEMV, and the same bytes read in the same
/// 64-row blocks with no arithmetic (what the layout allows).
mod expert_wave {
    use crate::matmul_pair_with;

    use super::*;

    #[test]
    #[ignore]
    fn expert_wave() {
        let (h, f, per_layer, layers) = (2048usize, 512usize, 58usize, 4usize);
        let experts: Vec<[(Vec<u8>, Vec<u8>); 3]> = (0..per_layer * layers)
            .map(|e| [nvfp4(f, h, 3 * e), nvfp4(f, h, 3 * e + 1), nvfp4(h, f, 3 * e + 2)])
            .collect();
        fn view(m: &(Vec<u8>, Vec<u8>)) -> WeightView<'_> {
            WeightView::Nvfp4 { packed: &m.0, scales: &m.1, global: 0.01 }
        }
        let x: Vec<f32> = (0..h).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
        let xf: Vec<f32> = (0..f).map(|i| (i % 13) as f32 * 0.01 - 0.06).collect();
        let bytes = (experts.len() * 3 * f * h) as f64 * 9.0 / 16.0;
        let (mut g, mut u, mut d) = (vec![0f32; f], vec![0f32; f], vec![0f32; h]);
        for rep in 0..6 {
            let t = std::time::Instant::now();
            for e in &experts {
                matmul_pair_with(&x, 1, (view(&e[0]), view(&e[1])), f, h, (&mut g, &mut u), Precision::Int8);
                matmul_with(&xf, 1, view(&e[2]), h, f, &mut d, Precision::Int8);
            }
            let calls = t.elapsed().as_secs_f64();
            let t = std::time::Instant::now();
            if crate::q8_gemv::available() {
                let (a, af) = (quantize_rows(&x, 1, h), quantize_rows(&xf, 1, f));
                for e in &experts {
                    crate::q8_gemv::gemv(&a, (&e[0].0, &e[0].1, 0.01), f, &mut g);
                    crate::q8_gemv::gemv(&a, (&e[1].0, &e[1].1, 0.01), f, &mut u);
                    crate::q8_gemv::gemv(&af, (&e[2].0, &e[2].1, 0.01), h, &mut d);
                }
            }
            let gemv = t.elapsed().as_secs_f64();
            // Reading the same bytes in the same 64-row blocks with no arithmetic but a sum.
            let t = std::time::Instant::now();
            let mut total = 0u64;
            for e in &experts {
                for (mat, n, k) in [(&e[0], f, h), (&e[1], f, h), (&e[2], h, f)] {
                    let rows = crate::pool::map(n.div_ceil(64), |b| {
                        let (p, s) = (&mat.0[b * 64 * k / 2..((b + 1) * 64).min(n) * k / 2], &mat.1);
                        let s = &s[b * 64 * k / 16..((b + 1) * 64).min(n) * k / 16];
                        let words = |x: &[u8]| {
                            x.chunks_exact(8).fold(0u64, |a, c| a ^ u64::from_le_bytes(c.try_into().expect("8 bytes")))
                        };
                        words(p) ^ words(s)
                    });
                    total ^= rows.iter().fold(0, |a, b| a ^ b);
                }
            }
            std::hint::black_box(total);
            let read = t.elapsed().as_secs_f64();
            if rep > 0 {
                eprintln!("  read only {:.2} ms ({:.1} GB/s)", read * 1e3, bytes / read / 1e9);
                eprintln!("  gemv {:.2} ms ({:.1} GB/s)", gemv * 1e3, bytes / gemv / 1e9);
                eprintln!(
                    "{} experts, 1 row: dot path {:.2} ms ({:.1} GB/s)",
                    experts.len(),
                    calls * 1e3,
                    bytes / calls / 1e9,
                );
            }
        }
    }
}

/// A batch of decodes' dense projections (issue 54 item 4): NVFP4 matrices of Qwen3.5-35B-A3B's shapes
/// at 1–16 rows, read cold (8 copies rotated), on the per-row dot path, the int8 GEMM and AMX tiles.
mod dense_rows {
    use crate::dispatch::Gemm;
    use crate::matmul::run_gemm;

    use super::*;

    #[test]
    #[ignore]
    fn dense_rows() {
        for (n, k) in [(8192usize, 2048usize), (2048, 4096), (32768, 2048)] {
            let mats: Vec<(Vec<u8>, Vec<u8>)> = (0..8).map(|e| nvfp4(n, k, e)).collect();
            for m in [1usize, 2, 4, 8, 16] {
                let x: Vec<f32> = (0..m * k).map(|i| (i % 17) as f32 * 0.01 - 0.08).collect();
                let mut out = vec![0f32; m * n];
                let mut line = format!("{n}x{k} m={m}:");
                for (name, kind) in
                    [("dot", None), ("gemv", Some(Gemm::F32)), ("int8", Some(Gemm::Int8)), ("amx", Some(Gemm::Amx))]
                {
                    if (kind == Some(Gemm::Amx) && !crate::amx::available())
                        || (kind == Some(Gemm::F32) && !crate::q8_gemv::available())
                    {
                        continue;
                    }
                    let reps = 24;
                    let t = std::time::Instant::now();
                    for r in 0..reps {
                        let (p, s) = &mats[r % mats.len()];
                        let view = WeightView::Nvfp4 { packed: p, scales: s, global: 0.01 };
                        match kind {
                            None => {
                                crate::set_gemm_ceiling(Gemm::Bf16);
                                matmul_with(&x, m, view, n, k, &mut out, Precision::Int8);
                                crate::set_gemm_ceiling(Gemm::Amx);
                            }
                            // The int8 GEMV (under the F32 label: not a prefill kind).
                            Some(Gemm::F32) => {
                                crate::q8_gemv::gemv(&quantize_rows(&x, m, k), (p, s, 0.01), n, &mut out)
                            }
                            // The int8 GEMM's own kernel (the dispatch gives fewer than 16 rows to the GEMV).
                            Some(Gemm::Int8) => gemm(&quantize_rows(&x, m, k), (p, s, 0.01), n, &mut out),
                            Some(g) => run_gemm(g, &x, m, view, n, k, &mut out),
                        }
                    }
                    let s = t.elapsed().as_secs_f64() / reps as f64;
                    let gb = (n * k) as f64 * 9.0 / 16.0 / s / 1e9;
                    line += &format!(" {name} {:.3} ms ({gb:.1} GB/s)", s * 1e3);
                }
                eprintln!("{line}");
            }
        }
    }
}
