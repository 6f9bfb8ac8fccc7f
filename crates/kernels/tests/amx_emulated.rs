//! The AMX tile kernels on odd shapes, on any CPU: this binary runs its tile instructions in software
//! (`amx::init_emulated`, `src/amx/emu.rs`: the instructions as Intel's reference defines them), so every
//! blocking, packing, padding and indexing decision of the kernels is checked here against scalar
//! references — rows not multiples of 16 or 32, widths not multiples of 32 or 64, one block, many — both
//! called directly and chosen by the matmul dispatch from 16 rows. What needs an AMX machine is the
//! hardware alone (the same kernels with the real instructions: `amx::{bf16,int8}` unit tests there).

use osprey_kernels::amx::{self, Status};
use osprey_kernels::q8_gemm::{quantize_rows, reference_bound, reference_with_magnitude};
use osprey_kernels::{matmul_with, Gemm, Precision, WeightView};

fn bf16_value(b: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(b) << 16))
}

fn acts(m: usize, k: usize) -> Vec<f32> {
    (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 48.5) - 1.0).collect()
}

/// NVFP4 codes and block scales of `n × k` (scales of several binades, including subnormal e4m3).
fn nvfp4(n: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<u8>) {
    let packed = (0..n * k / 2).map(|i| ((i * 131 + seed) % 256) as u8).collect();
    let scales = (0..n * k / 16).map(|i| [0x38, 0x30, 0x41, 0x05, 0x7E, 0x01][i % 6]).collect();
    (packed, scales)
}

#[test]
fn the_tile_kernels_compute_odd_shapes_right_with_the_instructions_in_software() {
    assert_eq!(amx::init_emulated(), Status::Emulated, "this binary decides the status first");
    assert!(amx::available());
    assert!(osprey_kernels::prefill_kernels().contains("amx-int8 tiles"), "{}", osprey_kernels::prefill_kernels());

    // AMX-BF16: bf16 weights against an f64 sum of the same bf16 values (k exact products of magnitude
    // <= 1 summed in f32: within 1e-5·√k of it, relative to 1).
    for (m, n, k) in [(1, 1, 2), (5, 17, 48), (17, 33, 100), (33, 70, 128), (40, 64, 2048), (16, 16, 31)] {
        let x = acts(m, k);
        let wb: Vec<u16> =
            (0..n * k).map(|i| osprey_kernels::bf16::round(((i * 104729 % 89) as f32 / 89.0) - 0.5)).collect();
        let mut got = vec![f32::NAN; m * n];
        amx::bf16::gemm(&x, m, WeightView::Bf16(&wb), n, k, &mut got);
        for i in 0..m {
            for r in 0..n {
                let want: f64 = (0..k)
                    .map(|c| bf16_value(osprey_kernels::bf16::round(x[i * k + c])) * bf16_value(wb[r * k + c]))
                    .sum();
                let g = f64::from(got[i * n + r]);
                let tol = 1e-5 * (k as f64).sqrt().max(1.0) * want.abs().max(1.0);
                assert!((g - want).abs() < tol, "bf16 m={m} n={n} k={k} ({i},{r}): {g} vs {want}");
            }
        }
    }

    // AMX-INT8: NVFP4 weights against the same integers summed in f64, within f32's rounding of the block
    // terms (`q8_gemm::reference_with_magnitude`).
    for (m, n, k) in [(1, 1, 16), (5, 17, 48), (17, 33, 96), (33, 70, 128), (40, 16, 2048)] {
        let (packed, scales) = nvfp4(n, k, m);
        let a = quantize_rows(&acts(m, k), m, k);
        let want = reference_with_magnitude(&a, (&packed, &scales, 0.75), n);
        let mut got = vec![f32::NAN; m * n];
        amx::int8::gemm(&a, (&packed, &scales, 0.75), n, &mut got);
        for (idx, (g, (w, mag))) in got.iter().zip(&want).enumerate() {
            let tol = reference_bound(k, *mag);
            assert!((f64::from(*g) - w).abs() <= tol, "int8 m={m} n={n} k={k} [{idx}]: {g} vs {w} (bound {tol})");
        }
    }

    // Through the dispatch (AMX from 16 rows, on the pool's threads, each loading its configuration):
    // the references above, and where the CPU has the kernel ranked below the tiles at the same precision
    // (the int8 GEMM for NVFP4; the bf16 tiles for bf16), the same numbers as it up to the order of float
    // additions. (Without AVX512-BF16 the ceiling below for bf16 weights is sgemm on f32 activations,
    // another precision, so there the reference alone is the check.)
    for (m, n, k) in [(16, 17, 64), (37, 70, 256), (64, 33, 2048)] {
        let x = acts(m, k);
        let (packed, scales) = nvfp4(n, k, 7);
        let bf: Vec<u16> =
            (0..n * k).map(|i| osprey_kernels::bf16::round(((i * 7 % 13) as f32) / 13.0 - 0.5)).collect();
        for w in [WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.5 }, WeightView::Bf16(&bf)] {
            let mut tiles = vec![0f32; m * n];
            matmul_with(&x, m, w, n, k, &mut tiles, Precision::Int8);
            if let WeightView::Nvfp4 { .. } = w {
                let want = reference_with_magnitude(&quantize_rows(&x, m, k), (&packed, &scales, 0.5), n);
                for (i, (g, (v, mag))) in tiles.iter().zip(&want).enumerate() {
                    let tol = reference_bound(k, *mag);
                    assert!((f64::from(*g) - v).abs() <= tol, "dispatch int8 m={m} n={n} k={k} [{i}]: {g} vs {v}");
                }
            } else {
                for (i, g) in tiles.iter().enumerate() {
                    let (row, col) = (i / n, i % n);
                    let want: f64 = (0..k)
                        .map(|c| bf16_value(osprey_kernels::bf16::round(x[row * k + c])) * bf16_value(bf[col * k + c]))
                        .sum();
                    let tol = 1e-5 * (k as f64).sqrt() * want.abs().max(1.0);
                    assert!((f64::from(*g) - want).abs() < tol, "dispatch bf16 m={m} n={n} k={k} [{i}]: {g} vs {want}");
                }
            }
            // The kernel one rank below the tiles for these weights: the int8 GEMM (AVX-512 VNNI or
            // AVX2) for NVFP4, the bf16 tiles (AVX512-BF16) for bf16.
            let below = match w {
                WeightView::Nvfp4 { .. } => osprey_kernels::q8_gemm::available(),
                _ => osprey_kernels::bf16::available(),
            };
            if !below {
                continue;
            }
            osprey_kernels::set_gemm_ceiling(Gemm::Int8);
            let mut avx512 = vec![0f32; m * n];
            matmul_with(&x, m, w, n, k, &mut avx512, Precision::Int8);
            osprey_kernels::set_gemm_ceiling(Gemm::Amx);
            let scale = avx512.iter().fold(0f32, |a, v| a.max(v.abs())).max(1.0);
            for (i, (t, v)) in tiles.iter().zip(&avx512).enumerate() {
                assert!(
                    (t - v).abs() <= 1e-5 * scale * (k as f32).sqrt(),
                    "dispatch m={m} n={n} k={k} [{i}]: {t} vs {v}"
                );
            }
            assert!(tiles != avx512 || matches!(w, WeightView::Nvfp4 { .. }), "the tiles ran (another order)");
        }
    }
}
