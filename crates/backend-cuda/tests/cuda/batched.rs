//! Issue 52, item 5: the attention ops a decode step runs once for all its sequences, with the bits each
//! sequence gets alone — flash attention over several sequences' page tables in one launch (each row its
//! own sequence's split), their new K/V rows written in one launch with K's norm and RoPE on the way, and
//! q's norm and RoPE in one pass — on Qwen3.5-35B-A3B's attention (16 query / 2 KV heads of 256, a
//! quarter of each head rotated).

use std::sync::Arc;

use osprey_backend::{AttnShape, BackendRef, DType, HostData, MRope, PagedRows, PagedView, Tensor};
use osprey_backend_cuda::{CudaBackend, EmuDevice};

use crate::common::data;

const S: AttnShape = AttnShape { heads: 16, kv_heads: 2, head_dim: 256 };
const PS: usize = 16;

fn emulated() -> Arc<CudaBackend> {
    Arc::new(CudaBackend::new(Arc::new(EmuDevice::new(1 << 30)), osprey_backend::Device::CudaEmu))
}

fn bits(b: &BackendRef, t: &Tensor) -> Vec<u32> {
    b.download_f32(t).expect("download").iter().map(|x| x.to_bits()).collect()
}

/// A pool's values as f32 (bf16 widened).
fn floats(b: &BackendRef, t: &Tensor) -> Vec<f32> {
    match b.download(t).expect("pool") {
        osprey_backend::HostVec::F32(x) => x,
        osprey_backend::HostVec::Bf16(x) => x.iter().map(|&x| f32::from_bits(u32::from(x) << 16)).collect(),
        _ => panic!("a pool is f32 or bf16"),
    }
}

/// The first element where two results differ.
fn first_diff(a: &[u32], b: &[u32]) -> Option<usize> {
    assert_eq!(a.len(), b.len());
    a.iter().zip(b).position(|(x, y)| x != y)
}

/// A pool of `pages` pages of 16 holding seeded K/V, in `dtype`.
fn pool(b: &BackendRef, pages: usize, dtype: DType, seed: u64) -> Tensor {
    let (rows, row) = (pages * 2 * PS, S.kv_heads * S.head_dim);
    let mut pool = b.zeros(dtype, &[rows, row]).expect("pool");
    b.write_rows(&mut pool, 0, &b.upload_f32(&data(seed, rows * row), &[rows, row]).expect("kv"), 0..rows);
    pool
}

/// Three sequences as a step brings them: a decode row at 8,500 tokens (107 splits of 80 positions), a
/// decode row at 300 (5 splits of 64), and a chunk of three rows after 40 tokens (one split); each its
/// own pages of the pool, in no order. Rows of `q`: 4, 0 and 1..4 (not the launch's order).
#[test]
pub(crate) fn sequences_attend_in_one_launch_with_the_bits_each_gets_alone() {
    type Seq = (std::ops::Range<usize>, usize, Vec<i32>);
    let seqs: [Seq; 3] = [
        (4..5, 8_500, (0..532).map(|p| 599 - p).collect()),
        (0..1, 300, (0..19).map(|p| 2 + 3 * p).collect()),
        (1..4, 40, vec![1, 60, 0]),
    ];
    for dtype in [DType::F32, DType::BF16] {
        let cuda = emulated();
        let b: BackendRef = cuda.clone();
        let (pool_a, pool_b) = (pool(&b, 600, dtype, 400), pool(&b, 600, dtype, 401));
        let tables: Vec<Tensor> =
            seqs.iter().map(|s| b.upload(HostData::I32(&s.2), &[s.2.len()]).expect("table")).collect();
        let q = b.upload_f32(&data(402, 5 * S.heads * S.head_dim), &[5, S.heads * S.head_dim]).expect("q");
        fn rows<'a>(seqs: &'a [Seq], tables: &'a [Tensor], pools: [&'a Tensor; 3]) -> Vec<PagedRows<'a>> {
            let with = |((s, t), pool): ((&'a Seq, &'a Tensor), &'a Tensor)| PagedRows {
                rows: s.0.clone(),
                kv: PagedView { pool, table: t, page_size: PS },
                past: s.1,
            };
            seqs.iter().zip(tables).zip(pools).map(with).collect()
        }
        let fresh = || b.zeros_f32(&[5, S.heads * S.head_dim]).expect("out");
        // Alone: a launch (and a combine where it splits) a sequence.
        let mut alone = fresh();
        for r in rows(&seqs, &tables, [&pool_a; 3]) {
            b.attention_paged(&q, r.rows, r.kv, r.past, S, 0.0625, &mut alone);
        }
        // Together: one launch and one combine for the three.
        let mut together = fresh();
        let before = cuda.counts();
        b.attention_paged_rows(&q, &rows(&seqs, &tables, [&pool_a; 3]), S, 0.0625, &mut together);
        let launched = cuda.counts().since(&before).kernels;
        assert_eq!((launched["attention_flash"], launched["attention_combine"]), (1, 1), "{dtype:?}: {launched:?}");
        assert_eq!(first_diff(&bits(&b, &together), &bits(&b, &alone)), None, "{dtype:?}: together vs alone");
        // Sequences of two pools (unpooled tables): a launch per pool, the same bits again.
        let mut mixed = fresh();
        let mut alone_b = fresh();
        for r in rows(&seqs, &tables, [&pool_a, &pool_b, &pool_a]) {
            b.attention_paged(&q, r.rows, r.kv, r.past, S, 0.0625, &mut alone_b);
        }
        let before = cuda.counts();
        b.attention_paged_rows(&q, &rows(&seqs, &tables, [&pool_a, &pool_b, &pool_a]), S, 0.0625, &mut mixed);
        let launched = cuda.counts().since(&before).kernels;
        assert_eq!(launched["attention_flash"], 3, "{dtype:?}: one launch a sequence when the pools differ");
        assert_eq!(first_diff(&bits(&b, &mixed), &bits(&b, &alone_b)), None, "{dtype:?}: two pools");
    }
}

/// Qwen3.5's rotary for 256-wide heads: a quarter rotated, mRoPE sections [11, 11, 10].
fn rope() -> MRope {
    MRope::new(256, 64, 10_000_000.0, [11, 11, 10])
}

/// K rows of three sequences go into their pool rows normed and rotated, V rows copied, in one launch
/// with the bits of `rms_norm`, `rope` and `write_rows` one after another; q's `rms_norm_rope` equals
/// the two ops too. f32 and bf16 pools; only some rows of the step are written, in no order.
#[test]
pub(crate) fn k_and_v_go_into_the_pool_normed_and_rotated_in_one_launch() {
    let (n, row) = (5, S.kv_heads * S.head_dim);
    let positions: Vec<[i64; 3]> = [7i64, 300, 41, 2, 3].iter().map(|&p| [p, p, p]).collect();
    let slots = [(0, 3), (3, 12), (4, 40), (1, 66), (2, 0)]; // K rows: page · 32 + slot
    for dtype in [DType::F32, DType::BF16] {
        let cuda = emulated();
        let b: BackendRef = cuda.clone();
        let rope = rope();
        let table = b.rope_table(&rope, &positions).expect("rope table");
        let k = b.upload_f32(&data(410, n * row), &[n, row]).expect("k");
        let v = b.upload_f32(&data(411, n * row), &[n, row]).expect("v");
        let w = b.upload_f32(&data(412, S.head_dim), &[S.head_dim]).expect("norm");
        let (mut fused, mut apart) = (pool(&b, 3, dtype, 413), pool(&b, 3, dtype, 413));
        let before = cuda.counts();
        b.write_kv(&mut fused, &k, &v, &slots, PS, (&w, 1e-6, true), (&rope, &table)).expect("write_kv");
        let launched = cuda.counts().since(&before).kernels;
        assert_eq!(launched.get("kv_write_rope"), Some(&1), "{dtype:?}: {launched:?}");
        assert_eq!(launched.len(), 1, "{dtype:?}: nothing but the write: {launched:?}");
        let mut kr = k.clone();
        b.rms_norm(&mut kr, &w, 1e-6, true);
        b.rope(&mut kr, &rope, &table);
        for &(src, dst) in &slots {
            b.write_rows(&mut apart, dst * row, &kr, src..src + 1);
            b.write_rows(&mut apart, (dst + PS) * row, &v, src..src + 1);
        }
        let widened = |t: &Tensor| -> Vec<u32> { floats(&b, t).iter().map(|x| x.to_bits()).collect() };
        assert_eq!(first_diff(&widened(&fused), &widened(&apart)), None, "{dtype:?}: fused vs apart");
        // Against the CPU backend's `write_kv` (its default: the same ops on the host). The norm is within
        // (256 + 8)·u of it relative to each normed value (`norm_bound`); a rotation adds 4·u of
        // |a| + |b| and moves each input's error into the output through |c|, |s| ≤ 1, and |a|, |b| of a
        // rotated pair are at most √2 times the larger of its outputs (a rotation keeps a² + b²): so
        // (264 + 4)·u·2·√2 of the largest |output| in its head, plus a bf16 pool's half ulp (2⁻⁸
        // relative) where the two round apart.
        let cpu: BackendRef = osprey_backend_cpu::CpuBackend::exact();
        let host = |x: &[f32], shape: &[usize]| cpu.upload_f32(x, shape).expect("cpu");
        let (kc, vc, wc) = (
            host(&data(410, n * row), &[n, row]),
            host(&data(411, n * row), &[n, row]),
            host(&data(412, S.head_dim), &[S.head_dim]),
        );
        let tc = cpu.rope_table(&rope, &positions).expect("cpu rope table");
        let mut pc = pool(&cpu, 3, dtype, 413);
        cpu.write_kv(&mut pc, &kc, &vc, &slots, PS, (&wc, 1e-6, true), (&rope, &tc)).expect("cpu write_kv");
        let (want, got) = (floats(&cpu, &pc), floats(&b, &fused));
        let head_max: Vec<f32> =
            want.chunks(S.head_dim).map(|h| h.iter().fold(0.0f32, |m, x| m.max(x.abs()))).collect();
        let half_ulp = if dtype == DType::BF16 { 1.0 / 256.0 } else { 0.0 };
        crate::common::within(&format!("write_kv {dtype:?}"), &got, &want, |i| {
            268.0 * crate::common::U * 2.0 * std::f32::consts::SQRT_2 * head_max[i / S.head_dim]
                + half_ulp * want[i].abs()
                + 1e-7
        });
        assert_eq!(b.download_f32(&k).expect("k"), data(410, n * row), "k itself is left as it was");
        // q: 16 heads a row, in place.
        let q = b.upload_f32(&data(414, n * S.heads * S.head_dim), &[n, S.heads * S.head_dim]).expect("q");
        let (mut one, mut two) = (q.clone(), q.clone());
        let before = cuda.counts();
        b.rms_norm_rope(&mut one, &w, 1e-6, true, &rope, &table);
        assert_eq!(cuda.counts().since(&before).kernels.get("rms_norm_rope_f32"), Some(&1));
        b.rms_norm(&mut two, &w, 1e-6, true);
        b.rope(&mut two, &rope, &table);
        assert_eq!(first_diff(&bits(&b, &one), &bits(&b, &two)), None, "{dtype:?}: rms_norm_rope vs the two ops");
    }
}
