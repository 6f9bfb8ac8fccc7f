//! Prefill-shaped attention (many queries) over a long paged context: flash attention on the CPU.
//!
//! Why: a turn of a long image conversation prefills a few hundred new tokens against tens of thousands
//! of cached ones. The GEMM path this replaces made, per query head and block of 256 queries, the whole
//! score matrix (256 × 57k floats, 58 MB: out of every cache) and multiplied it by V, reading each KV
//! head's keys once per query head of its group (8× for Qwen3.5), and a 258-token turn paid two full
//! blocks: 463 new tokens at 57k took 7.0 s (62 GFLOP/s), 258 tokens 4.5 s.
//!
//! Here a task owns one KV head and a tile of query positions, with every query head of the group: its
//! rows (positions × group heads, ≤ [`ROWS`]) meet each block of [`KB`] keys while the block's K (packed
//! transposed) and V sit in cache (L2), and an online softmax per row (running maximum and sum, as in
//! [`crate::attention_decode`]) replaces the score matrix. Register-blocked micro-kernels: scores as
//! 6 rows × 16 keys outer products over the head dimension, `P·V` as 6 rows × 16 columns over the block.
//!
//! A query's bits depend only on its own keys: key blocks start at fixed positions (multiples of [`KB`]),
//! every score is one FMA chain over the head dimension, and masked keys add exact zeros; so a prompt
//! chunked one way or another, or cut where a cached prefix ends, computes every row the same.
//!
//! The micro-kernels come at three [`Level`]s (AVX-512, AVX2, portable) that compute the same bits: the
//! same chains in the same order, 32, 16 or 1 columns at a time. On AVX-512 the 6 × 32 kernels do twice
//! the AVX2 kernels' work per instruction (issue 53: on an AVX-512 machine the 16-wide kernels left half
//! of each FMA unused, and a turn's attention over its context is what grows with the conversation).

use osprey_backend::types::AttnShape;

use crate::attention_decode::{KvElem, PagedKv};

/// Keys a block: a block's K and V rows of one KV head (256 wide, f32) are 128 KB, in L2 beside the
/// tile; a row's softmax bookkeeping and its outputs' reload are spread over 64 keys (16 keys ran at
/// ~60% of 64's speed, 32 at ~80%, 128 as 64: examples/attention_depth on an AVX2 Zen 3).
pub const KB: usize = 64;
const _: () = assert!(KB.is_multiple_of(32), "the AVX-512 score kernel takes 32 keys a step");

/// Query rows (positions × query heads of a group) a task holds: its queries and outputs (2 × 192 KB at
/// head dim 256) stay in L2.
const ROWS: usize = 192;

/// Rows of a micro-kernel step.
const MR: usize = 6;

/// The instruction set of the micro-kernels. Every level computes the same bits
/// (`every_level_computes_the_same_bits`), so the choice is speed only.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Level {
    /// AVX-512F: 6 rows × 32 columns a step.
    Avx512,
    /// AVX2 + FMA: 6 rows × 16 columns a step.
    Avx2,
    /// Scalar code, one FMA chain per score and output.
    Portable,
}

impl Level {
    /// Every level this CPU runs, best first.
    pub(crate) fn available() -> Vec<Level> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if crate::simd::has_avx2_fma() && is_x86_feature_detected!("avx512f") {
                out.push(Level::Avx512);
            }
            if crate::simd::has_avx2_fma() {
                out.push(Level::Avx2);
            }
        }
        out.push(Level::Portable);
        out
    }

    /// The best level this CPU runs.
    fn detected() -> Level {
        static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
        *LEVEL.get_or_init(|| Level::available()[0])
    }
}

/// `out[i, h] = softmax(q[i,h]·K[..visible(i)]ᵀ·scale)·V` for the `n` queries of `q` (`[n, heads, hd]`).
pub fn prefill_attention<T: KvElem>(
    q: &[f32],
    kv: PagedKv<'_, T>,
    s: AttnShape,
    scale: f32,
    out: &mut [f32],
    visible: &(impl Fn(usize) -> usize + Sync),
) {
    prefill_attention_at(Level::detected(), q, kv, s, scale, out, visible)
}

/// [`prefill_attention`] on the micro-kernels of `level` (one the CPU runs: [`Level::available`]).
pub(crate) fn prefill_attention_at<T: KvElem>(
    level: Level,
    q: &[f32],
    kv: PagedKv<'_, T>,
    s: AttnShape,
    scale: f32,
    out: &mut [f32],
    visible: &(impl Fn(usize) -> usize + Sync),
) {
    let (hd, nh, nkv) = (s.head_dim, s.heads, s.kv_heads);
    let g = nh / nkv;
    let n = q.len() / (nh * hd);
    if n == 0 {
        return;
    }
    // Tiles of equal size: 258 queries are two tiles of 129, not 256 and 2.
    let per_tile = (ROWS / g).max(1);
    let tiles = n.div_ceil(per_tile);
    let per_tile = n.div_ceil(tiles);
    let results = crate::pool::map(nkv * tiles, |task| {
        let (kvh, t) = (task / tiles, task % tiles);
        let (i0, i1) = (t * per_tile, ((t + 1) * per_tile).min(n));
        (kvh, i0, tile(level, q, kv, s, scale, (kvh, i0..i1), visible))
    });
    for (kvh, i0, o) in results {
        for (r, row) in o.chunks(hd).enumerate() {
            let (i, h) = (i0 + r / g, kvh * g + r % g);
            out[(i * nh + h) * hd..][..hd].copy_from_slice(row);
        }
    }
}

/// The outputs `[positions × g, hd]` of one KV head's query heads at positions `pos`.
fn tile<'a, T: KvElem>(
    level: Level,
    q: &[f32],
    kv: PagedKv<'a, T>,
    s: AttnShape,
    scale: f32,
    (kvh, pos): (usize, std::ops::Range<usize>),
    visible: &(impl Fn(usize) -> usize + Sync),
) -> Vec<f32> {
    let (hd, nh, nkv) = (s.head_dim, s.heads, s.kv_heads);
    let g = nh / nkv;
    // Whole micro-kernel steps: the padding rows see no key.
    let (real, rows) = (pos.len() * g, (pos.len() * g).next_multiple_of(MR));
    let i0 = pos.start;
    // The tile's queries, contiguous: row r is position i0 + r / g, head kvh·g + r % g.
    let mut qt = Vec::with_capacity(rows * hd);
    for i in pos.clone() {
        qt.extend_from_slice(&q[(i * nh + kvh * g) * hd..][..g * hd]);
    }
    qt.resize(rows * hd, 0.0);
    let vis: Vec<usize> = (0..rows).map(|r| if r < real { visible(i0 + r / g) } else { 0 }).collect();
    let end = vis.iter().copied().max().unwrap_or(0);
    let mut o = vec![0f32; rows * hd];
    let (mut max, mut sum, mut corr) = (vec![f32::NEG_INFINITY; rows], vec![0f32; rows], vec![1f32; rows]);
    let mut sc = vec![0f32; rows * KB];
    let (mut kt, mut vb, mut widen) = (vec![0f32; hd * KB], Vec::with_capacity(KB * hd), Vec::with_capacity(hd));
    let kv_row = nkv * hd;
    let at =
        |pages: &'a [&'a [T]], j: usize| -> &'a [T] { &pages[j / kv.page][(j % kv.page) * kv_row + kvh * hd..][..hd] };
    for j0 in (0..end).step_by(KB) {
        let b = KB.min(end - j0);
        // K transposed ([hd, KB], zero past b) and V ([b, hd]), widened to f32.
        vb.clear();
        kt.fill(0.0);
        for j in 0..b {
            widen.clear();
            T::extend_f32(&mut widen, at(kv.k, j0 + j));
            for (c, &x) in widen.iter().enumerate() {
                kt[c * KB + j] = x;
            }
            T::extend_f32(&mut vb, at(kv.v, j0 + j));
        }
        scores(level, &qt, &kt, hd, scale, &mut sc);
        for r in 0..rows {
            let row = &mut sc[r * KB..(r + 1) * KB];
            let valid = vis[r].saturating_sub(j0).min(b);
            if valid == 0 {
                // Every key of the block is after this query: its state stays as it is.
                row.fill(0.0);
                corr[r] = 1.0;
                continue;
            }
            let m = row[..valid].iter().copied().fold(max[r], f32::max);
            corr[r] = if m == max[r] { 1.0 } else { (max[r] - m).exp() };
            max[r] = m;
            sum[r] = sum[r] * corr[r] + crate::simd::exp_sub_sum(&mut row[..valid], m);
            row[valid..].fill(0.0);
        }
        accumulate(level, &sc, &corr, &vb, b, hd, &mut o);
    }
    o.truncate(real * hd);
    for (row, s) in o.chunks_mut(hd).zip(&sum) {
        row.iter_mut().for_each(|x| *x /= s);
    }
    o
}

/// `s[r, j] = scale · q_r · k_j` for every row of `qt` (`[rows, hd]`) and the `KB` keys of `kt`
/// (`[hd, KB]`, transposed).
fn scores(level: Level, qt: &[f32], kt: &[f32], hd: usize, scale: f32, s: &mut [f32]) {
    let rows = qt.len() / hd;
    let mut r = 0;
    while r < rows {
        let m = MR.min(rows - r);
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 && m == MR {
            for j in (0..KB).step_by(32) {
                // SAFETY: AVX-512F was detected (the level); the kernel checks its slices' lengths.
                unsafe { x86::scores_6x32(&qt[r * hd..], &kt[j..], hd, scale, &mut s[r * KB + j..]) };
            }
            r += m;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if level != Level::Portable && m == MR {
            for j in (0..KB).step_by(16) {
                // SAFETY: AVX2 and FMA were detected; the kernel checks its slices' lengths.
                unsafe { x86::scores_6x16(&qt[r * hd..], &kt[j..], hd, scale, &mut s[r * KB + j..]) };
            }
            r += m;
            continue;
        }
        for i in r..r + m {
            let qi = &qt[i * hd..(i + 1) * hd];
            for j in 0..KB {
                let mut acc = 0f32;
                for (c, &x) in qi.iter().enumerate() {
                    acc = x.mul_add(kt[c * KB + j], acc);
                }
                s[i * KB + j] = acc * scale;
            }
        }
        r += m;
    }
}

/// `o_r = corr_r · o_r + Σ_{j<b} p[r, j] · v_j` for every row (`v`: `[b, hd]`).
fn accumulate(level: Level, p: &[f32], corr: &[f32], v: &[f32], b: usize, hd: usize, o: &mut [f32]) {
    let rows = corr.len();
    let mut r = 0;
    while r < rows {
        let m = MR.min(rows - r);
        #[cfg(target_arch = "x86_64")]
        if level == Level::Avx512 && m == MR && hd.is_multiple_of(32) {
            // SAFETY: AVX-512F was detected (the level); `p` holds the rows' KB, `v` b·hd, `o` the rows' hd.
            unsafe { x86::accumulate_6x32(&p[r * KB..], &corr[r..r + MR], v, b, hd, &mut o[r * hd..]) };
            r += m;
            continue;
        }
        #[cfg(target_arch = "x86_64")]
        if level != Level::Portable && m == MR && hd.is_multiple_of(16) {
            // SAFETY: AVX2 and FMA were detected; `p` holds the rows' KB, `v` b·hd, `o` the rows' hd.
            unsafe { x86::accumulate_6x16(&p[r * KB..], &corr[r..r + MR], v, b, hd, &mut o[r * hd..]) };
            r += m;
            continue;
        }
        for i in r..r + m {
            let oi = &mut o[i * hd..(i + 1) * hd];
            for (c, x) in oi.iter_mut().enumerate() {
                let mut acc = *x * corr[i];
                for j in 0..b {
                    acc = p[i * KB + j].mul_add(v[j * hd + c], acc);
                }
                *x = acc;
            }
        }
        r += m;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{KB, MR};

    /// Six rows' scores against 16 keys (columns of `kt` and `s`, rows `KB` apart): 12 accumulators,
    /// each an FMA chain over the head dimension in order (as the portable path's).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn scores_6x16(q: &[f32], kt: &[f32], hd: usize, scale: f32, s: &mut [f32]) {
        assert!(q.len() >= MR * hd && kt.len() >= (hd - 1) * KB + 16 && s.len() >= (MR - 1) * KB + 16, "bounds: a bug");
        let (qp, kp, sp) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        // SAFETY: every offset is inside the slices' asserted lengths.
        unsafe {
            for c in 0..hd {
                let (b0, b1) = (_mm256_loadu_ps(kp.add(c * KB)), _mm256_loadu_ps(kp.add(c * KB + 8)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*qp.add(r * hd + c));
                    a[0] = _mm256_fmadd_ps(x, b0, a[0]);
                    a[1] = _mm256_fmadd_ps(x, b1, a[1]);
                }
            }
            let sc = _mm256_set1_ps(scale);
            for (r, a) in acc.iter().enumerate() {
                _mm256_storeu_ps(sp.add(r * KB), _mm256_mul_ps(a[0], sc));
                _mm256_storeu_ps(sp.add(r * KB + 8), _mm256_mul_ps(a[1], sc));
            }
        }
    }

    /// Six rows' outputs, 16 columns at a time: rescaled by their corrections, then one FMA per key of
    /// the block in order (as the portable path's).
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn accumulate_6x16(p: &[f32], corr: &[f32], v: &[f32], b: usize, hd: usize, o: &mut [f32]) {
        assert!(
            p.len() >= (MR - 1) * KB + b && v.len() >= b * hd && o.len() >= MR * hd && hd.is_multiple_of(16),
            "micro-kernel bounds: a bug"
        );
        let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        // SAFETY: every offset is inside the slices' asserted lengths (columns in whole 16s).
        unsafe {
            let mut cr = [_mm256_setzero_ps(); MR];
            for (r, c) in cr.iter_mut().enumerate() {
                *c = _mm256_set1_ps(corr[r]);
            }
            for c in (0..hd).step_by(16) {
                let mut acc = [[_mm256_setzero_ps(); 2]; MR];
                for (r, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm256_mul_ps(_mm256_loadu_ps(op.add(r * hd + c)), cr[r]);
                    a[1] = _mm256_mul_ps(_mm256_loadu_ps(op.add(r * hd + c + 8)), cr[r]);
                }
                for j in 0..b {
                    let (v0, v1) = (_mm256_loadu_ps(vp.add(j * hd + c)), _mm256_loadu_ps(vp.add(j * hd + c + 8)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let x = _mm256_broadcast_ss(&*pp.add(r * KB + j));
                        a[0] = _mm256_fmadd_ps(x, v0, a[0]);
                        a[1] = _mm256_fmadd_ps(x, v1, a[1]);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    _mm256_storeu_ps(op.add(r * hd + c), a[0]);
                    _mm256_storeu_ps(op.add(r * hd + c + 8), a[1]);
                }
            }
        }
    }

    /// [`scores_6x16`] 32 keys at a time: the same chains, in zmm registers.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn scores_6x32(q: &[f32], kt: &[f32], hd: usize, scale: f32, s: &mut [f32]) {
        assert!(q.len() >= MR * hd && kt.len() >= (hd - 1) * KB + 32 && s.len() >= (MR - 1) * KB + 32, "bounds: a bug");
        let (qp, kp, sp) = (q.as_ptr(), kt.as_ptr(), s.as_mut_ptr());
        let mut acc = [[_mm512_setzero_ps(); 2]; MR];
        // SAFETY: every offset is inside the slices' asserted lengths.
        unsafe {
            for c in 0..hd {
                let (b0, b1) = (_mm512_loadu_ps(kp.add(c * KB)), _mm512_loadu_ps(kp.add(c * KB + 16)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*qp.add(r * hd + c));
                    a[0] = _mm512_fmadd_ps(x, b0, a[0]);
                    a[1] = _mm512_fmadd_ps(x, b1, a[1]);
                }
            }
            let sc = _mm512_set1_ps(scale);
            for (r, a) in acc.iter().enumerate() {
                _mm512_storeu_ps(sp.add(r * KB), _mm512_mul_ps(a[0], sc));
                _mm512_storeu_ps(sp.add(r * KB + 16), _mm512_mul_ps(a[1], sc));
            }
        }
    }

    /// [`accumulate_6x16`] 32 columns at a time: the same chains, in zmm registers.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn accumulate_6x32(p: &[f32], corr: &[f32], v: &[f32], b: usize, hd: usize, o: &mut [f32]) {
        assert!(
            p.len() >= (MR - 1) * KB + b && v.len() >= b * hd && o.len() >= MR * hd && hd.is_multiple_of(32),
            "micro-kernel bounds: a bug"
        );
        let (pp, vp, op) = (p.as_ptr(), v.as_ptr(), o.as_mut_ptr());
        // SAFETY: every offset is inside the slices' asserted lengths (columns in whole 32s).
        unsafe {
            let mut cr = [_mm512_setzero_ps(); MR];
            for (r, c) in cr.iter_mut().enumerate() {
                *c = _mm512_set1_ps(corr[r]);
            }
            for c in (0..hd).step_by(32) {
                let mut acc = [[_mm512_setzero_ps(); 2]; MR];
                for (r, a) in acc.iter_mut().enumerate() {
                    a[0] = _mm512_mul_ps(_mm512_loadu_ps(op.add(r * hd + c)), cr[r]);
                    a[1] = _mm512_mul_ps(_mm512_loadu_ps(op.add(r * hd + c + 16)), cr[r]);
                }
                for j in 0..b {
                    let (v0, v1) = (_mm512_loadu_ps(vp.add(j * hd + c)), _mm512_loadu_ps(vp.add(j * hd + c + 16)));
                    for (r, a) in acc.iter_mut().enumerate() {
                        let x = _mm512_set1_ps(*pp.add(r * KB + j));
                        a[0] = _mm512_fmadd_ps(x, v0, a[0]);
                        a[1] = _mm512_fmadd_ps(x, v1, a[1]);
                    }
                }
                for (r, a) in acc.iter().enumerate() {
                    _mm512_storeu_ps(op.add(r * hd + c), a[0]);
                    _mm512_storeu_ps(op.add(r * hd + c + 16), a[1]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attention_decode::tests::{exact, pages, val};
    use crate::simd::bf16_to_f32 as bf16;

    /// `n` new queries after `past` cached keys, causal, over paged f32 and bf16 KV, against the exact
    /// attention: Qwen3.5's shape (head dim 256, 8 query heads a KV head: the micro-kernels), a head dim
    /// off the 16-column `P·V` kernel (40) and one off every SIMD step (12), partly filled last pages,
    /// a last block shorter than [`KB`], tiles with padding rows.
    #[test]
    fn long_context_prefill_matches_the_exact_attention() {
        for (hd, heads, kv_heads, n, past, page) in
            [(256usize, 16usize, 2usize, 30usize, 1_100usize, 16usize), (40, 8, 2, 23, 700, 5), (12, 3, 1, 9, 300, 7)]
        {
            let s = AttnShape { heads, kv_heads, head_dim: hd };
            let (row, t) = (kv_heads * hd, past + n);
            let scale = 1.0 / (hd as f32).sqrt();
            // Keys drift with position, so later blocks raise a row's running maximum (a missing rescale
            // shows).
            let k: Vec<f32> = (0..t * row).map(|i| val(i + 5) + (i / row) as f32 * 2e-3).collect();
            let v: Vec<f32> = (0..t * row).map(|i| val(i + 77)).collect();
            let q: Vec<f32> = (0..n * heads * hd).map(|i| val(i + 901) * 2.0).collect();
            let vis = |i: usize| past + i + 1;
            // f32 sums: a score is `hd` products summed in order (≤ hd·2⁻²⁴ of Σ|q·k|, ~1e-5 of scores of a
            // few units); a row's output sums ≤ 1,130 weighted values (|v| ≤ 1, weights ≤ 1 over their
            // sum) in one chain, ≤ 1,130·2⁻²⁴ ≈ 7e-5 of the output's scale, and each block's rescale adds
            // an ulp. 1e-4 holds both; a missing rescale, a masked key counted or a row's keys cut at
            // the wrong place err by O(0.01–0.1).
            let bound = 1e-4;
            let want = exact(&q, &k, &v, &vis, s, scale);
            let (kp, vp) = (pages(&k, page * row, f32::NAN), pages(&v, page * row, f32::NAN));
            let (kr, vr): (Vec<&[f32]>, Vec<&[f32]>) =
                (kp.iter().map(|p| &p[..]).collect(), vp.iter().map(|p| &p[..]).collect());
            let mut got = vec![0f32; q.len()];
            prefill_attention(&q, PagedKv { k: &kr, v: &vr, page }, s, scale, &mut got, &vis);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < bound, "f32 KV, hd {hd}: max error {err}");

            // bf16 KV against the exact attention over the same bf16 values (widening is exact).
            let to_bf16 = |x: &f32| (x.to_bits() >> 16) as u16;
            let (kb, vb): (Vec<u16>, Vec<u16>) = (k.iter().map(to_bf16).collect(), v.iter().map(to_bf16).collect());
            let widen = |x: &[u16]| x.iter().map(|&b| bf16(b)).collect::<Vec<f32>>();
            let want = exact(&q, &widen(&kb), &widen(&vb), &vis, s, scale);
            let (kp, vp) = (pages(&kb, page * row, 0x7fc0), pages(&vb, page * row, 0x7fc0));
            let (kr, vr): (Vec<&[u16]>, Vec<&[u16]>) =
                (kp.iter().map(|p| &p[..]).collect(), vp.iter().map(|p| &p[..]).collect());
            prefill_attention(&q, PagedKv { k: &kr, v: &vr, page }, s, scale, &mut got, &vis);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < bound, "bf16 KV, hd {hd}: max error {err}");
        }
    }

    /// Each level's micro-kernels give the portable code's bits: head dims on both wide kernels (256),
    /// on the AVX-512 scores with the AVX2 `P·V` (48: a multiple of 16, not 32), off both (40); a tile
    /// with padding rows (23 positions × 4 heads) and a last key block shorter than [`KB`]; f32 and bf16
    /// KV. A chain summed in another order, or a column of the wrong key, changes bits.
    #[test]
    fn every_level_computes_the_same_bits() {
        for (hd, heads, kv_heads, n, past) in
            [(256usize, 16usize, 2usize, 20usize, 150usize), (48, 8, 2, 23, 97), (40, 4, 1, 11, 70)]
        {
            let s = AttnShape { heads, kv_heads, head_dim: hd };
            let (row, t) = (kv_heads * hd, past + n);
            let k: Vec<f32> = (0..t * row).map(|i| val(i + 5) + (i / row) as f32 * 2e-3).collect();
            let v: Vec<f32> = (0..t * row).map(|i| val(i + 77)).collect();
            let q: Vec<f32> = (0..n * heads * hd).map(|i| val(i + 901) * 2.0).collect();
            let kb: Vec<u16> = k.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
            let vb: Vec<u16> = v.iter().map(|x| (x.to_bits() >> 16) as u16).collect();
            let vis = |i: usize| past + i + 1;
            let run = |level: Level| {
                let (mut a, mut b) = (vec![0f32; q.len()], vec![0f32; q.len()]);
                prefill_attention_at(level, &q, PagedKv { k: &[&k[..]], v: &[&v[..]], page: t }, s, 0.1, &mut a, &vis);
                prefill_attention_at(
                    level,
                    &q,
                    PagedKv { k: &[&kb[..]], v: &[&vb[..]], page: t },
                    s,
                    0.1,
                    &mut b,
                    &vis,
                );
                (a, b)
            };
            let want = run(Level::Portable);
            for level in Level::available() {
                let got = run(level);
                assert!(
                    got.0 == want.0 && got.1 == want.1,
                    "{level:?}, head dim {hd}: other bits than the portable code"
                );
            }
        }
    }

    /// A query's output is a function of its own keys only: a prompt prefilled in one call equals, to the
    /// bit, the same prompt cut in two calls (another tiling, the cut inside a key block) — what lets a
    /// turn resumed from the prefix cache compute what a cold server computes.
    #[test]
    fn a_querys_output_does_not_depend_on_how_the_prompt_is_cut() {
        let s = AttnShape { heads: 16, kv_heads: 2, head_dim: 64 };
        let (past, n) = (37usize, 50usize);
        let (row, t, w) = (s.kv_heads * s.head_dim, past + n, s.heads * s.head_dim);
        let k: Vec<f32> = (0..t * row).map(|i| val(i + 3)).collect();
        let v: Vec<f32> = (0..t * row).map(|i| val(i + 11)).collect();
        let q: Vec<f32> = (0..n * w).map(|i| val(i + 29)).collect();
        let kv = PagedKv { k: &[&k[..]], v: &[&v[..]], page: t };
        let mut whole = vec![0f32; q.len()];
        prefill_attention(&q, kv, s, 0.125, &mut whole, &|i| past + i + 1);
        for cut in [9usize, 17, 30] {
            let mut parts = vec![0f32; q.len()];
            let (a, b) = parts.split_at_mut(cut * w);
            prefill_attention(&q[..cut * w], kv, s, 0.125, a, &|i| past + i + 1);
            prefill_attention(&q[cut * w..], kv, s, 0.125, b, &|i| past + cut + i + 1);
            assert!(whole == parts, "cut at {cut}: every row must keep its bits");
        }
    }
}
