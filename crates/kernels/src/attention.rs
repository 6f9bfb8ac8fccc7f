//! Causal grouped-query attention of a sequence's new queries over its cached keys and values.

pub use osprey_backend::types::AttnShape;

use crate::attention_decode::decode_attention;
pub use crate::attention_decode::{KvElem, PagedKv};
use crate::attention_prefill::prefill_attention;
use crate::matmul::matmul_into_strided as gemm;

/// `out[i, h] = softmax(q[i,h]·K[..=start+i]ᵀ·scale)·V` for `n = q.len()/(heads·head_dim)` queries at
/// positions `start..start+n`. `k`, `v` are `[t, kv_heads, head_dim]` and already hold the new tokens.
pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], start: usize, s: AttnShape, scale: f32, out: &mut [f32]) {
    // Contiguous rows are one page of all of them.
    let page = (k.len() / (s.kv_heads * s.head_dim)).max(1);
    causal_attention_paged(q, PagedKv { k: &[k], v: &[v], page }, start, s, scale, out);
}

/// [`causal_attention`] over paged keys and values, read in place (bf16 as bf16, widened in registers
/// or as a block is packed): decode (a few queries) by [`decode_attention`], prefill by
/// [`prefill_attention`]. Either computes a query's output from its own keys only, so paged and
/// contiguous rows give the same bits.
pub fn causal_attention_paged<T: KvElem>(
    q: &[f32],
    kv: PagedKv<'_, T>,
    start: usize,
    s: AttnShape,
    scale: f32,
    out: &mut [f32],
) {
    let n = q.len() / (s.heads * s.head_dim);
    let t = start + n;
    assert!(kv.k.len() * kv.page >= t && kv.v.len() == kv.k.len(), "attention pages too short: this is a bug");
    assert!(out.len() == q.len(), "attention shapes: this is a bug");
    let visible = |i: usize| start + i + 1;
    if n >= 8 {
        prefill_attention(q, kv, s, scale, out, &visible);
    } else {
        decode_attention(q, kv, s, scale, out, &visible);
    }
}

/// Every query attends to every key (vision tower: one image or one video frame group at a time).
pub fn bidirectional_attention(q: &[f32], k: &[f32], v: &[f32], s: AttnShape, scale: f32, out: &mut [f32]) {
    let m = k.len() / (s.kv_heads * s.head_dim);
    attend(q, k, v, s, scale, out, |_| m);
}

/// Queries per block of the GEMM path.
const QBLOCK: usize = 256;

/// Query `i` attends to keys `[0, visible(i))`; `visible` is non-decreasing in `i`.
fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
    scale: f32,
    out: &mut [f32],
    visible: impl Fn(usize) -> usize + Sync,
) {
    assert!(v.len() == k.len() && out.len() == q.len(), "attention shapes: this is a bug");
    let n = q.len() / (s.heads * s.head_dim);
    if n >= 8 {
        attend_blocked(q, k, v, s, scale, out, &visible);
    } else {
        // Contiguous rows are one page of all of them.
        let page = (k.len() / (s.kv_heads * s.head_dim)).max(1);
        decode_attention(q, PagedKv { k: &[k], v: &[v], page }, s, scale, out, &visible);
    }
}

/// Many queries (the vision towers' bidirectional attention): per (head, block of queries) `S = scale·Q·Kᵀ`, masked row softmax,
/// `O = P·V`, both products as sgemm over strided views of the `[rows, heads, head_dim]` layouts.
fn attend_blocked(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
    scale: f32,
    out: &mut [f32],
    visible: &(impl Fn(usize) -> usize + Sync),
) {
    let (hd, nh, nkv) = (s.head_dim, s.heads, s.kv_heads);
    let n = q.len() / (nh * hd);
    let kv_row = nkv * hd;
    let group = nh / nkv;
    let blocks = n.div_ceil(QBLOCK);
    let results: Vec<(usize, usize, Vec<f32>)> = crate::pool::map(nh * blocks, |task| {
        let (h, b) = (task / blocks, task % blocks);
        let kvh = h / group;
        let (q0, q1) = (b * QBLOCK, ((b + 1) * QBLOCK).min(n));
        let rows = q1 - q0;
        let m = visible(q1 - 1);
        let mut sc = vec![0f32; rows * m];
        let qa = &q[(q0 * nh + h) * hd..];
        let kb = &k[kvh * hd..];
        gemm(
            (rows, hd, m),
            (qa, (nh * hd) as isize, 1),
            (kb, 1, kv_row as isize),
            (&mut sc, m as isize, 1),
            scale,
            0.0,
        );
        // Unnormalised softmax (masked keys → 0); rows are divided by their sums after P·V.
        let mut sums = vec![0f32; rows];
        for (r, row) in sc.chunks_mut(m).enumerate() {
            let vis = visible(q0 + r);
            let max = row[..vis].iter().copied().fold(f32::NEG_INFINITY, f32::max);
            sums[r] = crate::simd::exp_sub_sum(&mut row[..vis], max);
            row[vis..].fill(0.0);
        }
        let mut o = vec![0f32; rows * hd];
        let vb = &v[kvh * hd..];
        gemm((rows, m, hd), (&sc, m as isize, 1), (vb, kv_row as isize, 1), (&mut o, hd as isize, 1), 1.0, 0.0);
        for (row, sum) in o.chunks_mut(hd).zip(&sums) {
            row.iter_mut().for_each(|x| *x /= sum);
        }
        (h, q0, o)
    });
    scatter_heads(results, nh, hd, out);
}

/// Writes per-(head, first query) blocks of `[rows, hd]` outputs into the `[rows, heads, hd]` layout.
pub(crate) fn scatter_heads(results: Vec<(usize, usize, Vec<f32>)>, nh: usize, hd: usize, out: &mut [f32]) {
    for (h, q0, o) in results {
        for (r, row) in o.chunks(hd).enumerate() {
            let at = ((q0 + r) * nh + h) * hd;
            out[at..at + hd].copy_from_slice(row);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_equal_scores_average() {
        let s = AttnShape { heads: 2, kv_heads: 1, head_dim: 2 };
        let q = vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let k = vec![0.0, 0.0, 0.0, 0.0];
        let v = vec![1.0, 2.0, 3.0, 4.0];
        let mut out = vec![0.0; 8];
        causal_attention(&q, &k, &v, 0, s, 1.0, &mut out);
        assert_eq!(&out[..4], &[1.0, 2.0, 1.0, 2.0]);
        assert_eq!(&out[4..], &[2.0, 3.0, 2.0, 3.0]);
        // Bidirectional: the first query also sees the second key.
        bidirectional_attention(&q, &k, &v, s, 1.0, &mut out);
        assert_eq!(&out[..4], &[2.0, 3.0, 2.0, 3.0]);
    }

    #[test]
    fn blocked_path_equals_decode_path() {
        let s = AttnShape { heads: 4, kv_heads: 2, head_dim: 8 };
        let (n, past) = (150usize, 7usize);
        let val = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
        let q: Vec<f32> = (0..n * 32).map(val).collect();
        let k: Vec<f32> = (0..(n + past) * 16).map(|i| val(i + 17)).collect();
        let v: Vec<f32> = (0..(n + past) * 16).map(|i| val(i + 99)).collect();
        for causal in [true, false] {
            let vis = |i: usize| if causal { past + i + 1 } else { n + past };
            let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            let one_page = PagedKv { k: &[&k[..]], v: &[&v[..]], page: n + past };
            decode_attention(&q, one_page, s, 0.3, &mut a, &vis);
            attend_blocked(&q, &k, &v, s, 0.3, &mut b, &vis);
            let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            // Same math, different summation order over <= 157 keys of O(1) values.
            assert!(d < 1e-5, "causal={causal}: {d}");
            crate::attention_prefill::prefill_attention(&q, one_page, s, 0.3, &mut b, &vis);
            let d = a.iter().zip(&b).map(|(x, y)| (x - y).abs()).fold(0f32, f32::max);
            assert!(d < 1e-5, "prefill path, causal={causal}: {d}");
        }
    }

    #[test]
    fn paged_attention_equals_contiguous_attention_bit_for_bit() {
        let s = AttnShape { heads: 4, kv_heads: 2, head_dim: 8 };
        let val = |i: usize| ((i * 2654435761usize) % 1000) as f32 / 500.0 - 1.0;
        let page = 5;
        // Decode (3 queries: the row path) and prefill (40 queries: the blocked path), with a partly filled
        // last page and spare pages beyond the visible rows.
        for (n, past) in [(3usize, 21usize), (40, 7)] {
            let t = n + past;
            let q: Vec<f32> = (0..n * 32).map(val).collect();
            let k: Vec<f32> = (0..t * 16).map(|i| val(i + 17)).collect();
            let v: Vec<f32> = (0..t * 16).map(|i| val(i + 99)).collect();
            let paged = |x: &[f32]| -> Vec<Vec<f32>> {
                (0..t.div_ceil(page) + 1)
                    .map(|p| {
                        let mut buf = vec![f32::NAN; page * 16];
                        let rows = x.len().saturating_sub(p * page * 16).min(page * 16);
                        if rows > 0 {
                            buf[..rows].copy_from_slice(&x[p * page * 16..p * page * 16 + rows]);
                        }
                        buf
                    })
                    .collect()
            };
            let (kp, vp) = (paged(&k), paged(&v));
            let kr: Vec<&[f32]> = kp.iter().map(|p| p.as_slice()).collect();
            let vr: Vec<&[f32]> = vp.iter().map(|p| p.as_slice()).collect();
            let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
            causal_attention(&q, &k, &v, past, s, 0.3, &mut a);
            causal_attention_paged(&q, PagedKv { k: &kr, v: &vr, page }, past, s, 0.3, &mut b);
            assert_eq!(a, b, "n={n}: paged attention must equal contiguous attention exactly");
        }
    }
}
