//! NVFP4 × int8 GEMM for prefill-shaped matmuls (many activation rows), on AVX-512 VNNI (here) and on
//! AVX2 ([`avx2`], the same scheme at 256 bits).
//!
//! Why: the bf16 tiles do 32 multiply-adds per `vdpbf16ps`; `vpdpbusd` does 64. llama.cpp's Q4_0
//! prefill quantises its activations to int8 and runs `vpdpbusd`; this is the same for NVFP4.
//!
//! Numbers: activations are quantised per 16-value block (the NVFP4 block) to int8, `d = max|x| / 127`
//! as on the decode path ([`crate::q8`]). A weight code becomes `u = 2·e2m1 + 12 ∈ [0, 24]` (unsigned,
//! what `vpdpbusd` takes first); `Σ u·q − 12·Σ q = 2·Σ e2m1·q` is an exact integer per block, which is
//! converted once and multiplied by the weight's e4m3 block scale and the activation's scale. The
//! tensor's global scale (and the factor ½) multiply each output once.
//!
//! Layout: a task decodes 64 weight rows into an interleaved tile, 16 rows per group: for each block
//! and each 4-column step, one 64-byte vector whose 32-bit lane `j` holds row `j`'s 4 values. One
//! `vpdpbusd` with an activation row's 4 bytes broadcast then adds 4 products into every row's lane, and
//! after the block's 4 steps lane `j` is row `j`'s integer block sum: the float work (convert, scale,
//! accumulate) is paid once per 16×16 products, and no horizontal sum is needed. Rows are never
//! repacked at load: the tile is rebuilt per call (~30 vector instructions per 256 weights), paid once
//! for all activation rows.
//!
//! Batch-invariant: every output is computed by the same instructions in the same order whatever the
//! number of rows around it.

use crate::nvfp4::{e4m3_to_f32, BLOCK};
use crate::pool::{self, OutPtr};
use crate::q8::Isa;

/// Weight rows per task.
const NB: usize = 64;
/// Weight rows per group (one 16-lane vector).
const GROUP: usize = 16;
/// Activation rows per micro-tile (2 groups × MR rows of accumulators and block sums stay in 32 zmm).
const MR: usize = 4;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Whether this CPU runs the int8 GEMM: AVX-512 F/BW with VNNI (64-byte lanes, `vpdpbusd`), or AVX2
/// with FMA (32-byte lanes, `vpmaddubsw`: [`avx2`]), the decode path's level, detected once there.
pub fn available() -> bool {
    matches!(Isa::detected(), Isa::Avx512Vnni | Isa::AvxVnni | Isa::Avx2)
}

/// The instructions the int8 GEMM runs on this CPU (for logs).
pub fn name() -> &'static str {
    if Isa::detected() == Isa::Avx512Vnni {
        "int8 gemm avx512-vnni"
    } else {
        "int8 gemm avx2"
    }
}

/// Activation rows quantised per 16-value block, in column order.
#[derive(Clone, Debug, Default)]
pub struct Q8Rows {
    /// `rows × k` int8 values.
    pub q: Vec<i8>,
    /// Per row and block: the activation scale.
    pub d: Vec<f32>,
    /// Per row and block: `−12 · Σ q` (removes the `+12` of the unsigned weight codes).
    pub corr: Vec<i32>,
    /// Row length.
    pub k: usize,
}

impl Q8Rows {
    /// Number of rows.
    pub fn rows(&self) -> usize {
        self.q.len().checked_div(self.k).unwrap_or(0)
    }
}

/// Quantises `m` rows of `k` values (`k` a multiple of 16): per block `d = max|x| / 127`,
/// `q = round_ties_even(x / d)` (the rounding `vcvtps2dq` does, so the loop vectorises).
pub fn quantize_rows(x: &[f32], m: usize, k: usize) -> Q8Rows {
    assert!(k.is_multiple_of(BLOCK) && x.len() == m * k, "q8 rows are whole blocks: this is a bug");
    let kb = k / BLOCK;
    let mut a = Q8Rows { q: vec![0; m * k], d: vec![0.0; m * kb], corr: vec![0; m * kb], k };
    // Rows split across the pool in runs of 16 (a prefill chunk's rows quantise in parallel).
    let rows_per = 16;
    let (q, d, corr) = (&mut a.q, &mut a.d, &mut a.corr);
    let mut parts: Vec<(&mut [i8], &mut [f32], &mut [i32])> = q
        .chunks_mut(rows_per * k)
        .zip(d.chunks_mut(rows_per * kb))
        .zip(corr.chunks_mut(rows_per * kb))
        .map(|((q, d), c)| (q, d, c))
        .collect();
    pool::chunks_mut(&mut parts, 1, |p, part| {
        let (q, d, corr) = &mut part[0];
        quantize_run(Isa::detected(), &x[p * rows_per * k..][..q.len()], q, d, corr);
    });
    a
}

/// One run of whole blocks quantised on `isa` (which the CPU must have): every level gives the same
/// bits as the scalar loop (`the_vector_quantisation_equals_the_scalar_one`).
fn quantize_run(isa: Isa, x: &[f32], q: &mut [i8], d: &mut [f32], corr: &mut [i32]) {
    assert!(x.len() == q.len() && q.len() == d.len() * BLOCK && d.len() == corr.len(), "q8 run: a bug");
    match isa {
        // SAFETY: `Isa::available` lists a level only when the CPU has its features; lengths asserted.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::quantize(x, q, d, corr) },
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni | Isa::Avx2 => unsafe { avx2::quantize(x, q, d, corr) },
        _ => quantize_scalar(x, q, d, corr),
    }
}

fn quantize_scalar(x: &[f32], q: &mut [i8], d: &mut [f32], corr: &mut [i32]) {
    for (blk, ((qb, db), cb)) in q.chunks_mut(BLOCK).zip(d.iter_mut()).zip(corr.iter_mut()).enumerate() {
        let xs = &x[blk * BLOCK..(blk + 1) * BLOCK];
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (o, &v) in qb.iter_mut().zip(xs) {
            let r = (v * inv).round_ties_even().clamp(-127.0, 127.0) as i8;
            sum += i32::from(r);
            *o = r;
        }
        *db = amax / 127.0;
        *cb = -12 * sum;
    }
}

/// `out[i, r] = Σ_c x[i, c] · W[r, c]` for the quantised rows `a` and NVFP4 weight rows `[n, k]`
/// (`packed` k/2 bytes and `scales` k/16 e4m3 codes per row, `global` the tensor scale), split by
/// blocks of weight rows across the pool.
///
/// Panics (a bug) unless [`available`] and the slices hold their rows.
pub fn gemm(a: &Q8Rows, weights: (&[u8], &[u8], f32), n: usize, out: &mut [f32]) {
    gemm_on(Isa::detected(), a, weights, n, out)
}

/// The int8 GEMMs `isa` selects: AVX-512 VNNI's, or the AVX2 one for any lower x86 level.
pub fn isas() -> Vec<Isa> {
    Isa::available().into_iter().filter(|&i| matches!(i, Isa::Avx512Vnni | Isa::Avx2)).collect()
}

/// [`gemm`] on `isa`'s kernel (one of [`isas`]; the tests run each this CPU has).
pub fn gemm_on(isa: Isa, a: &Q8Rows, (packed, scales, global): (&[u8], &[u8], f32), n: usize, out: &mut [f32]) {
    let (m, k) = (a.rows(), a.k);
    assert!(available() && Isa::available().contains(&isa), "the int8 GEMM needs AVX2 or AVX-512 VNNI: a bug");
    assert!(k.is_multiple_of(BLOCK) && k > 0, "int8 GEMM width: a bug");
    assert!(packed.len() >= n * k / 2 && scales.len() >= n * k / BLOCK, "int8 GEMM weights: a bug");
    assert!(out.len() >= m * n, "int8 GEMM output: a bug");
    if m == 0 || n == 0 {
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if isa != Isa::Avx512Vnni {
        // SAFETY: every level `available` lists has AVX2 + FMA; the lengths are asserted above.
        return unsafe { avx2::gemm(a, (packed, scales, global), n, out) };
    }
    let ptr = OutPtr(out.as_mut_ptr());
    pool::for_each_init(
        n.div_ceil(NB),
        || Tile { w: vec![0; NB * k], s: vec![0.0; NB * k / BLOCK] },
        |tile, t| {
            let (r0, r1) = (t * NB, ((t + 1) * NB).min(n));
            let p = ptr;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: the CPU has the features (asserted); rows r0..r1 are inside the weights (asserted),
            // and this task alone writes out[:, r0..r1].
            unsafe {
                x86::decode(packed, scales, (r0, r1), k, tile);
                x86::multiply(a, tile, (r0, r1), n, global * 0.5, p.0);
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (tile, r0, r1, p);
        },
    );
}

/// One task's weights, interleaved (see the module docs): per group of 16 rows, per block, four 64-byte
/// steps; and per group and block, the 16 rows' decoded e4m3 scales.
struct Tile {
    w: Vec<u8>,
    s: Vec<f32>,
}

/// The scalar reference the vector path is tested against: the same integers, summed in f64.
pub fn reference(a: &Q8Rows, weights: (&[u8], &[u8], f32), n: usize) -> Vec<f64> {
    reference_with_magnitude(a, weights, n).into_iter().map(|(v, _)| v).collect()
}

/// [`reference`], each output with the magnitude its f32 evaluation rounds at: per block
/// `|scale·d|·Σ_c (|2·e2m1_c| + 24)·|q_c|`, summed. The kernels add 12 to every code (unsigned operands)
/// and take it out again with a correction, so a block's float steps see the shifted sum and the
/// correction, not just the block's term; each block's steps round a few times and each of the `k / 16`
/// additions rounds the running sum: `|f32 − exact| ≤ (k/16 + 3)·2⁻²⁴·magnitude`. (A bound relative to the
/// result itself fails where blocks cancel.)
pub fn reference_with_magnitude(
    a: &Q8Rows,
    (packed, scales, global): (&[u8], &[u8], f32),
    n: usize,
) -> Vec<(f64, f64)> {
    let (m, k, kb) = (a.rows(), a.k, a.k / BLOCK);
    let mut out = vec![(0f64, 0f64); m * n];
    for i in 0..m {
        for r in 0..n {
            let (mut total, mut magnitude) = (0f64, 0f64);
            for b in 0..kb {
                let (mut s, mut shifted) = (0i64, 0i64);
                for c in b * BLOCK..(b + 1) * BLOCK {
                    let byte = packed[r * k / 2 + c / 2];
                    let code = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                    let (w, q) = ((2.0 * crate::nvfp4::e2m1_to_f32(code)) as i64, i64::from(a.q[i * k + c]));
                    (s, shifted) = (s + w * q, shifted + (w.abs() + 24) * q.abs());
                }
                let sd = f64::from(e4m3_to_f32(scales[r * kb + b])) * f64::from(a.d[i * kb + b]);
                (total, magnitude) = (total + s as f64 * sd, magnitude + shifted as f64 * sd.abs());
            }
            let g = f64::from(global) * 0.5;
            out[i * n + r] = (total * g, magnitude * g.abs());
        }
    }
    out
}

/// The bound of [`reference_with_magnitude`] for an output of width `k` and magnitude `magnitude`:
/// `(k/16 + 3)·2⁻²⁴·magnitude`.
pub fn reference_bound(k: usize, magnitude: f64) -> f64 {
    (k / BLOCK + 3) as f64 * f64::from(f32::EPSILON) / 2.0 * magnitude
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{e4m3_to_f32, Q8Rows, Tile, BLOCK, GROUP, MR};
    use crate::q8::x86::e4m3_512;
    use crate::q8::LUT_U8 as LUT;

    /// Bytes of one group's block in the tile: 4 steps of 64 bytes.
    const GROUP_BLOCK: usize = 4 * 64;

    /// Decodes weight rows `r0..r1` (at most 64) into `tile`; rows past `r1` in the last group repeat
    /// row `r0` with a zero scale, so their lanes sum to zero and are never stored.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn decode(packed: &[u8], scales: &[u8], (r0, r1): (usize, usize), k: usize, tile: &mut Tile) {
        let kb = k / BLOCK;
        let groups = (r1 - r0).div_ceil(GROUP);
        // SAFETY: every 8 bytes read lie in a row r0..r1 (or row r0) of `packed`, every scale in one of
        // those rows; tile writes stay in its 64 · k bytes and 64 · k / 16 scales.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(LUT.as_ptr().cast()));
            let nib = _mm512_set1_epi8(0x0F);
            // Step s of a block takes dword s of every row: rows 2L (from the low unpack) and 2L+1 (from
            // the high unpack) sit in 128-bit lane L.
            let idx: [__m512i; 4] = std::array::from_fn(|s| {
                let lane = |j: i32| {
                    let r = j % 8;
                    (r % 2) * 16 + 4 * (r / 2) + s as i32
                };
                _mm512_setr_epi32(
                    lane(0),
                    lane(1),
                    lane(2),
                    lane(3),
                    lane(4),
                    lane(5),
                    lane(6),
                    lane(7),
                    lane(8),
                    lane(9),
                    lane(10),
                    lane(11),
                    lane(12),
                    lane(13),
                    lane(14),
                    lane(15),
                )
            });
            // Where block b0 + t of a row's scales goes: lane j of block b0 + t, 16 floats apart.
            let lanes = _mm512_mullo_epi32(
                _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                _mm512_set1_epi32(GROUP as i32),
            );
            for g in 0..groups {
                let row = |j: usize| {
                    let r = r0 + g * GROUP + j;
                    if r < r1 {
                        r
                    } else {
                        r0
                    }
                };
                let off = |j: usize| row(j) * k / 2;
                let tw = tile.w.as_mut_ptr().add(g * kb * GROUP_BLOCK);
                // The next group's scales (read row by row below, two lines each) and first weight lines
                // are asked for now, so their misses overlap this group's decode.
                for j in 0..GROUP {
                    let r = r0 + (g + 1) * GROUP + j;
                    if r < r1 {
                        for line in (0..kb).step_by(64) {
                            _mm_prefetch::<_MM_HINT_T0>(scales.as_ptr().add(r * kb + line).cast());
                        }
                        _mm_prefetch::<_MM_HINT_T0>(packed.as_ptr().add(r * k / 2).cast());
                    }
                }
                for b in 0..kb {
                    // The 16 rows are 16 streams the hardware prefetcher does not follow well from a
                    // gather: each row's cache line 4 lines ahead is asked for once per line (8 blocks).
                    if b % 8 == 0 && b + 32 < kb {
                        for j in 0..GROUP {
                            let line = packed.as_ptr().add(off(j) + (b + 32) * 8);
                            _mm_prefetch::<_MM_HINT_T0>(line.cast());
                        }
                    }
                    let mut halves = [[_mm512_setzero_si512(); 2]; 2];
                    for h in 0..2 {
                        let q = |j: usize| {
                            std::ptr::read_unaligned(packed.as_ptr().add(off(8 * h + j) + b * 8) as *const i64)
                        };
                        let p = _mm512_setr_epi64(q(0), q(1), q(2), q(3), q(4), q(5), q(6), q(7));
                        let ul = _mm512_shuffle_epi8(lut, _mm512_and_si512(p, nib));
                        let uh = _mm512_shuffle_epi8(lut, _mm512_and_si512(_mm512_srli_epi16::<4>(p), nib));
                        halves[h] = [_mm512_unpacklo_epi8(ul, uh), _mm512_unpackhi_epi8(ul, uh)];
                    }
                    for (s, ix) in idx.iter().enumerate() {
                        let first = _mm512_permutex2var_epi32(halves[0][0], *ix, halves[0][1]);
                        let second = _mm512_permutex2var_epi32(halves[1][0], *ix, halves[1][1]);
                        let v = _mm512_mask_blend_epi32(0xFF00, first, second);
                        _mm512_storeu_si512(tw.add(b * GROUP_BLOCK + s * 64).cast(), v);
                    }
                }
                let ts = &mut tile.s[g * kb * GROUP..(g + 1) * kb * GROUP];
                for j in 0..GROUP {
                    let r = r0 + g * GROUP + j;
                    if r >= r1 {
                        (0..kb).for_each(|b| ts[b * GROUP + j] = 0.0);
                        continue;
                    }
                    // 16 blocks' scales of row j at a time, converted in a vector and scattered to lane j
                    // of each block (a scalar conversion per scale cost as much as the weights' decode).
                    let whole = kb / 16 * 16;
                    for b0 in (0..whole).step_by(16) {
                        let codes = _mm512_cvtepu8_epi32(_mm_loadu_si128(scales.as_ptr().add(r * kb + b0).cast()));
                        let v = e4m3_512(codes);
                        _mm512_i32scatter_ps::<4>(ts.as_mut_ptr().add(b0 * GROUP + j).cast(), lanes, v);
                    }
                    for b in whole..kb {
                        ts[b * GROUP + j] = e4m3_to_f32(scales[r * kb + b]);
                    }
                }
            }
        }
    }

    /// [`super::quantize_rows`] for one run of rows: one block per vector (`vcvtps2dq` rounds to
    /// nearest even, as the scalar loop does).
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn quantize(x: &[f32], q: &mut [i8], d: &mut [f32], corr: &mut [i32]) {
        // SAFETY: block b reads x[16b..16b+16] and writes q[16b..16b+16], d[b], corr[b]: all in bounds
        // (the caller passes whole blocks).
        unsafe {
            let (lim, zero) = (_mm512_set1_ps(127.0), _mm512_setzero_ps());
            for b in 0..q.len() / BLOCK {
                let v = _mm512_loadu_ps(x.as_ptr().add(b * BLOCK));
                let amax = _mm512_reduce_max_ps(_mm512_abs_ps(v));
                let inv = if amax > 0.0 { 127.0 / amax } else { 0.0 };
                let s =
                    _mm512_min_ps(_mm512_max_ps(_mm512_mul_ps(v, _mm512_set1_ps(inv)), _mm512_sub_ps(zero, lim)), lim);
                let i = _mm512_cvtps_epi32(s);
                _mm_storeu_si128(q.as_mut_ptr().add(b * BLOCK).cast(), _mm512_cvtepi32_epi8(i));
                d[b] = amax / 127.0;
                corr[b] = -12 * _mm512_reduce_add_epi32(i);
            }
        }
    }

    /// Every activation row against the tile's rows `r0..r1`, written to `out[i·n + r]` scaled by `scale`.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    pub(super) unsafe fn multiply(
        a: &Q8Rows,
        tile: &Tile,
        (r0, r1): (usize, usize),
        n: usize,
        scale: f32,
        out: *mut f32,
    ) {
        let (m, kb) = (a.rows(), a.k / BLOCK);
        let groups = (r1 - r0).div_ceil(GROUP);
        // SAFETY: micro-tiles stay inside a's rows, the tile's groups and out's columns r0..r1.
        unsafe {
            let mut g = 0;
            while g < groups {
                let ng = if groups - g >= 2 { 2 } else { 1 };
                let cols = (r1 - r0 - g * GROUP).min(ng * GROUP);
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
                    match (ng, rows) {
                        (2, 4) => micro::<4, 2>(at, tw, ts, kb, dst),
                        (2, 3) => micro::<3, 2>(at, tw, ts, kb, dst),
                        (2, 2) => micro::<2, 2>(at, tw, ts, kb, dst),
                        (2, _) => micro::<1, 2>(at, tw, ts, kb, dst),
                        (_, 4) => micro::<4, 1>(at, tw, ts, kb, dst),
                        (_, 3) => micro::<3, 1>(at, tw, ts, kb, dst),
                        (_, 2) => micro::<2, 1>(at, tw, ts, kb, dst),
                        _ => micro::<1, 1>(at, tw, ts, kb, dst),
                    }
                    i += rows;
                }
                g += ng;
            }
        }
    }

    /// Activation rows for a micro-tile.
    #[derive(Clone, Copy)]
    struct Rows {
        q: *const i8,
        d: *const f32,
        corr: *const i32,
        k: usize,
    }

    /// `T` activation rows × `G` groups of 16 weight rows over all blocks; `dst` is (first output,
    /// row stride, valid columns, scale).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni")]
    unsafe fn micro<const T: usize, const G: usize>(
        a: Rows,
        tw: *const u8,
        ts: *const f32,
        kb: usize,
        (out, stride, cols, scale): (*mut f32, usize, usize, f32),
    ) {
        // SAFETY: the caller guarantees T rows of a, G groups of the tile and the output columns.
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); G]; T];
            for b in 0..kb {
                let mut sum = [[_mm512_setzero_si512(); G]; T];
                for (t, s) in sum.iter_mut().enumerate() {
                    *s = [_mm512_set1_epi32(*a.corr.add(t * kb + b)); G];
                }
                for step in 0..4 {
                    let mut w = [_mm512_setzero_si512(); G];
                    for (g, v) in w.iter_mut().enumerate() {
                        *v = _mm512_loadu_si512(tw.add(g * kb * GROUP_BLOCK + b * GROUP_BLOCK + step * 64).cast());
                    }
                    for (t, s) in sum.iter_mut().enumerate() {
                        let q = std::ptr::read_unaligned(a.q.add(t * a.k + b * BLOCK + step * 4) as *const i32);
                        let x = _mm512_set1_epi32(q);
                        for (g, v) in s.iter_mut().enumerate() {
                            *v = _mm512_dpbusd_epi32(*v, w[g], x);
                        }
                    }
                }
                let mut ws = [_mm512_setzero_ps(); G];
                for (g, v) in ws.iter_mut().enumerate() {
                    *v = _mm512_loadu_ps(ts.add(g * kb * GROUP + b * GROUP));
                }
                for (t, row) in acc.iter_mut().enumerate() {
                    let d = _mm512_set1_ps(*a.d.add(t * kb + b));
                    for (g, v) in row.iter_mut().enumerate() {
                        *v = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum[t][g]), _mm512_mul_ps(ws[g], d), *v);
                    }
                }
            }
            let sc = _mm512_set1_ps(scale);
            for (t, row) in acc.iter().enumerate() {
                for (g, v) in row.iter().enumerate() {
                    let valid = cols.saturating_sub(g * GROUP).min(GROUP);
                    let mask: __mmask16 = if valid >= 16 { 0xFFFF } else { (1u16 << valid) - 1 };
                    _mm512_mask_storeu_ps(out.add(t * stride + g * GROUP), mask, _mm512_mul_ps(*v, sc));
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvfp4::dequant_row;

    fn weights(n: usize, k: usize, seed: usize) -> (Vec<u8>, Vec<u8>) {
        let packed = (0..n * k / 2).map(|i| ((i * 131 + seed * 17) % 256) as u8).collect();
        // Normals and subnormals (ModelOpt scales are positive).
        let scales = (0..n * k / 16).map(|i| [0x38, 0x30, 0x41, 0x05, 0x7E, 0x01, 0x2A][(i + seed) % 7]).collect();
        (packed, scales)
    }

    fn acts(m: usize, k: usize, seed: usize) -> Vec<f32> {
        (0..m * k).map(|i| (((i * 7919 + seed * 31) % 97) as f32 / 48.5 - 1.0) * (1.0 + (i % 5) as f32)).collect()
    }

    /// Odd shapes (weight rows not a multiple of 16 or 64, activation rows not a multiple of 4, one
    /// block) against the same integers summed in f64: only the f32 accumulation differs. Mutation-
    /// checked: swapping two steps' activation bytes, or dropping the correction, breaks it.
    #[test]
    fn every_shape_computes_the_same_integers_as_the_reference() {
        if !available() {
            eprintln!("no AVX2 here: the int8 GEMM is not used on this CPU");
            return;
        }
        for (m, n, k) in [(1, 1, 16), (5, 17, 48), (9, 64, 64), (13, 70, 128), (4, 130, 2048), (33, 33, 96)] {
            let (packed, scales) = weights(n, k, m);
            let a = quantize_rows(&acts(m, k, n), m, k);
            let want = reference(&a, (&packed, &scales, 0.75), n);
            for isa in isas() {
                let mut got = vec![f32::NAN; m * n];
                gemm_on(isa, &a, (&packed, &scales, 0.75), n, &mut got);
                for (idx, (g, w)) in got.iter().zip(&want).enumerate() {
                    let tol = 1e-5 * w.abs().max(1.0) * (k as f64 / 16.0).sqrt();
                    assert!((f64::from(*g) - w).abs() <= tol, "{isa:?} m={m} n={n} k={k} [{idx}]: {g} vs {w}");
                }
            }
        }
    }

    /// Every vector quantisation gives the scalar loop's bits: ties to even, zero blocks, a block
    /// whose maximum is negative, values that round to the clamp.
    #[test]
    fn the_vector_quantisation_equals_the_scalar_one() {
        let mut x = acts(3, 64, 5);
        x[16..32].fill(0.0);
        for (i, v) in x[32..48].iter_mut().enumerate() {
            *v = -127.0 + i as f32 * 0.5; // steps of exactly ½: every other value a tie
        }
        x[48..64].copy_from_slice(&[
            -3.0, 1.5, 0.25, 2.9999, -0.5, 0.0, 1e-30, -1e-30, 7.0, 3.5, -3.5, 1.0, 2.0, 2.5, -2.5, 0.1,
        ]);
        let blocks = x.len() / BLOCK;
        let (mut q0, mut d0, mut c0) = (vec![0i8; x.len()], vec![0f32; blocks], vec![0i32; blocks]);
        quantize_scalar(&x, &mut q0, &mut d0, &mut c0);
        for isa in Isa::available() {
            let (mut q, mut d, mut c) = (vec![0i8; x.len()], vec![0f32; blocks], vec![0i32; blocks]);
            quantize_run(isa, &x, &mut q, &mut d, &mut c);
            assert_eq!((&q, &c), (&q0, &c0), "{isa:?}");
            assert_eq!(
                d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                d0.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
            );
        }
    }

    /// The drift against f32 activations is the activations' rounding only: each moves by at most half
    /// a step of its block (`max|x| / 254`), so `|got − exact| ≤ Σ_blocks Σ |w| · step / 2` (the decode
    /// path's bound), plus f32 summation.
    #[test]
    fn the_int8_gemm_is_within_activation_rounding_of_the_exact_product() {
        if !available() {
            eprintln!("no AVX2 here: the int8 GEMM is not used on this CPU");
            return;
        }
        let (m, n, k) = (7, 20, 512);
        let (packed, scales) = weights(n, k, 3);
        let x = acts(m, k, 9);
        let mut got = vec![0f32; m * n];
        gemm(&quantize_rows(&x, m, k), (&packed, &scales, 0.75), n, &mut got);
        for r in 0..n {
            let mut w = vec![0f32; k];
            dequant_row(&packed[r * k / 2..(r + 1) * k / 2], &scales[r * k / 16..(r + 1) * k / 16], 0.75, &mut w);
            for i in 0..m {
                let xs = &x[i * k..(i + 1) * k];
                let exact: f64 = xs.iter().zip(&w).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
                let bound: f64 = xs
                    .chunks(16)
                    .zip(w.chunks(16))
                    .map(|(xb, wb)| {
                        let step = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / 127.0;
                        wb.iter().map(|v| f64::from(v.abs())).sum::<f64>() * step / 2.0
                    })
                    .sum();
                let g = f64::from(got[i * n + r]);
                assert!((g - exact).abs() <= bound * 1.001 + 1e-3, "({i},{r}): {g} vs {exact} (bound {bound})");
            }
        }
    }

    /// A row's result is bit-identical alone or inside any batch.
    #[test]
    fn results_do_not_depend_on_the_batch() {
        if !available() {
            return;
        }
        let (n, k) = (40, 128);
        let (packed, scales) = weights(n, k, 1);
        let x = acts(11, k, 2);
        let all = quantize_rows(&x, 11, k);
        for isa in isas() {
            let mut batch = vec![0f32; 11 * n];
            gemm_on(isa, &all, (&packed, &scales, 0.5), n, &mut batch);
            for i in 0..11 {
                let one = quantize_rows(&x[i * k..(i + 1) * k], 1, k);
                let mut alone = vec![0f32; n];
                gemm_on(isa, &one, (&packed, &scales, 0.5), n, &mut alone);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&batch[i * n..(i + 1) * n]), bits(&alone), "{isa:?} row {i}");
            }
        }
    }
}
