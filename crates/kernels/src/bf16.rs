//! bf16 × bf16 dot-product tiles for the fast precision on CPUs with AVX512-BF16.
//!
//! Why: `vdpbf16ps` does 32 multiply-adds per instruction, twice an f32 FMA's; on Zen 4, where 512-bit
//! FMAs are double-pumped, it is the only way past the f32 peak. Activations are rounded to bf16 once
//! per matmul (round to nearest even); weights are bf16 already, or NVFP4 rows decoded into a bf16
//! scratch tile (e2m1 × e4m3 has at most 6 significant bits, so that tile is exact and the global scale
//! multiplies the f32 result).
//!
//! Layout: both operands are k-contiguous rows (`x[m, k]`, `W[n, k]`, the checkpoint's own layout), so
//! nothing is repacked: a micro-tile of R weight rows × T activation rows keeps R·T sixteen-lane f32
//! accumulators, each step reading 32 columns of every row once, and sums each accumulator's lanes at
//! the end. Products of two bf16 values are exact in f32; only the summation order differs from a
//! scalar loop (and `vdpbf16ps` treats bf16 subnormals as zero).

use std::sync::OnceLock;

/// Columns per `vdpbf16ps` step: the width must be a multiple of it.
pub const STEP: usize = 32;
/// Weight rows per micro-tile.
const R: usize = 3;
/// Activation rows per micro-tile (U·R·T accumulators + R weight registers + 1 stay within 32 zmm).
const T: usize = 4;
/// Accumulators per (activation, weight) pair, taking 32-column steps in turn.
const U: usize = 2;

/// Whether this CPU has AVX-512 F/BW and BF16 (detected once).
pub fn available() -> bool {
    static HAVE: OnceLock<bool> = OnceLock::new();
    *HAVE.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512bf16")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// f32 → bf16 bits, rounded to nearest even (NaN stays NaN).
#[inline]
pub fn round(v: f32) -> u16 {
    let b = v.to_bits();
    if v.is_nan() {
        return ((b >> 16) | 0x40) as u16;
    }
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

/// A row of f32 as bf16 bits (see [`round`]); with AVX512-BF16, 32 values per `vcvtne2ps2bf16`, which
/// rounds the same way but flushes subnormal inputs to zero (as `vdpbf16ps` reads them anyway).
pub fn round_row(src: &[f32], dst: &mut [u16]) {
    let n = src.len().min(dst.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if available() {
        // SAFETY: the CPU has the features; the kernel touches the first n elements of both slices only.
        done = unsafe { x86::round_row(&src[..n], &mut dst[..n]) };
    }
    for (d, &s) in dst[done..n].iter_mut().zip(&src[done..n]) {
        *d = round(s);
    }
}

/// One NVFP4 weight row (`packed` k/2 bytes, `scales` k/16 codes) as bf16 in `out` (k values) without
/// its global scale, which then scales the sums: exact, as e2m1 × e4m3 has at most 6 significant bits.
/// `wide` is scratch for the row in f32.
pub fn nvfp4_row(packed: &[u8], scales: &[u8], wide: &mut Vec<f32>, out: &mut [u16]) {
    wide.resize(out.len(), 0.0);
    crate::nvfp4::dequant_row(packed, scales, 1.0, wide);
    round_row(wide, out);
}

/// The operands of [`gemm_nt`]: `rows` rows of `k` bf16 values each.
#[derive(Clone, Copy, Debug)]
pub struct Rows<'a> {
    /// Row-major values, at least `rows · k` of them.
    pub data: &'a [u16],
    /// Number of rows.
    pub rows: usize,
}

/// `out[i·os.0 + r·os.1] = scale · Σ_c a[i, c] · b[r, c]` for every row `i` of `a` and `r` of `b`, each
/// `k` long; single-threaded (callers split the weight rows across the pool).
///
/// Batch-invariant: every output is computed by the same instructions in the same order whatever the
/// number of rows around it, so a token's logits do not depend on what it was batched with (a request
/// recomputed after preemption gets the same answer as one that never was).
///
/// Panics (a bug) unless [`available`], `k` is a multiple of [`STEP`] and the slices hold their rows;
/// `out` must hold every index written.
pub fn gemm_nt(a: Rows<'_>, b: Rows<'_>, k: usize, scale: f32, out: &mut [f32], os: (usize, usize)) {
    if a.rows == 0 || b.rows == 0 {
        return;
    }
    assert!((a.rows - 1) * os.0 + (b.rows - 1) * os.1 < out.len(), "bf16 tile output: a bug");
    // SAFETY: every write is inside out (asserted above).
    unsafe { gemm_nt_raw(a, b, k, scale, out.as_mut_ptr(), os) }
}

/// [`gemm_nt`] into a raw output, for pool items that write disjoint elements of one matrix (no slice
/// of it is theirs alone).
///
/// # Safety
/// `out.add(i·os.0 + r·os.1)` must be valid for writes, and written by no one else meanwhile, for every
/// row `i` of `a` and `r` of `b`.
pub(crate) unsafe fn gemm_nt_raw(a: Rows<'_>, b: Rows<'_>, k: usize, scale: f32, out: *mut f32, os: (usize, usize)) {
    assert!(available() && k.is_multiple_of(STEP), "bf16 tiles need AVX512-BF16 and k % 32 == 0: a bug");
    assert!(a.data.len() >= a.rows * k && b.data.len() >= b.rows * k, "bf16 tile operands: a bug");
    if a.rows == 0 || b.rows == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the CPU has the features (asserted); every read is inside a's and b's rows, every write
    // one the caller vouches for.
    unsafe {
        x86::gemm_nt(a.data.as_ptr(), a.rows, b.data.as_ptr(), b.rows, k, scale, out, os)
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{R, STEP, T, U};

    /// Activation bytes that stay in L2 (1 MiB per core on Zen 4) through a block of weight rows: up to
    /// this (a prefill chunk's routed expert, ~16 rows), weight tiles are the outer loop, so each weight
    /// row comes from DRAM once and feeds every activation tile while in L1; more (a dense prefill's 512
    /// rows), activation tiles are, and the block's weights stay in L2.
    const ACTS_IN_L2: usize = 256 << 10;

    /// Weight tiles ahead that a tile prefetches. Rows are 4 KiB pages at k = 2048, where the hardware
    /// prefetchers stop, so without this each new tile's rows start with misses to DRAM: an expert read
    /// cold ran at 100 GMAC/s against 160 warm, with compute and DRAM adding up.
    const PREFETCH_TILES: usize = 2;

    /// Weight rows ahead that a decode row prefetches (few activation rows: one weight row at a time).
    const PREFETCH_ROWS: usize = 4;

    /// `TT` activation rows × `RR` weight rows over all `k` columns. Each (activation, weight) pair has
    /// two accumulators taking 32-column steps in turn (two independent `vdpbf16ps` chains per weight row
    /// keep decode, one row, above the DRAM's rate), a last partial round goes to the first, and the two
    /// are summed then across lanes: the same for every tile shape. Two rather than four leave room for
    /// 3 × 4 tiles (7 loads per 12 products instead of 5 per 6): 512-token bf16 prefill on q35moe-L4
    /// 325 → 355 tok/s, decode 46.2 → 46.3 (medians of 5 interleaved, 2026-12-06). `ahead` (address,
    /// bytes) is memory to prefetch meanwhile, spread over the rounds; it changes no result.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn tile<const RR: usize, const TT: usize>(
        a: *const u16,
        b: *const u16,
        k: usize,
        scale: f32,
        out: *mut f32,
        os: (usize, usize),
        ahead: (*const u8, usize),
    ) {
        // SAFETY: the caller guarantees TT rows of a and RR rows of b of k elements, and every output index.
        unsafe {
            let load = |p: *const u16| std::mem::transmute::<__m512i, __m512bh>(_mm512_loadu_si512(p.cast()));
            let mut acc = [[[_mm512_setzero_ps(); U]; RR]; TT];
            let mut c = 0;
            // `ahead`'s lines spread over this tile's rounds; `_MM_HINT_T1` (into L2) measured better than
            // T0, whose misses compete with the tile's own loads for L1's miss buffers.
            let per = ahead.1.div_ceil(64).div_ceil((k / (U * STEP)).max(1));
            let mut line = 0;
            while c + U * STEP <= k {
                for _ in 0..per {
                    if line * 64 < ahead.1 {
                        _mm_prefetch::<_MM_HINT_T1>(ahead.0.wrapping_add(line * 64).cast());
                    }
                    line += 1;
                }
                for u in 0..U {
                    let mut w = [load(b); RR];
                    for (r, wr) in w.iter_mut().enumerate() {
                        *wr = load(b.add(r * k + c + u * STEP));
                    }
                    for (t, row) in acc.iter_mut().enumerate() {
                        let x = load(a.add(t * k + c + u * STEP));
                        for (r, v) in row.iter_mut().enumerate() {
                            v[u] = _mm512_dpbf16_ps(v[u], x, w[r]);
                        }
                    }
                }
                c += U * STEP;
            }
            while c < k {
                for (t, row) in acc.iter_mut().enumerate() {
                    let x = load(a.add(t * k + c));
                    for (r, v) in row.iter_mut().enumerate() {
                        v[0] = _mm512_dpbf16_ps(v[0], x, load(b.add(r * k + c)));
                    }
                }
                c += STEP;
            }
            for (t, row) in acc.iter().enumerate() {
                for (r, v) in row.iter().enumerate() {
                    let s = _mm512_add_ps(v[0], v[1]);
                    *out.add(t * os.0 + r * os.1) = scale * _mm512_reduce_add_ps(s);
                }
            }
        }
    }

    /// Rounds the whole 32-value groups of `src` into `dst` (equal lengths); returns how many it did.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    pub(super) unsafe fn round_row(src: &[f32], dst: &mut [u16]) -> usize {
        let whole = src.len() / 32 * 32;
        // SAFETY: every access is below `whole` <= both lengths.
        unsafe {
            for i in (0..whole).step_by(32) {
                let lo = _mm512_loadu_ps(src.as_ptr().add(i));
                let hi = _mm512_loadu_ps(src.as_ptr().add(i + 16));
                let b = _mm512_cvtne2ps_pbh(hi, lo);
                _mm512_storeu_si512(dst.as_mut_ptr().add(i).cast(), std::mem::transmute::<__m512bh, __m512i>(b));
            }
        }
        whole
    }

    macro_rules! dispatch {
        ($rr:expr, $tt:expr, $args:tt; $($r:literal)*; $($t:literal)*) => {
            dispatch!(@r $rr, $tt, $args; [$($t)*]; $($r)*)
        };
        (@r $rr:expr, $tt:expr, $args:tt; $ts:tt; $($r:literal)*) => {
            match $rr {
                $($r => dispatch!(@t $r, $tt, $args; $ts),)*
                _ => unreachable!(),
            }
        };
        (@t $r:literal, $tt:expr, ($a:expr, $b:expr, $k:expr, $s:expr, $o:expr, $os:expr, $ah:expr); [$($t:literal)*]) => {
            match $tt {
                $($t => tile::<$r, $t>($a, $b, $k, $s, $o, $os, $ah),)*
                _ => unreachable!(),
            }
        };
    }

    /// Up to four activation rows (decode): one weight row at a time, so the rows stream from DRAM one
    /// after another (interleaving four weight rows measured ~15% slower there). More: tiles of T
    /// activation rows (they stay in L1) × R weight rows.
    #[target_feature(enable = "avx512f,avx512bw,avx512bf16")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn gemm_nt(
        a: *const u16,
        m: usize,
        b: *const u16,
        n: usize,
        k: usize,
        scale: f32,
        out: *mut f32,
        os: (usize, usize),
    ) {
        // SAFETY: tiles stay inside a (m rows), b (n rows) and the output indices the caller checked.
        unsafe {
            if m <= 4 {
                // Decode: each weight row prefetches the one PREFETCH_ROWS on (its 4 KiB pages are where the
                // hardware prefetchers stop), inside this call's rows.
                for r in 0..n {
                    let (pb, po) = (b.add(r * k), out.add(r * os.1));
                    let ahead = if r + PREFETCH_ROWS < n {
                        (b.add((r + PREFETCH_ROWS) * k).cast::<u8>(), 2 * k)
                    } else {
                        (std::ptr::null(), 0)
                    };
                    dispatch!(1, m, (a, pb, k, scale, po, os, ahead); 1; 1 2 3 4);
                }
                return;
            }
            let weights_outer = m * k * 2 <= ACTS_IN_L2;
            let tile = |i0: usize, r0: usize| {
                let (tt, rr) = (T.min(m - i0), R.min(n - r0));
                let (pa, pb, po) = (a.add(i0 * k), b.add(r0 * k), out.add(i0 * os.0 + r0 * os.1));
                // The weight tile PREFETCH_TILES on: spread over the activation tiles when weights are the
                // outer loop, else prefetched by the first (later ones find this block in L2).
                let next = (r0 + R * PREFETCH_TILES).min(n);
                let bytes = 2 * k * R.min(n - next);
                let (parts, part) = if weights_outer { (m.div_ceil(T), i0 / T) } else { (1, i0 / T) };
                let ahead = if part < parts {
                    let (lo, hi) = (bytes * part / parts / 64 * 64, bytes * (part + 1) / parts / 64 * 64);
                    (b.wrapping_add(next * k).cast::<u8>().wrapping_add(lo), hi - lo)
                } else {
                    (std::ptr::null(), 0)
                };
                dispatch!(rr, tt, (pa, pb, k, scale, po, os, ahead); 1 2 3; 1 2 3 4);
            };
            if weights_outer {
                for r0 in (0..n).step_by(R) {
                    for i0 in (0..m).step_by(T) {
                        tile(i0, r0);
                    }
                }
            } else {
                for i0 in (0..m).step_by(T) {
                    for r0 in (0..n).step_by(R) {
                        tile(i0, r0);
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(b: u16) -> f64 {
        f32::from_bits(u32::from(b) << 16) as f64
    }

    #[test]
    fn rounding_is_to_nearest_even() {
        assert_eq!(round(1.0), 0x3f80);
        // 1 + 2^-8 is halfway between 1 and 1 + 2^-7: ties go to the even mantissa (1.0).
        assert_eq!(round(1.0 + 1.0 / 256.0), 0x3f80);
        assert_eq!(round(1.0 + 3.0 / 256.0), 0x3f82);
        assert_eq!(round(-2.5), half::bf16::from_f32(-2.5).to_bits());
        for i in 0..10_000 {
            let v = (i as f32 * 0.37).sin() * 1e3;
            assert_eq!(round(v), half::bf16::from_f32(v).to_bits(), "{v}");
        }
        assert!(f32::from_bits(u32::from(round(f32::NAN)) << 16).is_nan());
    }

    /// The vector rounding equals the scalar one on normal values, in both halves of every group and in
    /// the scalar tail.
    #[test]
    fn row_rounding_equals_scalar_rounding() {
        let src: Vec<f32> = (0..1000).map(|i| (i as f32 * 0.377).sin() * 10f32.powi(i % 7 - 3)).collect();
        let mut got = vec![0u16; src.len()];
        round_row(&src, &mut got);
        for (i, (&g, &v)) in got.iter().zip(&src).enumerate() {
            assert_eq!(g, round(v), "value {i}: {v}");
        }
    }

    /// A row's result is bit-identical whether it is computed alone (decode) or inside any batch, with
    /// weight tiles or activation tiles in the outer loop (128 rows of 1,024 fill `ACTS_IN_L2` exactly,
    /// 130 exceed it). Mutation-checked: sending the last partial round to the second accumulator in the
    /// decode shape only breaks it.
    #[test]
    fn results_do_not_depend_on_the_batch() {
        if !available() {
            return;
        }
        for (k, ms) in [(352, &[2usize, 3, 4, 5, 7, 17][..]), (1024, &[128, 130][..])] {
            batch_invariance(k, ms);
        }
    }

    fn batch_invariance(k: usize, ms: &[usize]) {
        let n = 9;
        let a: Vec<u16> = (0..ms[ms.len() - 1] * k).map(|i| round((i as f32 * 0.731).sin())).collect();
        let b: Vec<u16> = (0..n * k).map(|i| round((i as f32 * 0.277).cos())).collect();
        let w = Rows { data: &b, rows: n };
        for &m in ms {
            let mut batch = vec![0f32; m * n];
            gemm_nt(Rows { data: &a, rows: m }, w, k, 1.0, &mut batch, (n, 1));
            for i in 0..m {
                let mut alone = vec![0f32; n];
                gemm_nt(Rows { data: &a[i * k..(i + 1) * k], rows: 1 }, w, k, 1.0, &mut alone, (n, 1));
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&batch[i * n..(i + 1) * n]), bits(&alone), "m={m} row {i}");
            }
        }
    }

    /// Every tile shape (the decode rows 1-4, remainders of 2 weight rows and 3 activation rows) against
    /// an f64 sum of the same bf16 values, with strided output; k = 224 is one round of four steps and a
    /// partial round of three.
    #[test]
    fn tiles_of_every_shape_equal_an_f64_sum() {
        if !available() {
            eprintln!("no AVX512-BF16 here: the bf16 tiles are not used on this CPU");
            return;
        }
        let k = 224;
        for (m, n) in [(1, 1), (1, 70), (2, 7), (3, 5), (6, 4), (7, 9), (13, 11), (4, 64)] {
            let a: Vec<u16> = (0..m * k).map(|i| round(((i * 7919 % 97) as f32 / 97.0) - 0.5)).collect();
            let b: Vec<u16> = (0..n * k).map(|i| round(((i * 104729 % 89) as f32 / 89.0) - 0.5)).collect();
            let mut out = vec![f32::NAN; m * n * 2];
            gemm_nt(Rows { data: &a, rows: m }, Rows { data: &b, rows: n }, k, 0.5, &mut out, (1, 2 * m));
            for i in 0..m {
                for r in 0..n {
                    let want: f64 = 0.5 * (0..k).map(|c| f(a[i * k + c]) * f(b[r * k + c])).sum::<f64>();
                    let got = out[i + r * 2 * m];
                    // 224 exact products of magnitude <= 0.25, summed in f32: error below 1e-5.
                    assert!((got as f64 - want).abs() < 1e-5, "m={m} n={n} ({i},{r}): {got} vs {want}");
                }
            }
        }
    }
}
