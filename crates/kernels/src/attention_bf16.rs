//! Bidirectional attention (the vision towers') on bf16 tiles, for the fast precision on CPUs with
//! AVX512-BF16: `S = scale·Q·Kᵀ` and `O = P·V` as [`crate::bf16::gemm_nt`] products, the softmax in f32.
//!
//! Why: a 448×448 image is 784 patches; each of a tower's layers attends 784 × 784 per head, and as f32
//! sgemm over `head_dim` 72 (short rows: packing costs as much as the products) that was ~45% of the
//! tower's time. Q, K, V and the unnormalised probabilities are rounded to bf16 once (products exact in
//! f32, sums in f32); the drift from the f32 path is bounded in the tests below.
//!
//! Layout: per KV head, K as bf16 rows `[keys, hd↑32]` and Vᵀ as bf16 rows `[hd, keys↑32]` (zero padding:
//! the tiles take whole 32-value steps), made once; per (head, block of queries) a task rounds its
//! queries, multiplies, takes the row softmax, rounds P and multiplies by Vᵀ.

use crate::bf16::{self, Rows, STEP};
use crate::pool;

/// Queries per task.
const QBLOCK: usize = 128;

/// Whether the fast path can run here (AVX512-BF16).
pub fn available() -> bool {
    bf16::available()
}

/// Bidirectional attention at the fast precision: on bf16 tiles where the CPU has them (and `--gemm`
/// allows them), else the f32 path.
pub fn bidirectional_attention_fast(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: crate::attention::AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    if available() && crate::dispatch::allowed(crate::Gemm::Bf16) {
        bidirectional_attention_bf16(q, k, v, s, scale, out)
    } else {
        crate::attention::bidirectional_attention(q, k, v, s, scale, out)
    }
}

/// As [`crate::attention::bidirectional_attention`] (`[rows, heads, head_dim]` queries, `[rows, kv_heads,
/// head_dim]` keys and values), with bf16 operands. Panics (a bug) unless [`available`].
pub fn bidirectional_attention_bf16(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: crate::attention::AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    assert!(available(), "bf16 attention without AVX512-BF16: a bug");
    let (hd, nh, nkv) = (s.head_dim, s.heads, s.kv_heads);
    let kv_row = nkv * hd;
    let (n, m) = (q.len() / (nh * hd), k.len() / kv_row);
    assert!(v.len() == k.len() && out.len() == q.len() && nh % nkv == 0, "attention shapes: a bug");
    if n == 0 || m == 0 {
        return;
    }
    let (hdp, mp) = (hd.next_multiple_of(STEP), m.next_multiple_of(STEP));
    // Per KV head: K rows and Vᵀ rows in bf16, zero-padded.
    let packed: Vec<(Vec<u16>, Vec<u16>)> = pool::map(nkv, |h| {
        let mut kb = vec![0u16; m * hdp];
        let mut vt = vec![0u16; hd * mp];
        for j in 0..m {
            let src = &k[j * kv_row + h * hd..][..hd];
            bf16::round_row(src, &mut kb[j * hdp..j * hdp + hd]);
            for (d, &x) in v[j * kv_row + h * hd..][..hd].iter().enumerate() {
                vt[d * mp + j] = bf16::round(x);
            }
        }
        (kb, vt)
    });
    let group = nh / nkv;
    let blocks = n.div_ceil(QBLOCK);
    let results: Vec<(usize, usize, Vec<f32>)> = pool::map(nh * blocks, |task| {
        let (h, b) = (task / blocks, task % blocks);
        let (kb, vt) = &packed[h / group];
        let (q0, q1) = (b * QBLOCK, ((b + 1) * QBLOCK).min(n));
        let rows = q1 - q0;
        let mut qb = vec![0u16; rows * hdp];
        for r in 0..rows {
            bf16::round_row(&q[((q0 + r) * nh + h) * hd..][..hd], &mut qb[r * hdp..r * hdp + hd]);
        }
        let mut sc = vec![0f32; rows * m];
        bf16::gemm_nt(Rows { data: &qb, rows }, Rows { data: kb, rows: m }, hdp, scale, &mut sc, (m, 1));
        // Unnormalised softmax; rows are divided by their sums after P·V.
        let mut sums = vec![0f32; rows];
        let mut pb = vec![0u16; rows * mp];
        for (r, row) in sc.chunks_mut(m).enumerate() {
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            sums[r] = crate::simd::exp_sub_sum(row, max);
            bf16::round_row(row, &mut pb[r * mp..r * mp + m]);
        }
        let mut o = vec![0f32; rows * hd];
        bf16::gemm_nt(Rows { data: &pb, rows }, Rows { data: vt, rows: hd }, mp, 1.0, &mut o, (hd, 1));
        for (row, sum) in o.chunks_mut(hd).zip(&sums) {
            row.iter_mut().for_each(|x| *x /= sum);
        }
        (h, q0, o)
    });
    crate::attention::scatter_heads(results, nh, hd, out);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention::{bidirectional_attention, AttnShape};

    /// Against the f32 path on a vision-like shape (head_dim 72, not a multiple of 32; keys not a
    /// multiple of 32; grouped heads). Each operand moves by at most 2^-9 of itself when rounded, so a
    /// score moves by ~2^-8·|q||k| and an output, an average of values of magnitude ≤ 1, by a few 2^-8:
    /// measured 1.1e-3 here, bound 2e-3 (the kernels are deterministic). Mutation-checked: probabilities
    /// truncated to bf16 instead of rounded give 2.4e-3 and fail.
    #[test]
    fn bf16_attention_is_within_rounding_of_the_f32_path() {
        if !available() {
            eprintln!("no AVX512-BF16 here: vision attention stays on f32");
            return;
        }
        let s = AttnShape { heads: 4, kv_heads: 2, head_dim: 72 };
        let n = 300;
        let val = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
        let q: Vec<f32> = (0..n * 4 * 72).map(val).collect();
        let k: Vec<f32> = (0..n * 2 * 72).map(|i| val(i + 17)).collect();
        let v: Vec<f32> = (0..n * 2 * 72).map(|i| val(i + 99)).collect();
        let scale = 1.0 / (72f32).sqrt();
        let (mut exact, mut fast) = (vec![0f32; q.len()], vec![0f32; q.len()]);
        bidirectional_attention(&q, &k, &v, s, scale, &mut exact);
        bidirectional_attention_bf16(&q, &k, &v, s, scale, &mut fast);
        let d = exact.iter().zip(&fast).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
        println!("bf16 vs f32 attention: max |Δ| {d:.2e}");
        assert!(d > 0.0 && d < 2e-3, "max |Δ| {d}");
    }
}
