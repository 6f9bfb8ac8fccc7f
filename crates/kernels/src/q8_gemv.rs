//! NVFP4 × int8 for a few activation rows (decode batches, a prefill chunk's small experts) on AVX-512
//! VNNI: 16 weight rows transposed in registers, so one `vpdpbusd` adds 4 products into each of 16 rows'
//! lanes and every weight byte is decoded once for all activation rows (issue 54 item 4).
//!
//! Why: at 2–15 rows both older paths were compute-bound (`timing::dense_rows`, 8192 × 2048, cold, 2
//! threads): the per-row dot ([`crate::q8::dot`]) decodes each weight again for every activation row and
//! sums horizontally (4.4 GB/s of weights at 8 rows, 21 at one), and the int8 GEMM ([`crate::q8_gemm`])
//! builds its interleaved tile with 8-byte gathers, inserts and two-source permutes (10.4 GB/s at 8 rows,
//! 13.7 at one). This kernel: 13.9 GB/s at 8 rows, 23.7 at two.
//!
//! How: a group is 16 weight rows. Per 128 columns, one 64-byte load per row and a 16 × 16 transpose of
//! 32-bit words (64 shuffles) leave, in word `w`, lane `j` = row `j`'s 8 codes of columns 8w..8w+8: the
//! low nibbles are its even columns, the high nibbles its odd ones, and one table shuffle each makes the
//! unsigned codes `u = 2·e2m1 + 12` ([`crate::q8_gemm`]'s scheme). The activations are reordered once per
//! call to match (per 8 columns: the 4 even, then the 4 odd), so a broadcast word meets each half. The
//! block scales of the group's rows are transposed the same way into a small table, 16 rows per block.
//!
//! Numbers: per block and activation row the integer sum is the int8 GEMM's (the same products plus the
//! same correction, all exact), and the float steps are its micro-kernel's in its order (convert, scale ×
//! activation scale, fused add; the tensor scale last), so the outputs equal [`crate::q8_gemm::gemm`]'s
//! bit for bit, whatever the number of rows.

use crate::nvfp4::BLOCK;
use crate::pool::{self, OutPtr};
use crate::q8::Isa;
use crate::q8_gemm::Q8Rows;

/// Weight rows per group (one 16-lane vector).
const GROUP: usize = 16;
/// Weight rows per pool task.
const TASK_ROWS: usize = 64;
/// Activation rows per pass over a group (their accumulators stay in registers).
const MR: usize = 8;
/// Columns per transposed chunk (64 bytes of codes per row).
const CHUNK: usize = 128;

/// Whether this CPU runs it (AVX-512 VNNI).
pub fn available() -> bool {
    Isa::detected() == Isa::Avx512Vnni
}

/// `out[i, r] = Σ_c x[i, c] · W[r, c]` for the quantised rows `a` ([`crate::q8_gemm::quantize_rows`]) and
/// NVFP4 weight rows `[n, k]`, equal bit for bit to [`crate::q8_gemm::gemm`]; weight rows split across
/// the pool in tasks of 64.
///
/// Panics (a bug) unless [`available`] and the slices hold their rows.
pub fn gemv(a: &Q8Rows, (packed, scales, global): (&[u8], &[u8], f32), n: usize, out: &mut [f32]) {
    let (m, k) = (a.rows(), a.k);
    assert!(available(), "the int8 GEMV needs AVX-512 VNNI: a bug");
    assert!(k.is_multiple_of(BLOCK) && k > 0, "int8 GEMV width: a bug");
    assert!(packed.len() >= n * k / 2 && scales.len() >= n * k / BLOCK, "int8 GEMV weights: a bug");
    assert!(out.len() >= m * n, "int8 GEMV output: a bug");
    if m == 0 || n == 0 {
        return;
    }
    let qr = reorder(&a.q);
    let ptr = OutPtr(out.as_mut_ptr());
    let kb = k / BLOCK;
    pool::for_each_init(
        n.div_ceil(TASK_ROWS),
        || vec![0f32; kb * GROUP],
        |ts, t| {
            let p = ptr;
            let end = ((t + 1) * TASK_ROWS).min(n);
            for r0 in (t * TASK_ROWS..end).step_by(GROUP) {
                let rows = GROUP.min(n - r0);
                // The task's next group, read while this one is computed (its rows are contiguous).
                let next = (r0 + GROUP < end).then(|| (r0 + GROUP, GROUP.min(end - r0 - GROUP)));
                #[cfg(target_arch = "x86_64")]
                // SAFETY: the CPU has the features (asserted); rows r0..r0+rows lie in the weights
                // (asserted) and this task alone writes out[:, r0..r0 + rows].
                unsafe {
                    x86::scales(scales, (r0, rows), kb, ts);
                    if let Some((r, rows)) = next {
                        x86::prefetch(scales.as_ptr().add(r * kb), rows * kb);
                    }
                    let mut i = 0;
                    while i < m {
                        let t = MR.min(m - i);
                        let at = x86::Acts {
                            q: qr[i * k..].as_ptr(),
                            d: a.d[i * kb..].as_ptr(),
                            corr: a.corr[i * kb..].as_ptr(),
                            k,
                        };
                        let dst = (p.0.add(i * n + r0), n, rows, global * 0.5);
                        let ahead =
                            next.filter(|_| i == 0).map(|(r, rows)| (packed.as_ptr().add(r * k / 2), rows * k / 2));
                        x86::group_rows(t, at, packed, (r0, rows), ts, dst, ahead);
                        i += t;
                    }
                }
                #[cfg(not(target_arch = "x86_64"))]
                let _ = (ts, rows, p);
            }
        },
    );
}

/// The activation codes per 8 columns as the transposed words meet them: the 4 even columns, then the
/// 4 odd ones.
fn reorder(q: &[i8]) -> Vec<i8> {
    let mut out = vec![0i8; q.len()];
    for (o, x) in out.chunks_exact_mut(8).zip(q.chunks_exact(8)) {
        for i in 0..4 {
            o[i] = x[2 * i];
            o[4 + i] = x[2 * i + 1];
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{CHUNK, GROUP, MR};
    use crate::nvfp4::BLOCK;
    use crate::q8::x86::e4m3_512;
    use crate::q8::LUT_U8 as LUT;

    /// Activation rows of a pass: reordered codes, per-block scales and corrections.
    #[derive(Clone, Copy)]
    pub(super) struct Acts {
        pub q: *const i8,
        pub d: *const f32,
        pub corr: *const i32,
        pub k: usize,
    }

    /// The 16 × 16 transpose of 32-bit words: `out[w]` lane `j` = `r[j]` lane `w`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    fn transpose(r: &[__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for p in 0..8 {
            t[2 * p] = _mm512_unpacklo_epi32(r[2 * p], r[2 * p + 1]);
            t[2 * p + 1] = _mm512_unpackhi_epi32(r[2 * p], r[2 * p + 1]);
        }
        // u[4q + c], 128-bit lane L: rows 4q..4q+4 of word 4L + c.
        let mut u = [_mm512_setzero_si512(); 16];
        for q in 0..4 {
            let (a, b) = (4 * q, 4 * q + 2);
            u[4 * q] = _mm512_unpacklo_epi64(t[a], t[b]);
            u[4 * q + 1] = _mm512_unpackhi_epi64(t[a], t[b]);
            u[4 * q + 2] = _mm512_unpacklo_epi64(t[a + 1], t[b + 1]);
            u[4 * q + 3] = _mm512_unpackhi_epi64(t[a + 1], t[b + 1]);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for c in 0..4 {
            let v = _mm512_shuffle_i32x4::<0x88>(u[c], u[4 + c]);
            let w = _mm512_shuffle_i32x4::<0xDD>(u[c], u[4 + c]);
            let v2 = _mm512_shuffle_i32x4::<0x88>(u[8 + c], u[12 + c]);
            let w2 = _mm512_shuffle_i32x4::<0xDD>(u[8 + c], u[12 + c]);
            out[c] = _mm512_shuffle_i32x4::<0x88>(v, v2);
            out[8 + c] = _mm512_shuffle_i32x4::<0xDD>(v, v2);
            out[4 + c] = _mm512_shuffle_i32x4::<0x88>(w, w2);
            out[12 + c] = _mm512_shuffle_i32x4::<0xDD>(w, w2);
        }
        out
    }

    /// 64 bytes of each of the group's rows from byte `at` of a row of `len` bytes (zeros past the
    /// row's end); rows past `rows` repeat the first row.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    unsafe fn load_rows(base: *const u8, len: usize, rows: usize, at: usize) -> [__m512i; 16] {
        let left = len - at;
        let mask: __mmask64 = if left >= 64 { u64::MAX } else { (1u64 << left) - 1 };
        // SAFETY: the caller passes rows that lie in the weights; the mask keeps the load inside the row.
        std::array::from_fn(|j| unsafe {
            let r = if j < rows { j } else { 0 };
            _mm512_maskz_loadu_epi8(mask, base.add(r * len + at).cast())
        })
    }

    /// The group's block scales (rows `r0..r0 + rows`) decoded into `ts[b·16 + j]` (rows past `rows`
    /// take row `r0`'s: their lanes are never stored).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn scales(scales: &[u8], (r0, rows): (usize, usize), kb: usize, ts: &mut [f32]) {
        // SAFETY: rows r0..r0+rows hold kb scale bytes each (the caller asserted the lengths); ts holds
        // kb · 16 floats.
        unsafe {
            let base = scales.as_ptr().add(r0 * kb);
            for b0 in (0..kb).step_by(64) {
                let words = transpose(&load_rows(base, kb, rows, b0));
                for (w, word) in words.iter().enumerate() {
                    for s in 0..4 {
                        let b = b0 + 4 * w + s;
                        if b >= kb {
                            return;
                        }
                        let codes = _mm512_and_si512(
                            _mm512_srlv_epi32(*word, _mm512_set1_epi32(8 * s as i32)),
                            _mm512_set1_epi32(0xFF),
                        );
                        _mm512_storeu_ps(ts.as_mut_ptr().add(b * GROUP), e4m3_512(codes));
                    }
                }
            }
        }
    }

    /// Asks for `len` bytes from `p` (whole lines).
    #[inline]
    pub(super) fn prefetch(p: *const u8, len: usize) {
        for line in (0..len).step_by(64) {
            // SAFETY: x86-64 has SSE; a prefetch reads nothing into the program and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(line).cast()) };
        }
    }

    /// `t` (1 ..= 8) activation rows against the group; `ahead` (the next group's codes) is asked for
    /// a part per chunk.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn group_rows(
        t: usize,
        a: Acts,
        packed: &[u8],
        group: (usize, usize),
        ts: &[f32],
        dst: (*mut f32, usize, usize, f32),
        ahead: Option<(*const u8, usize)>,
    ) {
        // SAFETY: forwarded from the caller.
        unsafe {
            match t {
                8 => group_t::<8>(a, packed, group, ts, dst, ahead),
                7 => group_t::<7>(a, packed, group, ts, dst, ahead),
                6 => group_t::<6>(a, packed, group, ts, dst, ahead),
                5 => group_t::<5>(a, packed, group, ts, dst, ahead),
                4 => group_t::<4>(a, packed, group, ts, dst, ahead),
                3 => group_t::<3>(a, packed, group, ts, dst, ahead),
                2 => group_t::<2>(a, packed, group, ts, dst, ahead),
                _ => group_t::<1>(a, packed, group, ts, dst, ahead),
            }
        }
    }

    /// `T` activation rows × the group's 16 weight rows over every block; `dst` is (first output, row
    /// stride, valid columns, scale).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn group_t<const T: usize>(
        a: Acts,
        packed: &[u8],
        (r0, rows): (usize, usize),
        ts: &[f32],
        (out, stride, cols, scale): (*mut f32, usize, usize, f32),
        ahead: Option<(*const u8, usize)>,
    ) {
        const { assert!(T <= MR) };
        let (k, kb) = (a.k, a.k / BLOCK);
        let len = k / 2;
        // SAFETY: rows r0..r0+rows of `packed` hold len bytes each; the activations hold T rows of k
        // codes and kb scales; ts holds kb · 16; the output T rows of `cols` columns at `stride`.
        unsafe {
            let base = packed.as_ptr().add(r0 * len);
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(LUT.as_ptr().cast()));
            let nib = _mm512_set1_epi8(0x0F);
            let mut acc = [_mm512_setzero_ps(); T];
            let chunks = k.div_ceil(CHUNK);
            for c0 in (0..k).step_by(CHUNK) {
                // A chunk's share of the next group's bytes, so its misses overlap this group's work.
                if let Some((p, bytes)) = ahead {
                    let share = bytes.div_ceil(chunks).next_multiple_of(64);
                    let from = c0 / CHUNK * share;
                    prefetch(p.add(from), share.min(bytes.saturating_sub(from)));
                }
                let words = transpose(&load_rows(base, len, rows, c0 / 2));
                for bl in 0..(kb - c0 / BLOCK).min(CHUNK / BLOCK) {
                    let b = c0 / BLOCK + bl;
                    let (w0, w1) = (words[2 * bl], words[2 * bl + 1]);
                    let u = [
                        _mm512_shuffle_epi8(lut, _mm512_and_si512(w0, nib)),
                        _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(w0), nib)),
                        _mm512_shuffle_epi8(lut, _mm512_and_si512(w1, nib)),
                        _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(w1), nib)),
                    ];
                    let ws = _mm512_loadu_ps(ts.as_ptr().add(b * GROUP));
                    for (i, acc) in acc.iter_mut().enumerate() {
                        let q = a.q.add(i * k + b * BLOCK);
                        let mut s = _mm512_set1_epi32(*a.corr.add(i * kb + b));
                        for (h, u) in u.iter().enumerate() {
                            let x = std::ptr::read_unaligned(q.add(4 * h) as *const i32);
                            s = _mm512_dpbusd_epi32(s, *u, _mm512_set1_epi32(x));
                        }
                        let d = _mm512_set1_ps(*a.d.add(i * kb + b));
                        *acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_mul_ps(ws, d), *acc);
                    }
                }
            }
            let sc = _mm512_set1_ps(scale);
            let mask: __mmask16 = if cols >= 16 { 0xFFFF } else { (1u16 << cols) - 1 };
            for (i, v) in acc.iter().enumerate() {
                _mm512_mask_storeu_ps(out.add(i * stride), mask, _mm512_mul_ps(*v, sc));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_gemm::{gemm, quantize_rows};

    fn weights(n: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<u8>) {
        let packed = (0..n * k / 2).map(|i| ((i * 131 + seed * 17) % 256) as u8).collect();
        // Normals, subnormals and a negative scale.
        let scales = (0..n * k / 16).map(|i| [0x38, 0x30, 0x41, 0x05, 0x7E, 0x01, 0xAA][(i * 5 + seed) % 7]).collect();
        (packed, scales)
    }

    fn acts(m: usize, k: usize, seed: usize) -> Vec<f32> {
        (0..m * k).map(|i| (((i * 7919 + seed * 31) % 97) as f32 / 48.5 - 1.0) * (1.0 + (i % 5) as f32)).collect()
    }

    /// The int8 GEMM's bits at every row count 1–19 (one and several passes of 8), weight rows not a
    /// multiple of 16, widths with a partial chunk of 128 columns and a partial run of 64 scale blocks,
    /// and a single block. Mutation-checked: swapping the even and odd halves of the reordered
    /// activations, dropping the correction, or a wrong 128-bit-lane order in the transpose fail it.
    #[test]
    fn equals_the_int8_gemm_bit_for_bit() {
        if !available() {
            eprintln!("no AVX-512 VNNI here: the int8 GEMV is not used on this CPU");
            return;
        }
        for (n, k) in [(1, 16), (17, 48), (64, 128), (70, 1040), (33, 2048), (16, 4096)] {
            let (packed, scales) = weights(n, k, k);
            for m in (1..=10).chain([15, 16, 19]) {
                let a = quantize_rows(&acts(m, k, n + m), m, k);
                let (mut want, mut got) = (vec![f32::NAN; m * n], vec![f32::NAN; m * n]);
                gemm(&a, (&packed, &scales, 0.75), n, &mut want);
                gemv(&a, (&packed, &scales, 0.75), n, &mut got);
                for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert_eq!(g.to_bits(), w.to_bits(), "m={m} n={n} k={k} [{idx}]: {g} vs {w}");
                }
            }
        }
    }

    #[test]
    fn the_reorder_puts_even_columns_first() {
        let q: Vec<i8> = (0..16).collect();
        assert_eq!(reorder(&q), [0, 2, 4, 6, 1, 3, 5, 7, 8, 10, 12, 14, 9, 11, 13, 15]);
    }
}
