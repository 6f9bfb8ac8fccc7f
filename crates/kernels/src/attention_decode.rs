//! Decode-shaped attention (a few queries) over a long paged context: flash-decoding on the CPU.
//!
//! Why: a decode token at 30k tokens of context reads 30k keys and values per KV head. One task per
//! query head (the row path this replaces) read them once per query head — 8× for Qwen3.5's 16 query /
//! 2 KV heads — and from DRAM every time, since a KV head's 30 MB outlives every cache: decode at 30k ran
//! at 20% of its 1k speed. Here a task owns one KV head, all the query heads of its group and one split
//! of the context: each key and value row comes from memory once and serves every query head of the
//! group while it is in L1, and a running maximum and sum per head (online softmax) replace the score row.
//! bf16 KV is read as bf16 (half the bytes), widened in registers.
//!
//! Splits are fixed spans of key positions, not a function of the thread count or of how many queries a
//! call has, and their partial sums are combined in split order: a query's output depends only on its own
//! keys, so a decode step, a verification of drafts and any `--threads` give the same bits.

use osprey_backend::types::AttnShape;

use crate::simd::bf16_to_f32 as bf16;

/// Key positions a task covers (the last split of a query is shorter).
pub const SPLIT: usize = 512;

/// Keys a step of the online softmax: a block's K and V rows of one KV head (256 wide, f32) stay in L1.
const BLOCK: usize = 16;

/// Keys and values stored in pages: `k[i]` and `v[i]` hold rows `[i·page, (i+1)·page)` as
/// `[page, kv_heads, head_dim]` (the last page may be partly filled).
/// `T` is the pool's element: f32, or bf16 bits (`u16`).
#[derive(Clone, Copy, Debug)]
pub struct PagedKv<'a, T = f32> {
    /// K planes, one per page.
    pub k: &'a [&'a [T]],
    /// V planes, one per page.
    pub v: &'a [&'a [T]],
    /// Rows per page.
    pub page: usize,
}

/// A KV pool's element: f32, or bf16 as its bit pattern.
pub trait KvElem: Copy + Send + Sync + 'static {
    /// Appends `src` widened to f32.
    fn extend_f32(dst: &mut Vec<f32>, src: &[Self]);
    /// `s[h·keys.len() + j] = scale · q_h · keys[j]` for the `g` query rows of `q`.
    fn scores(q: &[f32], g: usize, keys: &[&[Self]], scale: f32, s: &mut [f32]);
    /// `acc_h = corr_h · acc_h + Σ_j p[h·values.len() + j] · values[j]` for the `g` rows of `acc`.
    fn accumulate(p: &[f32], corr: &[f32], values: &[&[Self]], acc: &mut [f32]);
}

impl KvElem for f32 {
    fn extend_f32(dst: &mut Vec<f32>, src: &[f32]) {
        dst.extend_from_slice(src);
    }
    fn scores(q: &[f32], g: usize, keys: &[&[f32]], scale: f32, s: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2_fma() && q.len().is_multiple_of(8 * g) {
            // SAFETY: the features were detected above; the rows are `q.len() / g` long, whole 8-lane steps.
            return unsafe { x86::scores_f32(q, g, keys, scale, s) };
        }
        portable_scores(q, g, keys, scale, s, |x| x);
    }
    fn accumulate(p: &[f32], corr: &[f32], values: &[&[f32]], acc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2_fma() && acc.len().is_multiple_of(8 * corr.len()) {
            // SAFETY: as in `scores`.
            return unsafe { x86::accumulate_f32(p, corr, values, acc) };
        }
        portable_accumulate(p, corr, values, acc, |x| x);
    }
}

/// bf16 bit patterns (a `--kv-cache-dtype bf16` pool).
impl KvElem for u16 {
    fn extend_f32(dst: &mut Vec<f32>, src: &[u16]) {
        dst.extend(src.iter().map(|&b| bf16(b)));
    }
    fn scores(q: &[f32], g: usize, keys: &[&[u16]], scale: f32, s: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2_fma() && q.len().is_multiple_of(8 * g) {
            // SAFETY: as for f32.
            return unsafe { x86::scores_bf16(q, g, keys, scale, s) };
        }
        portable_scores(q, g, keys, scale, s, bf16);
    }
    fn accumulate(p: &[f32], corr: &[f32], values: &[&[u16]], acc: &mut [f32]) {
        #[cfg(target_arch = "x86_64")]
        if crate::simd::has_avx2_fma() && acc.len().is_multiple_of(8 * corr.len()) {
            // SAFETY: as for f32.
            return unsafe { x86::accumulate_bf16(p, corr, values, acc) };
        }
        portable_accumulate(p, corr, values, acc, bf16);
    }
}

/// Causal attention for few queries: query `i` (of `n = q.len() / (heads·head_dim)`) attends to key
/// positions `[0, visible(i))`. Tasks are (query, KV head, split); each keeps `(max, sum, Σ p·v)` per
/// query head of the group, and the splits of a query are merged in order.
pub fn decode_attention<T: KvElem>(
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
    // Tasks of query i start at first[i]: its KV heads × its splits.
    let splits = |i: usize| visible(i).div_ceil(SPLIT);
    let mut first = Vec::with_capacity(n + 1);
    first.push(0);
    for i in 0..n {
        first.push(first[i] + nkv * splits(i));
    }
    let partials = crate::pool::map(first[n], |task| {
        let i = first.partition_point(|&f| f <= task) - 1;
        let (kvh, split) = ((task - first[i]) / splits(i), (task - first[i]) % splits(i));
        let end = visible(i).min((split + 1) * SPLIT);
        let qg = &q[(i * nh + kvh * g) * hd..(i * nh + (kvh + 1) * g) * hd];
        split_partial(qg, kv, (kvh, hd, nkv), split * SPLIT..end, scale)
    });
    for i in 0..n {
        let parts = &partials[first[i]..first[i + 1]];
        let per_head = parts.len() / nkv;
        for kvh in 0..nkv {
            let parts = &parts[kvh * per_head..(kvh + 1) * per_head];
            for h in 0..g {
                let o = &mut out[(i * nh + kvh * g + h) * hd..][..hd];
                combine(parts.iter().map(|p| (p.max[h], p.sum[h], &p.acc[h * hd..(h + 1) * hd])), o);
            }
        }
    }
}

/// One task's running state: per query head its maximum, its sum of exponentials and `Σ p·v`.
struct Partial {
    max: Vec<f32>,
    sum: Vec<f32>,
    acc: Vec<f32>,
}

/// The group's `(max, sum, Σ p·v)` over key positions `keys` of KV head `kvh`.
fn split_partial<'a, T: KvElem>(
    qg: &[f32],
    kv: PagedKv<'a, T>,
    (kvh, hd, nkv): (usize, usize, usize),
    keys: std::ops::Range<usize>,
    scale: f32,
) -> Partial {
    let g = qg.len() / hd;
    let row = nkv * hd;
    let at = |pages: &'a [&'a [T]], pos: usize| -> &'a [T] {
        &pages[pos / kv.page][(pos % kv.page) * row + kvh * hd..][..hd]
    };
    let mut p = Partial { max: vec![f32::NEG_INFINITY; g], sum: vec![0.0; g], acc: vec![0.0; g * hd] };
    let mut scores = vec![0f32; g * BLOCK];
    let mut corr = vec![0f32; g];
    let (mut kr, mut vr): (Vec<&'a [T]>, Vec<&'a [T]>) = (Vec::with_capacity(BLOCK), Vec::with_capacity(BLOCK));
    for j0 in keys.clone().step_by(BLOCK) {
        let j1 = (j0 + BLOCK).min(keys.end);
        let b = j1 - j0;
        kr.clear();
        vr.clear();
        for pos in j0..j1 {
            kr.push(at(kv.k, pos));
            vr.push(at(kv.v, pos));
        }
        let sc = &mut scores[..g * b];
        T::scores(qg, g, &kr, scale, sc);
        for (h, row) in sc.chunks_mut(b).enumerate() {
            let m = row.iter().copied().fold(p.max[h], f32::max);
            corr[h] = if m == p.max[h] { 1.0 } else { (p.max[h] - m).exp() };
            p.max[h] = m;
            p.sum[h] = p.sum[h] * corr[h] + crate::simd::exp_sub_sum(row, m);
        }
        T::accumulate(sc, &corr, &vr, &mut p.acc);
    }
    p
}

/// `o = Σ_s e^{m_s−M}·acc_s / Σ_s e^{m_s−M}·l_s` over the splits in order (`M` their largest maximum).
fn combine<'a>(parts: impl Iterator<Item = (f32, f32, &'a [f32])> + Clone, o: &mut [f32]) {
    let top = parts.clone().map(|(m, ..)| m).fold(f32::NEG_INFINITY, f32::max);
    o.fill(0.0);
    let mut den = 0.0;
    for (m, l, acc) in parts {
        let w = (m - top).exp();
        den += w * l;
        for (a, &x) in o.iter_mut().zip(acc) {
            *a += w * x;
        }
    }
    o.iter_mut().for_each(|x| *x /= den);
}

fn portable_scores<T: Copy>(q: &[f32], g: usize, keys: &[&[T]], scale: f32, s: &mut [f32], f: impl Fn(T) -> f32) {
    let hd = q.len() / g;
    for (h, qh) in q.chunks_exact(hd).enumerate() {
        for (j, k) in keys.iter().enumerate() {
            let mut acc = [0f32; 8];
            for (c, (a, &b)) in qh.iter().zip(k.iter()).enumerate() {
                acc[c % 8] += a * f(b);
            }
            s[h * keys.len() + j] = acc.iter().sum::<f32>() * scale;
        }
    }
}

fn portable_accumulate<T: Copy>(p: &[f32], corr: &[f32], values: &[&[T]], acc: &mut [f32], f: impl Fn(T) -> f32) {
    let hd = acc.len() / corr.len();
    for (h, a) in acc.chunks_exact_mut(hd).enumerate() {
        a.iter_mut().for_each(|x| *x *= corr[h]);
        for (j, v) in values.iter().enumerate() {
            let w = p[h * values.len() + j];
            for (x, &y) in a.iter_mut().zip(v.iter()) {
                *x += w * f(y);
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use crate::simd::x86::{hsum, load_bf16};

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_f32(p: *const f32) -> __m256 {
        // SAFETY: the caller guarantees 8 readable values at p.
        unsafe { _mm256_loadu_ps(p) }
    }

    macro_rules! kernels {
        ($scores:ident, $accumulate:ident, $t:ty, $load:ident) => {
            /// Four query heads against two keys at a time (8 accumulators: each key load serves four
            /// heads, each query load two keys); the rest one dot at a time.
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn $scores(q: &[f32], g: usize, keys: &[&[$t]], scale: f32, s: &mut [f32]) {
                let hd = q.len() / g;
                let nk = keys.len();
                let qp = |h: usize| q[h * hd..].as_ptr();
                let mut h = 0;
                // SAFETY: every row read is `hd` long (`q`'s by its length, the keys' by the caller) and
                // `hd` is whole 8-lane steps; every store is inside `s`'s `g · nk`.
                unsafe {
                    while h + 4 <= g {
                        let mut j = 0;
                        while j + 2 <= nk {
                            let (k0, k1) = (keys[j].as_ptr(), keys[j + 1].as_ptr());
                            let mut acc = [_mm256_setzero_ps(); 8];
                            for c in (0..hd).step_by(8) {
                                let (x0, x1) = ($load(k0.add(c)), $load(k1.add(c)));
                                for r in 0..4 {
                                    let qv = _mm256_loadu_ps(qp(h + r).add(c));
                                    acc[2 * r] = _mm256_fmadd_ps(qv, x0, acc[2 * r]);
                                    acc[2 * r + 1] = _mm256_fmadd_ps(qv, x1, acc[2 * r + 1]);
                                }
                            }
                            for r in 0..4 {
                                s[(h + r) * nk + j] = hsum(acc[2 * r]) * scale;
                                s[(h + r) * nk + j + 1] = hsum(acc[2 * r + 1]) * scale;
                            }
                            j += 2;
                        }
                        h += 4;
                    }
                    for hh in 0..g {
                        let j0 = if hh < h { nk - nk % 2 } else { 0 };
                        for j in j0..nk {
                            let k = keys[j].as_ptr();
                            let mut acc = _mm256_setzero_ps();
                            for c in (0..hd).step_by(8) {
                                acc = _mm256_fmadd_ps(_mm256_loadu_ps(qp(hh).add(c)), $load(k.add(c)), acc);
                            }
                            s[hh * nk + j] = hsum(acc) * scale;
                        }
                    }
                }
            }

            /// Per head, 64 columns of its sum in registers across the block's values (8 independent
            /// FMA chains: the FMA's latency hidden), 8 at a time where the width is not whole 64s.
            #[target_feature(enable = "avx2,fma")]
            pub unsafe fn $accumulate(p: &[f32], corr: &[f32], values: &[&[$t]], acc: &mut [f32]) {
                #[inline]
                #[target_feature(enable = "avx2,fma")]
                unsafe fn columns<const L: usize>(a: *mut f32, w: &[f32], cr: __m256, values: &[&[$t]], c: usize) {
                    // SAFETY: the caller's columns [c, c + 8L) are inside `a`'s row and every value row.
                    unsafe {
                        let mut r = [_mm256_setzero_ps(); L];
                        for (l, r) in r.iter_mut().enumerate() {
                            *r = _mm256_mul_ps(_mm256_loadu_ps(a.add(c + 8 * l)), cr);
                        }
                        for (v, &wj) in values.iter().zip(w) {
                            let wj = _mm256_set1_ps(wj);
                            let v = v.as_ptr().add(c);
                            for (l, r) in r.iter_mut().enumerate() {
                                *r = _mm256_fmadd_ps(wj, $load(v.add(8 * l)), *r);
                            }
                        }
                        for (l, r) in r.iter().enumerate() {
                            _mm256_storeu_ps(a.add(c + 8 * l), *r);
                        }
                    }
                }
                let g = corr.len();
                let hd = acc.len() / g;
                let nk = values.len();
                for h in 0..g {
                    let a = acc[h * hd..(h + 1) * hd].as_mut_ptr();
                    let (w, cr) = (&p[h * nk..(h + 1) * nk], _mm256_set1_ps(corr[h]));
                    let mut c = 0;
                    // SAFETY: `c + 64 ≤ hd`, then `c + 8 ≤ hd` (`hd` whole 8-lane steps: the caller's check).
                    unsafe {
                        while c + 64 <= hd {
                            columns::<8>(a, w, cr, values, c);
                            c += 64;
                        }
                        while c < hd {
                            columns::<1>(a, w, cr, values, c);
                            c += 8;
                        }
                    }
                }
            }
        };
    }

    kernels!(scores_f32, accumulate_f32, f32, load_f32);
    kernels!(scores_bf16, accumulate_bf16, u16, load_bf16);
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn val(i: usize) -> f32 {
        ((i.wrapping_mul(2654435761) >> 7) % 2001) as f32 / 1000.0 - 1.0
    }

    /// Two-pass softmax in f64 over the first `t(i)` rows of contiguous K and V for query position `i`.
    pub(crate) fn exact(
        q: &[f32],
        k: &[f32],
        v: &[f32],
        t: &dyn Fn(usize) -> usize,
        s: AttnShape,
        scale: f32,
    ) -> Vec<f32> {
        let (hd, g) = (s.head_dim, s.heads / s.kv_heads);
        let row = s.kv_heads * hd;
        let mut out = vec![0f32; q.len()];
        for (i, (qi, o)) in q.chunks(hd).zip(out.chunks_mut(hd)).enumerate() {
            let h = i % s.heads;
            let kv = (h / g) * hd;
            let sc: Vec<f64> = (0..t(i / s.heads))
                .map(|j| qi.iter().zip(&k[j * row + kv..]).map(|(&a, &b)| f64::from(a) * f64::from(b)).sum::<f64>())
                .map(|x| x * f64::from(scale))
                .collect();
            let m = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
            let den: f64 = e.iter().sum();
            for (c, o) in o.iter_mut().enumerate() {
                *o = (e.iter().enumerate().map(|(j, w)| w * f64::from(v[j * row + kv + c])).sum::<f64>() / den) as f32;
            }
        }
        out
    }

    pub(crate) fn pages<T: Copy>(x: &[T], page_rows: usize, pad: T) -> Vec<Vec<T>> {
        x.chunks(page_rows).map(|c| c.iter().copied().chain(std::iter::repeat(pad)).take(page_rows).collect()).collect()
    }

    /// A long context (several splits, a partly filled last page, blocks of 16 keys and an odd last one)
    /// against the exact softmax, f32 and bf16 KV, head dims in whole 64-column steps (64), in 8-column
    /// steps (40) and off the SIMD path (12).
    #[test]
    fn long_context_decode_matches_the_exact_attention() {
        for (hd, t, page) in [(64usize, 1_901usize, 16usize), (40, 700, 5), (12, 1_100, 7)] {
            let s = AttnShape { heads: 8, kv_heads: 2, head_dim: hd };
            let row = s.kv_heads * hd;
            let scale = 1.0 / (hd as f32).sqrt();
            // Keys with a drift in position, so later blocks raise the running maximum (a missing rescale
            // shows) and splits differ in their maxima (a wrong combine shows).
            let k: Vec<f32> = (0..t * row).map(|i| val(i + 5) + (i / row) as f32 * 2e-3).collect();
            let v: Vec<f32> = (0..t * row).map(|i| val(i + 77)).collect();
            let q: Vec<f32> = (0..s.heads * hd).map(|i| val(i + 901) * 2.0).collect();
            let want = exact(&q, &k, &v, &|_| t, s, scale);
            let (kp, vp) = (pages(&k, page * row, f32::NAN), pages(&v, page * row, f32::NAN));
            let (kr, vr): (Vec<&[f32]>, Vec<&[f32]>) =
                (kp.iter().map(|p| &p[..]).collect(), vp.iter().map(|p| &p[..]).collect());
            let mut got = vec![0f32; q.len()];
            decode_attention(&q, PagedKv { k: &kr, v: &vr, page }, s, scale, &mut got, &|_| t);
            // f32 sums: a score sums `hd` products (error ≤ hd·2⁻²⁴·Σ|q·k| ≈ 1e-5 relative to scores of a
            // few units), a split sums ≤ 512 weighted values of |v| ≤ 1 in order (≤ 512·2⁻²⁴ ≈ 3e-5
            // of the output's scale) before the combine. 5e-5 holds both; a missing rescale or a wrong
            // combine errs by O(0.1).
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 5e-5, "f32 KV, hd {hd}: max error {err}");

            // bf16 KV against the exact attention over the same bf16 values (widening is exact).
            let to_bf16 = |x: &f32| (x.to_bits() >> 16) as u16;
            let (kb, vb): (Vec<u16>, Vec<u16>) = (k.iter().map(to_bf16).collect(), v.iter().map(to_bf16).collect());
            let widen = |x: &[u16]| x.iter().map(|&b| bf16(b)).collect::<Vec<f32>>();
            let want = exact(&q, &widen(&kb), &widen(&vb), &|_| t, s, scale);
            let (kp, vp) = (pages(&kb, page * row, 0x7fc0), pages(&vb, page * row, 0x7fc0));
            let (kr, vr): (Vec<&[u16]>, Vec<&[u16]>) =
                (kp.iter().map(|p| &p[..]).collect(), vp.iter().map(|p| &p[..]).collect());
            decode_attention(&q, PagedKv { k: &kr, v: &vr, page }, s, scale, &mut got, &|_| t);
            let err = got.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < 5e-5, "bf16 KV, hd {hd}: max error {err}");
        }
    }

    /// A query's output is a function of its own keys only: the rows of a draft verification equal the
    /// same rows decoded one at a time, to the bit, across split boundaries.
    #[test]
    fn a_querys_output_does_not_depend_on_the_others_in_its_call() {
        let s = AttnShape { heads: 4, kv_heads: 1, head_dim: 32 };
        let (past, n) = (SPLIT - 2, 5usize);
        let row = s.head_dim;
        let t = past + n;
        let k: Vec<f32> = (0..t * row).map(|i| val(i + 3)).collect();
        let v: Vec<f32> = (0..t * row).map(|i| val(i + 11)).collect();
        let q: Vec<f32> = (0..n * s.heads * row).map(|i| val(i + 29)).collect();
        let kv = PagedKv { k: &[&k[..]], v: &[&v[..]], page: t };
        let mut all = vec![0f32; q.len()];
        decode_attention(&q, kv, s, 0.2, &mut all, &|i| past + i + 1);
        let w = s.heads * row;
        for i in 0..n {
            let mut one = vec![0f32; w];
            decode_attention(&q[i * w..(i + 1) * w], kv, s, 0.2, &mut one, &|_| past + i + 1);
            assert_eq!(one, all[i * w..(i + 1) * w], "row {i}");
        }
    }
}
