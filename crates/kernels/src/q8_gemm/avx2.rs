//! The NVFP4 × int8 GEMM on AVX2 (and AVX-VNNI CPUs, which run it too): the AVX-512 kernel's scheme
//! at 256 bits, for the CPUs without AVX-512 where prefill otherwise widened every NVFP4 weight to f32
//! for sgemm on each call (issue 54: an AVX2 Zen 3 prefilled a 1k prompt at 0.5–0.65× llama.cpp Q4_0).
//!
//! Layout: a group is 8 weight rows; per block and 4-column step, one 32-byte vector whose 32-bit lane
//! `j` holds row `j`'s 4 codes as `u = 2·e2m1 + 12`. `vpmaddubsw` against an activation row's 4 bytes
//! broadcast adds 2 products into each 16-bit half of a lane (|half| ≤ 2·24·127 = 6,096); the block's 4
//! steps add in 16 bits (≤ 24,384, no overflow), and one `vpmaddwd` with ones makes lane `j` row `j`'s
//! integer block sum. The float work (correction, convert, scale, accumulate) is paid once per 8×16
//! products, as on AVX-512.
//!
//! Batch-invariant: every output is computed by the same instructions in the same order whatever the
//! number of rows around it.

use std::arch::x86_64::*;

use super::{Q8Rows, BLOCK};
use crate::pool::{self, OutPtr};
use crate::q8::LUT_U8 as LUT;

/// Weight rows per task.
const NB: usize = 64;
/// Weight rows per group (one 8-lane vector).
const GROUP: usize = 8;
/// Bytes of one group's block in the tile: 4 steps of 32 bytes.
const GROUP_BLOCK: usize = 4 * 32;
/// Activation rows per micro-tile, against one group: 4 accumulators, 4 block sums, a weight vector,
/// a broadcast and the ones stay in the 16 ymm registers (measured, `timing::gemm_vs` on 512 × 2048 ×
/// 2048: 3 rows × 2 groups spilled, 23.4 ms against 19.4; 6 rows × 1 group 16.9 ms against 16.0).
const MR: usize = 4;

/// One task's weights: per group of 8 rows, per block, four 32-byte steps; and per group and block,
/// the 8 rows' e4m3 scales as f32.
struct Tile {
    w: Vec<u8>,
    s: Vec<f32>,
}

/// [`super::gemm`] on AVX2. Safety: the CPU has AVX2 and FMA; the caller checked the slices' lengths.
pub(super) unsafe fn gemm(a: &Q8Rows, (packed, scales, global): (&[u8], &[u8], f32), n: usize, out: &mut [f32]) {
    let ptr = OutPtr(out.as_mut_ptr());
    let k = a.k;
    pool::for_each_init(
        n.div_ceil(NB),
        || Tile { w: vec![0; NB * k], s: vec![0.0; NB * k / BLOCK] },
        |tile, t| {
            let (r0, r1) = (t * NB, ((t + 1) * NB).min(n));
            let p = ptr;
            // SAFETY: the caller's CPU has the features; rows r0..r1 are inside the weights, and this
            // task alone writes out[:, r0..r1].
            unsafe {
                decode(packed, scales, (r0, r1), k, tile);
                multiply(a, tile, (r0, r1), n, global * 0.5, p.0);
            }
        },
    );
}

/// [`super::quantize_rows`] for one run of rows, a block per two vectors (`vcvtps2dq` rounds to nearest
/// even, as the scalar loop does). Safety: the CPU has AVX2; `q` holds whole blocks, `d` and `corr` one
/// entry per block, `x` at least as many values as `q`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize(x: &[f32], q: &mut [i8], d: &mut [f32], corr: &mut [i32]) {
    // SAFETY: block b reads x[16b..16b+16] and writes q[16b..16b+16], d[b], corr[b].
    unsafe {
        let (lim, sign) = (_mm256_set1_ps(127.0), _mm256_set1_ps(-0.0));
        for b in 0..q.len() / BLOCK {
            let v0 = _mm256_loadu_ps(x.as_ptr().add(b * BLOCK));
            let v1 = _mm256_loadu_ps(x.as_ptr().add(b * BLOCK + 8));
            let m = _mm256_max_ps(_mm256_andnot_ps(sign, v0), _mm256_andnot_ps(sign, v1));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps(m, m, 1)));
            let inv = _mm256_set1_ps(if amax > 0.0 { 127.0 / amax } else { 0.0 });
            let clamp = |v: __m256| _mm256_min_ps(_mm256_max_ps(_mm256_mul_ps(v, inv), _mm256_sub_ps(sign, lim)), lim);
            let (i0, i1) = (_mm256_cvtps_epi32(clamp(v0)), _mm256_cvtps_epi32(clamp(v1)));
            // Packing works per 128-bit lane: (i0.lo, i1.lo, i0.hi, i1.hi) as i16, then bytes 0-3, 8-11,
            // 4-7, 12-15 as i8; a dword permute puts them back in order.
            let w = _mm256_packs_epi32(i0, i1);
            let bytes = _mm256_packs_epi16(w, w);
            let ordered = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 0, 0, 0, 0));
            _mm_storeu_si128(q.as_mut_ptr().add(b * BLOCK).cast(), _mm256_castsi256_si128(ordered));
            let s = _mm256_add_epi32(i0, i1);
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01));
            d[b] = amax / 127.0;
            corr[b] = -12 * _mm_cvtsi128_si32(s);
        }
    }
}

/// Decodes weight rows `r0..r1` (at most 64) into `tile`; rows past `r1` in the last group repeat row
/// `r0` with a zero scale, so their lanes sum to zero and are never stored.
#[target_feature(enable = "avx2,fma")]
unsafe fn decode(packed: &[u8], scales: &[u8], (r0, r1): (usize, usize), k: usize, tile: &mut Tile) {
    let kb = k / BLOCK;
    let groups = (r1 - r0).div_ceil(GROUP);
    // SAFETY: every 8 bytes read lie in a row r0..r1 (or row r0) of `packed`, every scale in one of
    // those rows; tile writes stay in its 64 · k bytes and 64 · k / 16 scales.
    unsafe {
        let lut128 = _mm_loadu_si128(LUT.as_ptr().cast());
        let lut = _mm256_set_m128i(lut128, lut128);
        let nib = _mm256_set1_epi8(0x0F);
        for g in 0..groups {
            let row = |j: usize| {
                let r = r0 + g * GROUP + j;
                if r < r1 {
                    r
                } else {
                    r0
                }
            };
            let off: [usize; GROUP] = std::array::from_fn(|j| row(j) * k / 2);
            let tw = tile.w.as_mut_ptr().add(g * kb * GROUP_BLOCK);
            for b in 0..kb {
                let q = |j: usize| std::ptr::read_unaligned(packed.as_ptr().add(off[j] + b * 8) as *const i64);
                // Each 128-bit lane unpacks into two rows' 16 codes in column order: rows (0, 1) and
                // (4, 5) from the first load, (2, 3) and (6, 7) from the second.
                let (r04, r15) = rows16(_mm256_setr_epi64x(q(0), q(1), q(4), q(5)), lut, nib);
                let (r26, r37) = rows16(_mm256_setr_epi64x(q(2), q(3), q(6), q(7)), lut, nib);
                // A 4 × 4 transpose of dwords per lane: step s holds dword s of rows 0..7 in order.
                let (e0, e1) = (_mm256_unpacklo_epi32(r04, r15), _mm256_unpackhi_epi32(r04, r15));
                let (f0, f1) = (_mm256_unpacklo_epi32(r26, r37), _mm256_unpackhi_epi32(r26, r37));
                let steps = [
                    _mm256_unpacklo_epi64(e0, f0),
                    _mm256_unpackhi_epi64(e0, f0),
                    _mm256_unpacklo_epi64(e1, f1),
                    _mm256_unpackhi_epi64(e1, f1),
                ];
                for (s, v) in steps.iter().enumerate() {
                    _mm256_storeu_si256(tw.add(b * GROUP_BLOCK + s * 32).cast(), *v);
                }
            }
            let ts = &mut tile.s[g * kb * GROUP..(g + 1) * kb * GROUP];
            for j in 0..GROUP {
                let r = r0 + g * GROUP + j;
                for b in 0..kb {
                    ts[b * GROUP + j] = if r < r1 { crate::nvfp4::E4M3[scales[r * kb + b] as usize] } else { 0.0 };
                }
            }
        }
    }
}

/// Two rows' 8 code bytes per 128-bit lane (row `a` in the low qword, `b` in the high) to their 16
/// table values in column order: `(rows a, rows b)`.
#[inline]
#[target_feature(enable = "avx2,fma")]
fn rows16(p: __m256i, lut: __m256i, nib: __m256i) -> (__m256i, __m256i) {
    let lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(p, nib));
    let hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16::<4>(p), nib));
    (_mm256_unpacklo_epi8(lo, hi), _mm256_unpackhi_epi8(lo, hi))
}

/// Activation rows for a micro-tile.
#[derive(Clone, Copy)]
struct Rows {
    q: *const i8,
    d: *const f32,
    corr: *const i32,
    k: usize,
}

/// Every activation row against the tile's rows `r0..r1`, written to `out[i·n + r]` scaled by `scale`.
#[target_feature(enable = "avx2,fma")]
unsafe fn multiply(a: &Q8Rows, tile: &Tile, (r0, r1): (usize, usize), n: usize, scale: f32, out: *mut f32) {
    let (m, kb) = (a.rows(), a.k / BLOCK);
    let groups = (r1 - r0).div_ceil(GROUP);
    // SAFETY: micro-tiles stay inside a's rows, the tile's groups and out's columns r0..r1.
    unsafe {
        for g in 0..groups {
            let cols = (r1 - r0 - g * GROUP).min(GROUP);
            let o = out.add(r0 + g * GROUP);
            let (tw, ts) = (tile.w.as_ptr().add(g * kb * GROUP_BLOCK), tile.s.as_ptr().add(g * kb * GROUP));
            let mut i = 0;
            while i < m {
                let rows = MR.min(m - i);
                let at = Rows {
                    q: a.q.as_ptr().add(i * a.k),
                    d: a.d.as_ptr().add(i * kb),
                    corr: a.corr.as_ptr().add(i * kb),
                    k: a.k,
                };
                let dst = (o.add(i * n), n, cols, scale);
                match rows {
                    4 => micro::<4>(at, tw, ts, kb, dst),
                    3 => micro::<3>(at, tw, ts, kb, dst),
                    2 => micro::<2>(at, tw, ts, kb, dst),
                    _ => micro::<1>(at, tw, ts, kb, dst),
                }
                i += rows;
            }
        }
    }
}

/// `T` activation rows × one group of 8 weight rows over all blocks; `dst` is (first output, row
/// stride, valid columns, scale).
#[inline]
#[target_feature(enable = "avx2,fma")]
unsafe fn micro<const T: usize>(
    a: Rows,
    tw: *const u8,
    ts: *const f32,
    kb: usize,
    (out, stride, cols, scale): (*mut f32, usize, usize, f32),
) {
    // SAFETY: the caller guarantees T rows of a, the group's blocks in the tile and the output columns.
    unsafe {
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); T];
        for b in 0..kb {
            let mut sum = [_mm256_setzero_si256(); T];
            for step in 0..4 {
                let w = _mm256_loadu_si256(tw.add(b * GROUP_BLOCK + step * 32).cast());
                for (t, s) in sum.iter_mut().enumerate() {
                    let q = std::ptr::read_unaligned(a.q.add(t * a.k + b * BLOCK + step * 4) as *const i32);
                    *s = _mm256_add_epi16(*s, _mm256_maddubs_epi16(w, _mm256_set1_epi32(q)));
                }
            }
            let ws = _mm256_loadu_ps(ts.add(b * GROUP));
            for (t, v) in acc.iter_mut().enumerate() {
                let d = _mm256_set1_ps(*a.d.add(t * kb + b));
                let corr = _mm256_set1_epi32(*a.corr.add(t * kb + b));
                let lanes = _mm256_add_epi32(_mm256_madd_epi16(sum[t], ones), corr);
                *v = _mm256_fmadd_ps(_mm256_cvtepi32_ps(lanes), _mm256_mul_ps(ws, d), *v);
            }
        }
        let sc = _mm256_set1_ps(scale);
        for (t, v) in acc.iter().enumerate() {
            let dst = out.add(t * stride);
            let y = _mm256_mul_ps(*v, sc);
            if cols == GROUP {
                _mm256_storeu_ps(dst, y);
            } else {
                let lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
                let mask = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols as i32), lane);
                _mm256_maskstore_ps(dst, mask, y);
            }
        }
    }
}
