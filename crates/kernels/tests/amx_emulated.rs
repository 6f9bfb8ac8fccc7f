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

/// `n × k` NVFP4 weights as exact values (global scale 1).
fn dequant(packed: &[u8], scales: &[u8], n: usize, k: usize) -> Vec<f64> {
    let mut row = vec![0f32; k];
    let mut all = Vec::with_capacity(n * k);
    for r in 0..n {
        let (p, s) = (&packed[r * k / 2..(r + 1) * k / 2], &scales[r * k / 16..(r + 1) * k / 16]);
        osprey_kernels::nvfp4::dequant_row(p, s, 1.0, &mut row);
        all.extend(row.iter().map(|&v| f64::from(v)));
    }
    all
}

/// `got` (`m × n`) against the f64 sums of the activations rounded to bf16 times the weights `wf`
/// (`n × k`): k exact products summed in f32, within 1e-5·√k relative to max(|sum|, 1).
fn check_against_rounded_acts(got: &[f32], x: &[f32], wf: &[f64], (m, n, k): (usize, usize, usize), what: &str) {
    for i in 0..m {
        for r in 0..n {
            let want: f64 = (0..k).map(|c| bf16_value(osprey_kernels::bf16::round(x[i * k + c])) * wf[r * k + c]).sum();
            let g = f64::from(got[i * n + r]);
            let tol = 1e-5 * (k as f64).sqrt().max(1.0) * want.abs().max(1.0);
            assert!((g - want).abs() < tol, "{what} m={m} n={n} k={k} ({i},{r}): {g} vs {want}");
        }
    }
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
    let kernels = osprey_kernels::prefill_kernels();
    assert!(kernels.contains("nvfp4 amx-bf16 tiles") && kernels.contains("bf16 amx-bf16 tiles"), "{kernels}");

    // AMX-BF16: bf16 weights, and NVFP4 weights decoded into bf16, against an f64 sum of the rounded
    // activations times the exact weights (k exact products of magnitude <= 1 summed in f32: within
    // 1e-5·√k of it, relative to 1).
    for (m, n, k) in [(1, 1, 2), (5, 17, 48), (17, 33, 100), (33, 70, 128), (40, 64, 2048), (16, 16, 31), (48, 96, 64)]
    {
        let x = acts(m, k);
        let wb: Vec<u16> =
            (0..n * k).map(|i| osprey_kernels::bf16::round(((i * 104729 % 89) as f32 / 89.0) - 0.5)).collect();
        let wf: Vec<f64> = wb.iter().map(|&b| bf16_value(b)).collect();
        let (packed, scales) = nvfp4(n, k, m);
        let mut views = vec![(WeightView::Bf16(&wb), wf)];
        if k % 16 == 0 {
            views.push((
                WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.75 },
                dequant(&packed, &scales, n, k).iter().map(|v| v * 0.75).collect(),
            ));
        }
        for (w, wf) in views {
            let mut got = vec![f32::NAN; m * n];
            amx::bf16::gemm(&x, m, w, n, k, &mut got);
            check_against_rounded_acts(&got, &x, &wf, (m, n, k), "amx-bf16");
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
    // AMX-BF16 for both weight classes and, under its ceiling, AMX-INT8 for NVFP4, against the
    // references above and the kernel ranked below at the same precision.
    for (m, n, k) in [(16, 17, 64), (37, 70, 256), (64, 33, 2048)] {
        let x = acts(m, k);
        let (packed, scales) = nvfp4(n, k, 7);
        let bf: Vec<u16> =
            (0..n * k).map(|i| osprey_kernels::bf16::round(((i * 7 % 13) as f32) / 13.0 - 0.5)).collect();
        for w in [WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.5 }, WeightView::Bf16(&bf)] {
            let mut tiles = vec![0f32; m * n];
            matmul_with(&x, m, w, n, k, &mut tiles, Precision::Int8);
            let wf = match w {
                WeightView::Nvfp4 { .. } => dequant(&packed, &scales, n, k).iter().map(|v| v * 0.5).collect(),
                _ => bf.iter().map(|&b| bf16_value(b)).collect::<Vec<f64>>(),
            };
            check_against_rounded_acts(&tiles, &x, &wf, (m, n, k), "dispatch amx-bf16");
            if let WeightView::Nvfp4 { .. } = w {
                // Under the amx-int8 ceiling: the AMX-INT8 tiles, on int8 activations.
                osprey_kernels::set_gemm_ceiling(Gemm::AmxInt8);
                let mut int8 = vec![0f32; m * n];
                matmul_with(&x, m, w, n, k, &mut int8, Precision::Int8);
                osprey_kernels::set_gemm_ceiling(Gemm::Amx);
                let want = reference_with_magnitude(&quantize_rows(&x, m, k), (&packed, &scales, 0.5), n);
                for (i, (g, (v, mag))) in int8.iter().zip(&want).enumerate() {
                    let tol = reference_bound(k, *mag);
                    assert!((f64::from(*g) - v).abs() <= tol, "dispatch int8 m={m} n={n} k={k} [{i}]: {g} vs {v}");
                }
            }
            // The kernel below the tiles at the same precision, where the CPU has it: the bf16 tiles on
            // AVX512-BF16 (bf16 activations, NVFP4 decoded into bf16), the same numbers up to the order
            // of float additions. (Without AVX512-BF16 the ceiling below is another precision, so there
            // the reference alone is the check.)
            if !osprey_kernels::bf16::available() {
                continue;
            }
            osprey_kernels::set_gemm_ceiling(Gemm::Bf16);
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
            assert!(tiles != avx512, "the tiles ran (another order)");
        }
    }
}
