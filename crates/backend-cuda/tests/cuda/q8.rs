//! Issue 52, item 1: decode-shaped NVFP4 products on int8 activations (`kernels/linear_q8.cu`, the fast
//! activations). A dense linear takes the CPU's integers (`osprey_kernels::q8`) and differs from it only
//! in the order of its f32 sums; the routed experts' fused kernels (gather with the quantisation, gate
//! and up with SwiGLU, down with the routing weight) give the bits of the dense kernels composed.

use std::sync::Arc;

use osprey_backend::{BackendRef, DType, ExpertKey, ExpertShape, Fence, HostData, HostExpert, Precision, Tensor};
use osprey_kernels::q8::{self, Isa};

use crate::common::{data, weight, within, Matrix, Owned, U};

fn int8_gpu() -> BackendRef {
    osprey_backend_cuda::open_emulated_with(1 << 30, Precision::Int8)
}

fn host(b: &BackendRef, t: &Tensor) -> Vec<f32> {
    b.download_f32(t).expect("download")
}

/// Row `r` of NVFP4 `w` against quantised activations, as the CPU computes it (portable integers).
fn cpu_dot(a: &q8::Q8Act, w: &Matrix, r: usize) -> f32 {
    let Owned::Nvfp4 { packed, scales, global } = &w.data else { panic!("an NVFP4 weight") };
    let k = w.cols;
    q8::dot(Isa::Portable, a, &packed[r * k / 2..(r + 1) * k / 2], &scales[r * k / 16..(r + 1) * k / 16], *global)
}

/// `Σ_i (|x_i| + amax_b / 127)·|w_i|` over row `r`: every term a backend sums is `q_i·d_b·w_i` with
/// `|q_i·d_b| ≤ |x_i| + d_b / 2`, so this bounds the magnitudes in play.
fn magnitude(x: &[f32], w: &Matrix, r: usize) -> f32 {
    let wr = crate::common::row(w, r);
    x.chunks(16)
        .zip(wr.chunks(16))
        .map(|(xb, wb)| {
            let amax = xb.iter().fold(0f32, |m, v| m.max(v.abs()));
            xb.iter().zip(wb).map(|(a, b)| (a.abs() + amax / 127.0) * b.abs()).sum::<f32>()
        })
        .sum()
}

#[test]
pub(crate) fn int8_decode_linears_take_the_cpus_integers() {
    int8_linears_take_the_cpus_integers(&[(1, 40, 256), (3, 33, 512), (8, 17, 128)], "linear_q8_gemv");
    // Widths the CPU does not quantise (not a multiple of 64) keep the f32 GEMV there too.
    let gpu = int8_gpu();
    let (w, x) = (weight(DType::Nvfp4, 8, 96, 920), data(921, 2 * 96));
    let (wg, xg) = (gpu.place_weight(w).expect("w"), gpu.upload_f32(&x, &[2, 96]).expect("x"));
    let ran = osprey_backend_cuda::emu::launches_of(|| drop(gpu.linear(&xg, &wg).expect("linear")));
    assert_eq!(ran, ["linear_gemv"]);
}

/// Issue 52, item 2: prefill-shaped NVFP4 linears on the tensor cores (`linear_mma_q8`: int8 `mma.sync`
/// per 16-value block, one partial tile, 2 × 2 tiles with partial edges, a deep one) take the same
/// integers as the CPU's, within the same f32-order bound.
#[test]
pub(crate) fn int8_prefill_linears_take_the_cpus_integers_on_tensor_cores() {
    int8_linears_take_the_cpus_integers(&[(9, 40, 256), (70, 72, 128), (130, 17, 512)], "linear_mma_q8");
}

fn int8_linears_take_the_cpus_integers(shapes: &[(usize, usize, usize)], kernel: &str) {
    let gpu = int8_gpu();
    for &(m, n, k) in shapes {
        let w = weight(DType::Nvfp4, n, k, 900 + m as u64);
        let x = data(910 + m as u64, m * k);
        let (wg, xg) = (gpu.place_weight(w.clone()).expect("w"), gpu.upload_f32(&x, &[m, k]).expect("x"));
        let mut out = None;
        let ran = osprey_backend_cuda::emu::launches_of(|| out = Some(gpu.linear(&xg, &wg).expect("linear")));
        assert_eq!(ran, ["quantize_q8", kernel], "({m}, {n}, {k}): the int8 path ran");
        let got = host(&gpu, &out.expect("out"));
        let mut want = vec![0f32; m * n];
        let mut mag = vec![0f32; m * n];
        for i in 0..m {
            let xi = &x[i * k..(i + 1) * k];
            let a = q8::quantize(xi);
            for r in 0..n {
                want[i * n + r] = cpu_dot(&a, &w, r);
                mag[i * n + r] = magnitude(xi, &w, r);
            }
        }
        // The same integers block by block; each backend's f32 sum of the k/16 scaled blocks (in its own
        // order: the CPU's 16 lanes, the GPU's 32 lanes and a warp tree) moves by at most γ_k of the
        // magnitudes, so the two differ by at most twice that.
        within(&format!("int8 linear ({m}, {n}, {k})"), &got, &want, |o| 2.0 * k as f32 * U * mag[o] + 1e-7);
    }
}

fn expert(e: u32, shape: ExpertShape) -> HostExpert {
    let (h, i) = (shape.hidden, shape.inter);
    HostExpert {
        key: ExpertKey { layer: 0, expert: e },
        gate: weight(DType::Nvfp4, i, h, 930 + u64::from(e)),
        up: weight(DType::Nvfp4, i, h, 940 + u64::from(e)),
        down: weight(DType::Nvfp4, h, i, 950 + u64::from(e)),
        lease: None,
    }
}

/// One expert's output for every row of `x`, by the dense int8 linears and `silu_mul` on the device.
fn composed(gpu: &BackendRef, x: &Tensor, e: &HostExpert) -> Vec<f32> {
    let place = |m: &Arc<dyn osprey_backend::HostMatrix>| gpu.place_weight(m.clone()).expect("place");
    let mut g = gpu.linear(x, &place(&e.gate)).expect("gate");
    let u = gpu.linear(x, &place(&e.up)).expect("up");
    gpu.silu_mul(&mut g, &u);
    host(gpu, &gpu.linear(&g, &place(&e.down)).expect("down"))
}

/// The fused expert kernels against the dense kernels composed, on host- and device-routed waves: the
/// same bits (each row's arithmetic is `q8_rows` in both, SwiGLU the same expression, the routing weight
/// one f32 product, the combine the same ordered sum).
#[test]
pub(crate) fn int8_decode_experts_fuse_to_the_bits_of_the_dense_kernels() {
    experts_equal_the_dense_kernels(5, &["moe_align", "moe_gate_up_q8", "moe_down_q8"]);
}

/// Issue 52, item 2: a prefill-shaped wave's experts on the tensor cores, every expert's rows in one
/// launch a projection (`linear_grouped_mma_q8`), give the bits of the dense tensor-core linears composed.
#[test]
pub(crate) fn int8_prefill_experts_group_to_the_bits_of_the_dense_kernels() {
    let mma = "linear_grouped_mma_q8";
    experts_equal_the_dense_kernels(
        12,
        &["moe_align", "quantize_q8", mma, mma, "silu_mul_f32", "quantize_q8", mma, "moe_scatter_rows"],
    );
}

fn experts_equal_the_dense_kernels(t: usize, kernels: &[&str]) {
    let gpu = int8_gpu();
    let shape = ExpertShape { hidden: 256, inter: 64, dtype: DType::Nvfp4 };
    let (k, experts) = (3usize, 4usize);
    let x = data(960, t * shape.hidden);
    let w = data(961, t * k).iter().map(|v| v.abs()).collect::<Vec<_>>();
    // Token i takes experts i, i + 1, i + 3 (mod 4), ascending.
    let ids: Vec<i32> = (0..t)
        .flat_map(|i| {
            let mut e = [i % 4, (i + 1) % 4, (i + 3) % 4].map(|e| e as i32);
            e.sort();
            e
        })
        .collect();
    let slot_of: Vec<i32> = (0..experts).map(|e| ((e + 1) % experts) as i32).collect();
    let mut pool = gpu.alloc_expert_pool(0, experts, shape).expect("pool");
    for e in 0..experts {
        gpu.upload_expert(&mut pool, slot_of[e] as usize, expert(e as u32, shape), Fence::DONE).expect("upload");
    }
    let xt = gpu.upload_f32(&x, &[t, shape.hidden]).expect("x");
    let outs: Vec<Vec<f32>> = (0..experts).map(|e| composed(&gpu, &xt, &expert(e as u32, shape))).collect();
    let mut want = vec![0f32; t * shape.hidden];
    for (i, row) in want.chunks_mut(shape.hidden).enumerate() {
        for (c, o) in row.iter_mut().enumerate() {
            *o = (0..k).fold(0f32, |acc, j| acc + outs[ids[i * k + j] as usize][i * shape.hidden + c] * w[i * k + j]);
        }
    }
    let routing = osprey_backend::Routing {
        ids: gpu.upload(HostData::I32(&ids), &[t, k]).expect("ids"),
        weights: gpu.upload_f32(&w, &[t, k]).expect("w"),
    };
    let map = gpu.upload(HostData::I32(&slot_of), &[experts]).expect("slot_of");
    let mut partials = gpu.zeros_f32(&[t * k, shape.hidden]).expect("partials");
    let ran = osprey_backend_cuda::emu::launches_of(|| {
        gpu.moe_routed_on_device(&xt, &routing, &map, &pool, &mut partials).expect("on device")
    });
    assert_eq!(ran, kernels, "the launches past the groups");
    assert_eq!(host(&gpu, &gpu.moe_combine(&partials, k).expect("combine")), want, "routed on the device");
    let slots: Vec<i32> = ids.iter().map(|&e| slot_of[e as usize]).collect();
    let mut partials = gpu.zeros_f32(&[t * k, shape.hidden]).expect("partials");
    gpu.moe_routed(&xt, &slots, &routing.weights, &pool, &mut partials).expect("wave");
    assert_eq!(host(&gpu, &gpu.moe_combine(&partials, k).expect("combine")), want, "routed on the host");
}
