//! The calibration chooses prefill GEMMs; it must not choose the decode kernels. On a Sapphire Rapids
//! without AMX it chose sgemm for bf16 prefill (a near tie at its shapes), and decode of bf16 weights
//! fell from the bf16 tiles to the f32 dot: 37.9 → 24.3 tok/s (docs/benchmarks.md). This binary applies
//! such a choice to its own process (the preference and the ceiling are process-wide: one test function)
//! and checks that one decode row computes the bits it computed before, on a CPU with bf16 tiles, and
//! that a choice per band of rows reaches the GEMMs of that band.

use osprey_kernels::calibrate::Calibration;
use osprey_kernels::{matmul_with, set_gemm_ceiling, Gemm, Precision, WeightView};

#[test]
fn the_calibration_reaches_its_band_of_rows_and_not_decode() {
    let (n, k) = (96, 256);
    let w: Vec<u16> = (0..n * k).map(|i| half::bf16::from_f32(((i * 7 % 13) as f32) / 13.0 - 0.5).to_bits()).collect();
    // Activations with bits below bf16's precision, so rounding them (the tiles) changes the sums.
    let x: Vec<f32> = (0..k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5 + 1e-4 * (i % 7) as f32).collect();
    let decode = || {
        let mut out = vec![0f32; n];
        matmul_with(&x, 1, WeightView::Bf16(&w), n, k, &mut out, Precision::Int8);
        out
    };
    let before = decode();
    let mut exact = vec![0f32; n];
    matmul_with(&x, 1, WeightView::Bf16(&w), n, k, &mut exact, Precision::Exact);
    if osprey_kernels::bf16::available() {
        // The test sees the tiles: their bf16-rounded activations give other bits than the f32 dot.
        assert!(before != exact, "one decode row on the bf16 tiles");
    } else {
        eprintln!("no AVX512-BF16: decode runs the f32 dot whatever the calibration chose");
    }
    Calibration::from_choices_line("nvfp4=f32,f32 bf16=f32,f32").expect("a choices line").apply();
    assert_eq!(
        osprey_kernels::prefill_kernel(osprey_kernels::WeightClass::Bf16, osprey_kernels::Rows::Few),
        osprey_kernels::Gemm::F32
    );
    assert!(decode() == before, "decode must not follow the prefill calibration");

    // A choice per band: bf16 tiles below 64 rows, sgemm from 64 (what this CPU's calibration chose on
    // a Sapphire Rapids without AMX). Each GEMM must compute what its band's kernel alone computes.
    if !osprey_kernels::bf16::available() {
        return;
    }
    let gemm = |m: usize| {
        let x: Vec<f32> = (0..m * k).map(|i| x[i % k] + 1e-3 * (i / k) as f32).collect();
        let mut out = vec![0f32; m * n];
        matmul_with(&x, m, WeightView::Bf16(&w), n, k, &mut out, Precision::Int8);
        out
    };
    Calibration::from_choices_line("nvfp4=amx,amx bf16=amx,amx").expect("a choices line").apply();
    let mut want = Vec::new();
    for (m, kernel) in [(16, Gemm::Bf16), (128, Gemm::F32)] {
        set_gemm_ceiling(kernel);
        want.push(gemm(m));
    }
    set_gemm_ceiling(Gemm::Bf16); // no AMX tiles: the two bands' kernels below are the two above
    assert!(want[1] != gemm(128), "the tiles and sgemm differ in bits at 128 rows");
    Calibration::from_choices_line("nvfp4=int8,int8 bf16=bf16,f32").expect("a choices line").apply();
    assert!(gemm(16) == want[0], "16 rows: the few-rows choice (bf16 tiles)");
    assert!(gemm(128) == want[1], "128 rows: the many-rows choice (sgemm)");
}
