//! Every op the CUDA backend runs, on the emulated device, against the exact CPU backend on the
//! models' shapes (Qwen3.5-35B-A3B: hidden 2048, 16 heads × 256 with a 64-wide rotary, 256 experts top
//! 8; the vision tower's 1152) and the edge cases (one token, lengths that are not multiples of a tile
//! or of 32). Tolerances are the forward-error bounds of the computation, stated where they are used:
//! element-wise ops with the same formula must agree to a few units of roundoff (the transcendental
//! functions of two libms), reductions within γ_n = n·u of the magnitudes summed, since the two
//! backends add in different orders.

use std::sync::Arc;

use osprey_backend::{BackendRef, DType, HostData, MRope, Tensor};

use crate::common::{backends, data, row, weight, within, Matrix, U};

fn both(cpu: &BackendRef, gpu: &BackendRef, v: &[f32], shape: &[usize]) -> (Tensor, Tensor) {
    (cpu.upload_f32(v, shape).expect("cpu"), gpu.upload_f32(v, shape).expect("gpu"))
}

fn host(b: &BackendRef, t: &Tensor) -> Vec<f32> {
    b.download_f32(t).expect("download")
}

/// A few units of roundoff, relative, for transcendental functions computed by two libms.
fn ulps(want: &[f32], n: f32) -> impl Fn(usize) -> f32 + '_ {
    move |i| n * U * want[i].abs().max(f32::MIN_POSITIVE)
}

#[test]
pub(crate) fn element_wise_ops_agree_to_a_few_ulps() {
    let (cpu, gpu) = backends();
    for (rows, cols) in [(1, 2048), (7, 2048), (3, 1000)] {
        let (x, y, g) = (data(1, rows * cols), data(2, rows * cols), data(3, rows));
        type Op = fn(&BackendRef, &mut Tensor, &Tensor, &Tensor);
        let ops: [(&str, Op); 10] = [
            ("add", |b, x, y, _| b.add(x, y)),
            ("scale", |b, x, _, _| b.scale(x, 0.37)),
            ("silu_mul", |b, x, y, _| b.silu_mul(x, y)),
            ("sigmoid_mul", |b, x, y, _| b.sigmoid_mul(x, y)),
            ("add_sigmoid_gated", |b, x, y, g| b.add_sigmoid_gated(x, y, g)),
            ("gelu_tanh", |b, x, _, _| b.gelu(x, true)),
            ("gelu_erf", |b, x, _, _| b.gelu(x, false)),
            ("silu", |b, x, _, _| b.silu(x)),
            ("sigmoid", |b, x, _, _| b.sigmoid(x)),
            ("add_bias", |b, x, _, _| {
                let bias = b.upload_f32(&data(4, x.cols()), &[x.cols()]).expect("bias");
                b.add_bias(x, &bias)
            }),
        ];
        for (name, op) in ops {
            let (mut xc, mut xg) = both(&cpu, &gpu, &x, &[rows, cols]);
            let (yc, yg) = both(&cpu, &gpu, &y, &[rows, cols]);
            let (gc, gg) = both(&cpu, &gpu, &g, &[rows, 1]);
            op(&cpu, &mut xc, &yc, &gc);
            op(&gpu, &mut xg, &yg, &gg);
            let want = host(&cpu, &xc);
            within(&format!("{name} [{rows}, {cols}]"), &host(&gpu, &xg), &want, ulps(&want, 8.0));
        }
    }
}

/// The bound of a normalised value after a sum of `n` squares in another order: γ_n of the sum moves
/// the scale by half that, plus a few roundings of the final products.
fn norm_bound(want: &[f32], n: usize) -> impl Fn(usize) -> f32 + '_ {
    move |i| (n as f32 * U + 8.0 * U) * want[i].abs() + 1e-7
}

#[test]
pub(crate) fn norms_agree_within_the_sum_bound() {
    let (cpu, gpu) = backends();
    // Whole rows of 2048 (the decoder), heads of 256 and 128 (q/k norms, GDN), the vision tower's 1152.
    for (rows, cols, group) in
        [(1, 2048, 2048), (5, 2048, 2048), (3, 16 * 256, 256), (2, 32 * 128, 128), (4, 1000, 1000)]
    {
        let x = data(10 + rows as u64, rows * cols);
        let w = data(20, group);
        let z = data(30, rows * cols);
        for form in ["plain", "one_plus", "gated", "gated_sigmoid", "l2"] {
            let (mut xc, mut xg) = both(&cpu, &gpu, &x, &[rows, cols]);
            let (wc, wg) = both(&cpu, &gpu, &w, &[group]);
            let (zc, zg) = both(&cpu, &gpu, &z, &[rows, cols]);
            for (b, x, w, z) in [(&cpu, &mut xc, &wc, &zc), (&gpu, &mut xg, &wg, &zg)] {
                match form {
                    "plain" => b.rms_norm(x, w, 1e-6, false),
                    "one_plus" => b.rms_norm(x, w, 1e-6, true),
                    "gated" => b.rms_norm_gated(x, z, w, 1e-6),
                    "gated_sigmoid" => b.rms_norm_gated_sigmoid(x, z, w, 1e-6),
                    _ => b.l2_norm(x, group, 1e-6),
                }
            }
            let want = host(&cpu, &xc);
            within(&format!("{form} [{rows}, {cols}] / {group}"), &host(&gpu, &xg), &want, norm_bound(&want, group));
        }
    }
    // qwen4_exp's grouped norm: groups of 128 with one weight over the whole row; LayerNorm of 1152.
    let (rows, cols) = (3, 1024);
    let (x, w) = (data(40, rows * cols), data(41, cols));
    let (mut xc, mut xg) = both(&cpu, &gpu, &x, &[rows, cols]);
    let (wc, wg) = both(&cpu, &gpu, &w, &[cols]);
    cpu.rms_norm_grouped(&mut xc, &wc, 128, 1e-6);
    gpu.rms_norm_grouped(&mut xg, &wg, 128, 1e-6);
    let want = host(&cpu, &xc);
    within("rms_norm_grouped", &host(&gpu, &xg), &want, norm_bound(&want, 128));
    let (rows, cols) = (9, 1152);
    let (x, w, bias) = (data(50, rows * cols), data(51, cols), data(52, cols));
    let (mut xc, mut xg) = both(&cpu, &gpu, &x, &[rows, cols]);
    let (wc, wg) = both(&cpu, &gpu, &w, &[cols]);
    let (bc, bg) = both(&cpu, &gpu, &bias, &[cols]);
    cpu.layer_norm(&mut xc, &wc, &bc, 1e-6);
    gpu.layer_norm(&mut xg, &wg, &bg, 1e-6);
    let want = host(&cpu, &xc);
    // LayerNorm sums twice (mean, then variance): twice the bound, plus the bias's magnitude.
    within("layer_norm", &host(&gpu, &xg), &want, |i| {
        2.0 * norm_bound(&want, cols)(i) + 2.0 * U * bias[i % cols].abs()
    });
    // Issue 52, item 5: the residual add and the next RMSNorm in one launch (`add_rms_norm_f32`): the
    // bits of `add`, a copy and `rms_norm` on the device (the same sums in the same order), the CPU's
    // within the norm's bound; the residual keeps the sum exactly.
    for (rows, one_plus) in [(1, true), (6, false)] {
        let (x, y, w) = (data(60, rows * 2048), data(61, rows * 2048), data(62, 2048));
        let (mut xc, mut xg) = both(&cpu, &gpu, &x, &[rows, 2048]);
        let (yc, yg) = both(&cpu, &gpu, &y, &[rows, 2048]);
        let (wc, wg) = both(&cpu, &gpu, &w, &[2048]);
        let mut fused = None;
        let ran = osprey_backend_cuda::emu::launches_of(|| {
            fused = Some(gpu.add_rms_norm(&mut xg, &yg, &wg, 1e-6, one_plus).expect("fused"));
        });
        assert_eq!(ran, ["add_rms_norm_f32"]);
        let got = host(&gpu, &fused.expect("fused"));
        let mut xs = gpu.upload_f32(&x, &[rows, 2048]).expect("x");
        gpu.add(&mut xs, &yg);
        let mut hs = xs.clone();
        gpu.rms_norm(&mut hs, &wg, 1e-6, one_plus);
        assert_eq!(got, host(&gpu, &hs), "the unfused ops' bits");
        assert_eq!(host(&gpu, &xg), host(&gpu, &xs), "the residual");
        let want = host(&cpu, &cpu.add_rms_norm(&mut xc, &yc, &wc, 1e-6, one_plus).expect("cpu"));
        assert_eq!(host(&gpu, &xg), host(&cpu, &xc), "the residual: one f32 add on either backend");
        within(&format!("add_rms_norm [{rows}, 2048]"), &got, &want, norm_bound(&want, 2048));
    }
}

/// `Σ_j |x[r, j]·w[c, j]|` for every output `(r, c)` of `x [m, k] · wᵀ`: what a dot product's rounding
/// error is bounded by (times γ_k).
fn magnitudes(x: &[f32], w: &Matrix, m: usize) -> Vec<f32> {
    let (n, k) = (w.rows, w.cols);
    let rows: Vec<Vec<f32>> = (0..n).map(|r| row(w, r)).collect();
    (0..m * n).map(|o| (0..k).map(|j| (x[(o / n) * k + j] * rows[o % n][j]).abs()).sum()).collect()
}

#[test]
pub(crate) fn linears_agree_within_the_dot_product_bound_for_every_weight_type() {
    let (cpu, gpu) = backends();
    // (m, n, k): decode, a few rows, a prefill chunk not a multiple of 16; k of the hidden size, of an
    // expert's intermediate size (512), and odd for the dense types.
    let shapes = [(1, 512, 2048), (3, 256, 512), (17, 48, 2048), (5, 40, 100)];
    for dtype in [DType::F32, DType::BF16, DType::F16, DType::Nvfp4] {
        for (i, &(m, n, k)) in shapes.iter().enumerate() {
            if dtype == DType::Nvfp4 && k % 16 != 0 {
                continue; // NVFP4 rows are whole blocks of 16
            }
            let w = weight(dtype, n, k, 100 + i as u64);
            let x = data(200 + i as u64, m * k);
            let (xc, xg) = both(&cpu, &gpu, &x, &[m, k]);
            let (wc, wg) = (cpu.place_weight(w.clone()).expect("cpu"), gpu.place_weight(w.clone()).expect("gpu"));
            let want = host(&cpu, &cpu.linear(&xc, &wc).expect("cpu linear"));
            let got = host(&gpu, &gpu.linear(&xg, &wg).expect("gpu linear"));
            // |fl(x·w) − x·w| ≤ γ_k Σ|x_i w_i| for each of the two, so they differ by at most twice that.
            let mag = magnitudes(&x, &w, m);
            within(&format!("linear {dtype:?} ({m}, {n}, {k})"), &got, &want, |o| 2.0 * (k as f32 * U) * mag[o] + 1e-7);
        }
    }
    // Issue 52, item 5: a decode-shaped pair of weights (an MLP's gate and up) in one launch
    // (`linear_gemv_many`), the bits of the two linears; prefill-shaped pairs stay two.
    for (dtype, m) in [(DType::BF16, 3usize), (DType::F32, 1), (DType::BF16, 12)] {
        let (n, k) = (40, 256);
        let (w1, w2) = (weight(dtype, n, k, 70), weight(dtype, n, k, 71));
        let x = data(72, m * k);
        let xg = gpu.upload_f32(&x, &[m, k]).expect("x");
        let (g1, g2) = (gpu.place_weight(w1).expect("w1"), gpu.place_weight(w2).expect("w2"));
        let mut pair = None;
        let ran = osprey_backend_cuda::emu::launches_of(|| pair = Some(gpu.linear_pair(&xg, &g1, &g2).expect("pair")));
        let (a, b) = pair.expect("pair");
        let one = if m <= 8 { vec!["linear_gemv_many"] } else { vec!["linear_tiled", "linear_tiled"] };
        assert_eq!(ran, one, "{dtype:?}, {m} rows");
        let (a1, b1) = (gpu.linear(&xg, &g1).expect("a"), gpu.linear(&xg, &g2).expect("b"));
        assert_eq!((host(&gpu, &a), host(&gpu, &b)), (host(&gpu, &a1), host(&gpu, &b1)), "{dtype:?}, {m} rows");
        // Up to four weights of one width, each its own type and height (a Gated DeltaNet layer's four
        // projections): one launch for decode-shaped rows with each weight's `linear` bits; five weights,
        // or prefill-shaped rows, a launch each.
        let ws: Vec<Tensor> = [(DType::BF16, 40), (DType::F32, 8), (DType::F16, 1), (DType::BF16, 24), (DType::F32, 3)]
            .iter()
            .enumerate()
            .map(|(i, &(t, n))| gpu.place_weight(weight(t, n, k, 80 + i as u64)).expect("w"))
            .collect();
        let refs: Vec<&Tensor> = ws.iter().collect();
        for count in [2, 4, 5] {
            let mut many = None;
            let ran = osprey_backend_cuda::emu::launches_of(|| {
                many = Some(gpu.linear_many(&xg, &refs[..count]).expect("many"))
            });
            let launches = if m <= 8 && count <= 4 { 1 } else { count };
            assert_eq!(ran.len(), launches, "{dtype:?}, {m} rows, {count} weights: {ran:?}");
            for (got, w) in many.expect("many").iter().zip(&refs) {
                assert_eq!(
                    host(&gpu, got),
                    host(&gpu, &gpu.linear(&xg, w).expect("one")),
                    "{dtype:?}, {m} rows, {count} weights"
                );
            }
        }
        // And SwiGLU's first half (`linear_swiglu`): decode-shaped, one launch with the bits of the pair
        // and `silu_mul`; prefill-shaped, the pair's launches and `silu_mul_f32`.
        let mut fused = None;
        let ran =
            osprey_backend_cuda::emu::launches_of(|| fused = Some(gpu.linear_swiglu(&xg, &g1, &g2).expect("swiglu")));
        let one =
            if m <= 8 { vec!["linear_gemv_swiglu"] } else { vec!["linear_tiled", "linear_tiled", "silu_mul_f32"] };
        assert_eq!(ran, one, "swiglu {dtype:?}, {m} rows");
        let mut g = a1.clone();
        gpu.silu_mul(&mut g, &b1);
        assert_eq!(host(&gpu, &fused.expect("fused")), host(&gpu, &g), "swiglu {dtype:?}, {m} rows");
    }
}

/// The fast path of prefill-shaped bf16 linears, and of NVFP4 ones whose width the tensor-core GEMM does
/// not take (not whole 32-value steps; `tests/cuda/q8.rs` has the others): one bf16 GEMM with cuBLAS's
/// semantics (activations rounded to bf16, NVFP4 widened to bf16), against the CPU's exact f32 linear.
/// Rounding an activation or a widened weight to bf16 moves it by at most 2⁻⁹ of itself, so a product by
/// at most 2⁻⁸ of |x·w|; the sums add at most γ_k for each backend.
#[test]
pub(crate) fn fast_linears_run_as_bf16_gemms_within_the_rounding_bound() {
    let cpu = osprey_backend_cpu::CpuBackend::exact();
    let gpu = osprey_backend_cuda::open_emulated_with(1 << 30, osprey_backend::Precision::Int8);
    let shapes = |dtype| match dtype {
        DType::BF16 => [(9usize, 64usize, 256usize), (33, 40, 512)],
        _ => [(9, 64, 48), (33, 40, 80)],
    };
    for dtype in [DType::BF16, DType::Nvfp4] {
        for (i, &(m, n, k)) in shapes(dtype).iter().enumerate() {
            let w = weight(dtype, n, k, 300 + i as u64);
            let x = data(400 + i as u64, m * k);
            let (xc, xg) = both(&cpu, &gpu, &x, &[m, k]);
            let (wc, wg) = (cpu.place_weight(w.clone()).expect("cpu"), gpu.place_weight(w.clone()).expect("gpu"));
            let want = host(&cpu, &cpu.linear(&xc, &wc).expect("cpu linear"));
            let got = host(&gpu, &gpu.linear(&xg, &wg).expect("gpu linear"));
            let mag = magnitudes(&x, &w, m);
            within(&format!("fast linear {dtype:?} ({m}, {n}, {k})"), &got, &want, |o| {
                (2f32.powi(-8) + 2.0 * k as f32 * U) * mag[o] + 1e-6
            });
            // And it is the GEMM that ran: the exact path's f32 answer differs from the bf16 one.
            let exact = osprey_backend_cuda::open_emulated(1 << 30);
            let (xe, we) = (exact.upload_f32(&x, &[m, k]).expect("x"), exact.place_weight(w.clone()).expect("w"));
            assert_ne!(host(&exact, &exact.linear(&xe, &we).expect("exact linear")), got, "the bf16 GEMM ran");
        }
    }
}

#[test]
pub(crate) fn embeddings_memory_ops_rotary_and_the_router_match() {
    let (cpu, gpu) = backends();
    // Embedding rows of each table type: exact (a widening copy).
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        let table = weight(dtype, 300, 2048, 7);
        let ids = [0u32, 299, 5, 5, 17];
        let (tc, tg) = (cpu.place_weight(table.clone()).expect("cpu"), gpu.place_weight(table).expect("gpu"));
        assert_eq!(host(&gpu, &gpu.embed(&tg, &ids).expect("gpu")), host(&cpu, &cpu.embed(&tc, &ids).expect("cpu")));
    }
    // Gathers (f32 and bf16), scatters with a repeated row (added in order), column splits, row writes
    // into f32 and bf16 pools: exact.
    let x = data(60, 6 * 40);
    let (xc, xg) = both(&cpu, &gpu, &x, &[6, 40]);
    let rows = [5, 0, 5, 2];
    assert_eq!(
        host(&gpu, &gpu.gather_rows(&xg, &rows).expect("g")),
        host(&cpu, &cpu.gather_rows(&xc, &rows).expect("c"))
    );
    // Up to four parts a launch: five take two.
    for (heads, parts) in [(2usize, vec![8usize, 12]), (1, vec![10, 10, 20]), (1, vec![4, 4, 8, 8, 16])] {
        let (pc, pg) = (cpu.split_cols(&xc, heads, &parts).expect("c"), gpu.split_cols(&xg, heads, &parts).expect("g"));
        for (a, b) in pc.iter().zip(&pg) {
            assert_eq!((b.shape(), host(&gpu, b)), (a.shape(), host(&cpu, a)));
        }
    }
    for dtype in [DType::F32, DType::BF16] {
        let (mut pc, mut pg) = (cpu.zeros(dtype, &[8, 40]).expect("c"), gpu.zeros(dtype, &[8, 40]).expect("g"));
        cpu.write_rows(&mut pc, 2 * 40, &xc, 1..4);
        gpu.write_rows(&mut pg, 2 * 40, &xg, 1..4);
        assert_eq!(gpu.download(&pg).expect("g"), cpu.download(&pc).expect("c"), "{dtype:?} rows");
    }
    let ids = [3i32, -1, 7];
    let t = gpu.upload(HostData::I32(&ids), &[3]).expect("ids");
    assert_eq!(gpu.download(&t).expect("ids"), osprey_backend::HostVec::I32(ids.to_vec()));

    // mRoPE on 16 heads of 256 with a 64-wide rotary and the vision tower's 2-D rotary: the same
    // products, so a few roundings apart at most (the CPU's may fuse).
    let rope = MRope::new(256, 64, 10_000_000.0, [11, 11, 10]);
    let positions: Vec<[i64; 3]> = (0..5).map(|t| [t, t / 2, t % 3]).collect();
    let x = data(70, 5 * 16 * 256);
    let (mut xc, mut xg) = both(&cpu, &gpu, &x, &[5, 16 * 256]);
    let (tc, tg) = (cpu.rope_table(&rope, &positions).expect("c"), gpu.rope_table(&rope, &positions).expect("g"));
    cpu.rope(&mut xc, &rope, &tc);
    gpu.rope(&mut xg, &rope, &tg);
    let want = host(&cpu, &xc);
    within("rope", &host(&gpu, &xg), &want, |i| 4.0 * U * (x[i].abs() + want[i].abs()) + 1e-7);

    // The router over 256 experts, top 8, renormalised or not, on decode and prefill rows.
    for (t, renorm) in [(1, true), (9, true), (4, false)] {
        let l = data(80 + t as u64, t * 256).iter().map(|v| v * 4.0).collect::<Vec<_>>();
        let (lc, lg) = both(&cpu, &gpu, &l, &[t, 256]);
        let (rc, rg) = (cpu.route(&lc, 8, renorm).expect("c"), gpu.route(&lg, 8, renorm).expect("g"));
        assert_eq!(gpu.download(&rg.ids).expect("g"), cpu.download(&rc.ids).expect("c"), "ids, {t} rows");
        let want = host(&cpu, &rc.weights);
        within("router weights", &host(&gpu, &rg.weights), &want, ulps(&want, 16.0));
    }
}

#[test]
fn the_backend_runs_every_op_and_reports_out_of_memory() {
    let gpu = osprey_backend_cuda::open_emulated(1 << 20);
    assert!(osprey_backend::Op::ALL.iter().all(|&op| gpu.supports(op)));
    let e = gpu.zeros_f32(&[1024, 1024]).expect_err("4 MiB on a 1 MiB device");
    assert!(matches!(e, osprey_backend::BackendError::OutOfMemory { .. }), "{e}");
    let t = gpu.zeros_f32(&[16, 16]).expect("1 KiB fits");
    assert_eq!(gpu.describe(), "cuda-emu (emulated CUDA device, sm_80, 0.0 GiB)");
    drop(Arc::new(t));
}
