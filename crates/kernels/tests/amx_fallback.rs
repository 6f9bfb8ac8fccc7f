//! A CPU that lists AMX but whose kernel refuses the tile state must fall back to the AVX-512 kernels
//! with the same answers. This binary decides the process's AMX status first (a status is decided once
//! per process), pretending a CPU with AMX and a refusal, so it runs on every machine.

use osprey_kernels::amx::{self, Status};
use osprey_kernels::{matmul_with, Gemm, Precision, WeightView};

#[test]
fn a_refused_tile_state_falls_back_to_the_avx512_kernels() {
    let mut asked = 0;
    let status = amx::init_with(true, || {
        asked += 1;
        Err(1) // EPERM
    });
    assert_eq!((status, asked), (Status::Refused(1), 1), "the permission is asked once, and refused");
    assert!(!amx::available());
    assert!(osprey_kernels::prefill_kernels().contains("refused"), "{}", osprey_kernels::prefill_kernels());

    // 40 rows (past AMX's 16-row minimum) of NVFP4 and bf16 weights: the results equal those with AMX
    // forbidden outright by the ceiling, which never looks at the tiles.
    let (m, n, k) = (40, 48, 128);
    let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect();
    let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
    let bf: Vec<u16> = (0..n * k).map(|i| half::bf16::from_f32(((i * 7 % 13) as f32) / 13.0 - 0.5).to_bits()).collect();
    let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
    for w in [WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.5 }, WeightView::Bf16(&bf)] {
        let mut refused = vec![0f32; m * n];
        matmul_with(&x, m, w, n, k, &mut refused, Precision::Int8);
        osprey_kernels::set_gemm_ceiling(Gemm::Int8);
        let mut avx512 = vec![0f32; m * n];
        matmul_with(&x, m, w, n, k, &mut avx512, Precision::Int8);
        osprey_kernels::set_gemm_ceiling(Gemm::Amx);
        assert_eq!(refused, avx512);
        assert!(refused.iter().all(|v| v.is_finite()) && refused.iter().any(|v| *v != 0.0));
    }
}
