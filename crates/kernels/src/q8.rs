//! NVFP4 × int8 decode dot products: the activations of a GEMV are quantised once per matmul to int8
//! per 16-value block, so a weight block's dot product is an exact integer sum scaled once by the e4m3
//! block scale and the activation scale.
//!
//! Why it is exact in integers: 2·e2m1 takes the values 0, 1, 2, 3, 4, 6, 8, 12 (signed), so a weight
//! code becomes an int8 by a 16-entry table lookup (`vpshufb`). The lookup yields `u = 2·w + 12 ∈ [0, 24]`
//! (unsigned, what `vpdpbusd` / `vpmaddubsw` take as their first operand); the `12·Σx` this adds is
//! subtracted through a per-lane correction computed with the activations.
//!
//! Layout: per 64-column chunk, the 32 packed bytes give their 32 low nibbles (even columns) then their
//! 32 high nibbles (odd columns); the activations are stored in the same order at quantisation time, so
//! the weights need no shuffling. Each 32-bit lane of a dot instruction sums 4 bytes, all of one
//! 16-column block: lane ℓ belongs to block `(ℓ mod 8) / 2`.
//!
//! Four paths, picked once ([`Isa::detected`]): AVX-512 VNNI (`vpdpbusd`, 64 columns per instruction),
//! AVX-VNNI (the 256-bit `vpdpbusd` of AVX2 CPUs that have it), AVX2 (`vpmaddubsw` + `vpmaddwd`; no
//! overflow: |pair sum| ≤ 2·24·127), portable. They compute the same integers; only the f32
//! accumulation order differs. Tests run every path the CPU has against the portable one.

use std::sync::OnceLock;

use crate::nvfp4::e4m3_to_f32;

/// Columns per chunk.
pub const CHUNK: usize = 64;
/// Lanes (4-byte groups) per chunk.
const LANES: usize = CHUNK / 4;

/// `2·e2m1(code) + 12` for every 4-bit code (sign in bit 3).
pub(crate) const LUT_U8: [u8; 16] = {
    let mut t = [0u8; 16];
    let mut c = 0;
    while c < 16 {
        let mag = [0u8, 1, 2, 3, 4, 6, 8, 12][c & 7];
        t[c] = if c & 8 != 0 { 12 - mag } else { 12 + mag };
        c += 1;
    }
    t
};

/// An instruction-set level of the x86 kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Isa {
    /// AVX-512 F/BW with VNNI.
    Avx512Vnni,
    /// AVX2 + FMA with AVX-VNNI (the 256-bit `vpdpbusd` of CPUs without AVX-512: Alder Lake and later,
    /// Zen 5 client parts).
    AvxVnni,
    /// AVX2 + FMA.
    Avx2,
    /// Scalar code.
    Portable,
}

impl Isa {
    /// The best level this CPU runs, detected once.
    pub fn detected() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| *Isa::available().first().unwrap_or(&Isa::Portable))
    }

    /// Every level this CPU runs, best first (tests run them all against the portable one).
    pub fn available() -> Vec<Isa> {
        let mut out = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            if is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
            {
                out.push(Isa::Avx512Vnni);
            }
            if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                if is_x86_feature_detected!("avxvnni") {
                    out.push(Isa::AvxVnni);
                }
                out.push(Isa::Avx2);
            }
        }
        out.push(Isa::Portable);
        out
    }

    /// Name for the startup log.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512Vnni => "avx512-vnni",
            Isa::AvxVnni => "avx-vnni",
            Isa::Avx2 => "avx2",
            Isa::Portable => "portable",
        }
    }
}

/// One activation row quantised for NVFP4 rows (see the module docs for the layout).
#[derive(Clone, Debug, Default)]
pub struct Q8Act {
    /// Per chunk: the 32 even columns, then the 32 odd columns.
    q: Vec<i8>,
    /// Per chunk and lane: the activation scale of the lane's block.
    dx: Vec<f32>,
    /// Per chunk and lane: `−12 · Σ q` over the lane's 4 bytes.
    corr: Vec<i32>,
    /// Per pair of chunks, 8 blocks in [`PAIR_ORDER`]: the activation scale (a missing second chunk
    /// of an odd count: 0). The 256-bit dots sum a block's lanes before any float work.
    pair_d: Vec<f32>,
    /// The same blocks' `−12 · Σ q`.
    pair_corr: Vec<i32>,
}

/// The 8 blocks of a pair of chunks in the order the 256-bit dots produce their sums
/// (`vphaddd` of two chunks' lane sums): `(chunk of the pair, block)`.
const PAIR_ORDER: [(usize, usize); 8] = [(0, 0), (0, 1), (1, 0), (1, 1), (0, 2), (0, 3), (1, 2), (1, 3)];

/// The column of byte `b` of a chunk.
#[inline]
fn column(b: usize) -> usize {
    if b < 32 {
        2 * b
    } else {
        2 * (b - 32) + 1
    }
}

/// Quantises `x` (`len` a multiple of [`CHUNK`]): per 16-value block `d = max|x| / 127`, `q = round(x / d)`.
pub fn quantize(x: &[f32]) -> Q8Act {
    assert!(x.len().is_multiple_of(CHUNK), "q8 rows are whole chunks: this is a bug");
    let chunks = x.len() / CHUNK;
    let pairs = chunks.div_ceil(2);
    let mut a = Q8Act {
        q: vec![0; x.len()],
        dx: vec![0.0; chunks * LANES],
        corr: vec![0; chunks * LANES],
        pair_d: vec![0.0; pairs * 8],
        pair_corr: vec![0; pairs * 8],
    };
    for c in 0..chunks {
        let xs = &x[c * CHUNK..(c + 1) * CHUNK];
        let mut d = [0f32; 4];
        let mut inv = [0f32; 4];
        for blk in 0..4 {
            let amax = xs[blk * 16..(blk + 1) * 16].iter().fold(0f32, |m, v| m.max(v.abs()));
            d[blk] = amax / 127.0;
            inv[blk] = if amax > 0.0 { 127.0 / amax } else { 0.0 };
        }
        let q = &mut a.q[c * CHUNK..(c + 1) * CHUNK];
        for (b, qb) in q.iter_mut().enumerate() {
            let col = column(b);
            *qb = (xs[col] * inv[col / 16]).round().clamp(-127.0, 127.0) as i8;
        }
        for lane in 0..LANES {
            a.dx[c * LANES + lane] = d[(lane % 8) / 2];
            a.corr[c * LANES + lane] = -12 * q[lane * 4..lane * 4 + 4].iter().map(|&v| i32::from(v)).sum::<i32>();
        }
        for (slot, &(half, blk)) in PAIR_ORDER.iter().enumerate() {
            if half == c % 2 {
                let i = c / 2 * 8 + slot;
                a.pair_d[i] = d[blk];
                // A block's 16 values are lanes 2·blk, 2·blk + 1 of each nibble half.
                let lanes = [2 * blk, 2 * blk + 1, 8 + 2 * blk, 9 + 2 * blk];
                a.pair_corr[i] = lanes.iter().map(|&l| a.corr[c * LANES + l]).sum();
            }
        }
    }
    a
}

/// Rows ahead whose bytes the AVX-512 VNNI dot prefetches while it works on its own row (it assumes the
/// rows of a matrix, one after another, as the GEMV path passes them; elsewhere the prefetch is wasted,
/// never wrong). Decode streams NVFP4 rows from DRAM, and the hardware prefetchers stop at 4 KiB pages
/// (every four 2,048-wide rows). Measured in `timing::cold_nvfp4_gemv` and in decode; see
/// docs/benchmarks.md, "NVFP4 decode: prefetching rows ahead".
pub const PREFETCH_ROWS: usize = 2;

/// `Σ x[i]·W[i]` for one NVFP4 row against quantised activations, on `isa` (which the CPU must have).
pub fn dot(isa: Isa, a: &Q8Act, packed: &[u8], scales: &[u8], global: f32) -> f32 {
    let chunks = a.q.len() / CHUNK;
    assert!(packed.len() >= chunks * 32 && scales.len() >= chunks * 4, "nvfp4 row: this is a bug");
    let raw = match isa {
        // SAFETY: `Isa::available` lists a level only when the CPU has its features; lengths checked above.
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512Vnni => unsafe { x86::dot_vnni(a, packed, scales) },
        #[cfg(target_arch = "x86_64")]
        Isa::AvxVnni => unsafe { x86::dot_avx_vnni(a, packed, scales) },
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => unsafe { x86::dot_avx2(a, packed, scales) },
        _ => dot_portable(a, packed, scales),
    };
    raw * global * 0.5
}

fn dot_portable(a: &Q8Act, packed: &[u8], scales: &[u8]) -> f32 {
    let mut acc = [0f32; LANES];
    for c in 0..a.q.len() / CHUNK {
        for (lane, acc) in acc.iter_mut().enumerate() {
            let mut s = a.corr[c * LANES + lane];
            for b in lane * 4..lane * 4 + 4 {
                let byte = packed[c * 32 + b % 32];
                let code = if b < 32 { byte & 0x0F } else { byte >> 4 };
                s += i32::from(LUT_U8[code as usize]) * i32::from(a.q[c * CHUNK + b]);
            }
            let ws = e4m3_to_f32(scales[c * 4 + (lane % 8) / 2]);
            *acc += s as f32 * (ws * a.dx[c * LANES + lane]);
        }
    }
    acc.iter().sum()
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    use super::{Q8Act, CHUNK, LANES, LUT_U8};

    /// Lane → block byte pattern for 4 scale bytes: `[0,0,1,1,2,2,3,3]` twice.
    const SCALE_PATTERN: [i8; 16] = [0, 0, 1, 1, 2, 2, 3, 3, 0, 0, 1, 1, 2, 2, 3, 3];

    /// e4m3 codes (one per 32-bit lane) to f32: the 7 magnitude bits moved under an f32 exponent, then
    /// scaled by 2^120 (exact for normals and subnormals alike); the sign bit moved to bit 31.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(crate) fn e4m3_512(codes: __m512i) -> __m512 {
        let mag = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x7F)), 20);
        let sign = _mm512_slli_epi32(_mm512_and_si512(codes, _mm512_set1_epi32(0x80)), 24);
        let v = _mm512_mul_ps(_mm512_castsi512_ps(mag), _mm512_set1_ps(f32::from_bits(247 << 23)));
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(v), sign))
    }

    /// The 4 scale bytes of chunk `c`, one per lane in block order.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn scale_bytes(scales: &[u8], c: usize) -> __m128i {
        // SAFETY: the caller checked scales.len() >= 4 · chunks.
        let word = unsafe { std::ptr::read_unaligned(scales.as_ptr().add(c * 4) as *const i32) };
        // SAFETY: SCALE_PATTERN holds 16 bytes.
        let pat = unsafe { _mm_loadu_si128(SCALE_PATTERN.as_ptr() as *const __m128i) };
        _mm_shuffle_epi8(_mm_cvtsi32_si128(word), pat)
    }

    /// One chunk's integer lane sums as f32: `Σ u·q + corr` per lane.
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    unsafe fn chunk_vnni(a: &Q8Act, packed: &[u8], c: usize, lut: __m512i) -> __m512 {
        // SAFETY: the caller checked that chunk c lies inside `packed` and `a`.
        unsafe {
            let nib = _mm256_set1_epi8(0x0F);
            let p = _mm256_loadu_si256(packed.as_ptr().add(c * 32) as *const __m256i);
            let lo = _mm256_and_si256(p, nib);
            let hi = _mm256_and_si256(_mm256_srli_epi16(p, 4), nib);
            let w = _mm512_shuffle_epi8(lut, _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1));
            let q = _mm512_loadu_si512(a.q.as_ptr().add(c * CHUNK) as *const __m512i);
            let corr = _mm512_loadu_si512(a.corr.as_ptr().add(c * LANES) as *const __m512i);
            _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(corr, w, q))
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma")]
    pub unsafe fn dot_vnni(a: &Q8Act, packed: &[u8], scales: &[u8]) -> f32 {
        // SAFETY: LUT_U8 holds 16 bytes; every chunk access is within the lengths the caller checked.
        unsafe {
            let lut = _mm512_broadcast_i32x4(_mm_loadu_si128(LUT_U8.as_ptr() as *const __m128i));
            let chunks = a.q.len() / CHUNK;
            let (mut t0, mut t1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            // Four chunks share one load and conversion of their 16 block scales; each then picks its
            // lanes' scales with one permute. Two accumulators keep the FMA chains apart.
            let idx: [__m512i; 4] = std::array::from_fn(|j| {
                let b = 4 * j as i32;
                _mm512_setr_epi32(
                    b,
                    b,
                    b + 1,
                    b + 1,
                    b + 2,
                    b + 2,
                    b + 3,
                    b + 3,
                    b,
                    b,
                    b + 1,
                    b + 1,
                    b + 2,
                    b + 2,
                    b + 3,
                    b + 3,
                )
            });
            let groups = chunks / 4;
            // The row PREFETCH_ROWS on: its scales now, its codes two lines per group of four chunks.
            let ahead = |p: *const u8, len: usize| p.wrapping_add(super::PREFETCH_ROWS * len);
            let (pa, sa) = (ahead(packed.as_ptr(), chunks * 32), ahead(scales.as_ptr(), chunks * 4));
            for line in (0..chunks * 4).step_by(64) {
                _mm_prefetch::<_MM_HINT_T0>(sa.wrapping_add(line).cast());
            }
            for g in 0..groups {
                _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(g * 128).cast());
                _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(g * 128 + 64).cast());
                let sb = _mm_loadu_si128(scales.as_ptr().add(g * 16) as *const __m128i);
                let ws = e4m3_512(_mm512_cvtepu8_epi32(sb));
                for (j, ix) in idx.iter().enumerate() {
                    let c = g * 4 + j;
                    let s =
                        _mm512_mul_ps(_mm512_permutexvar_ps(*ix, ws), _mm512_loadu_ps(a.dx.as_ptr().add(c * LANES)));
                    let f = chunk_vnni(a, packed, c, lut);
                    if j % 2 == 0 {
                        t0 = _mm512_fmadd_ps(f, s, t0);
                    } else {
                        t1 = _mm512_fmadd_ps(f, s, t1);
                    }
                }
            }
            for c in groups * 4..chunks {
                let ws = e4m3_512(_mm512_cvtepu8_epi32(scale_bytes(scales, c)));
                let s = _mm512_mul_ps(ws, _mm512_loadu_ps(a.dx.as_ptr().add(c * LANES)));
                t0 = _mm512_fmadd_ps(chunk_vnni(a, packed, c, lut), s, t0);
            }
            _mm512_reduce_add_ps(_mm512_add_ps(t0, t1))
        }
    }

    /// A chunk's 8 lane sums `Σ u·q` (lane ℓ: block ℓ/2 mod 4) with `vpmaddubsw`: the two nibble halves
    /// add as i16 (|value| ≤ 2 · 2·24·127 = 12,192), then `vpmaddwd` pairs them into lanes.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    fn sums_avx2(w_lo: __m256i, q_lo: __m256i, w_hi: __m256i, q_hi: __m256i) -> __m256i {
        let s = _mm256_add_epi16(_mm256_maddubs_epi16(w_lo, q_lo), _mm256_maddubs_epi16(w_hi, q_hi));
        _mm256_madd_epi16(s, _mm256_set1_epi16(1))
    }

    /// The same sums with two AVX-VNNI `vpdpbusd`.
    #[inline]
    #[target_feature(enable = "avx2,fma,avxvnni")]
    fn sums_avx_vnni(w_lo: __m256i, q_lo: __m256i, w_hi: __m256i, q_hi: __m256i) -> __m256i {
        _mm256_dpbusd_avx_epi32(_mm256_dpbusd_avx_epi32(_mm256_setzero_si256(), w_lo, q_lo), w_hi, q_hi)
    }

    /// For each dword of a pair's scale codes (8 bytes, in both 128-bit halves), the byte
    /// [`super::PAIR_ORDER`] puts there, moved to the dword's top byte (`-1`: zero).
    const PAIR_SCALES: [i8; 32] = {
        let mut t = [-1i8; 32];
        let mut slot = 0;
        while slot < 8 {
            let (half, blk) = super::PAIR_ORDER[slot];
            // Dwords 0-3 sit in the low 128 bits and 4-7 in the high; `vpshufb` indexes within each.
            t[slot * 4 + 3] = (half * 4 + blk) as i8;
            slot += 1;
        }
        t
    };

    /// The 256-bit dot, once per way of summing a chunk's bytes (a macro, not a closure, so that the
    /// sums inline under each function's own target features). A pair of chunks costs one `vphaddd`
    /// (a block's lanes summed), one conversion of 8 block scales and one FMA: the float work is
    /// paid per 16-value block, not per lane.
    macro_rules! dot_256 {
        ($(#[$doc:meta])* $name:ident, $feat:literal, $sums:ident) => {
            $(#[$doc])*
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(a: &Q8Act, packed: &[u8], scales: &[u8]) -> f32 {
                // SAFETY: as in dot_vnni; a pair's 8 scale bytes are read only when both chunks exist.
                unsafe {
                    let lut128 = _mm_loadu_si128(LUT_U8.as_ptr() as *const __m128i);
                    let lut = _mm256_set_m128i(lut128, lut128);
                    let nib = _mm256_set1_epi8(0x0F);
                    let pattern = _mm256_loadu_si256(PAIR_SCALES.as_ptr() as *const __m256i);
                    // Chunk c's 8 lane sums (a function, not a closure: it inlines with the features).
                    #[inline]
                    #[target_feature(enable = $feat)]
                    unsafe fn chunk(a: &Q8Act, packed: &[u8], c: usize, lut: __m256i, nib: __m256i) -> __m256i {
                        // SAFETY: the caller's lengths cover chunk c.
                        unsafe {
                            let p = _mm256_loadu_si256(packed.as_ptr().add(c * 32) as *const __m256i);
                            let w_lo = _mm256_shuffle_epi8(lut, _mm256_and_si256(p, nib));
                            let w_hi = _mm256_shuffle_epi8(lut, _mm256_and_si256(_mm256_srli_epi16(p, 4), nib));
                            let qp = a.q.as_ptr().add(c * CHUNK);
                            let q_lo = _mm256_loadu_si256(qp as *const __m256i);
                            $sums(w_lo, q_lo, w_hi, _mm256_loadu_si256(qp.add(32) as *const __m256i))
                        }
                    }
                    // Pair p's 8 block sums, scaled, added to `acc` (FULL: both chunks exist; else
                    // only the first, and the second's lanes are zero).
                    #[inline]
                    #[target_feature(enable = $feat)]
                    unsafe fn pair<const FULL: bool>(
                        a: &Q8Act,
                        (packed, scales, pa): (&[u8], &[u8], *const u8),
                        p: usize,
                        (lut, nib, pattern): (__m256i, __m256i, __m256i),
                        acc: __m256,
                    ) -> __m256 {
                        // SAFETY: the caller's lengths cover pair p (its second chunk only when FULL).
                        unsafe {
                            let c = 2 * p;
                            _mm_prefetch::<_MM_HINT_T0>(pa.wrapping_add(c * 32).cast());
                            let (second, codes) = if FULL {
                                (chunk(a, packed, c + 1, lut, nib), std::ptr::read_unaligned(scales.as_ptr().add(c * 4) as *const i64))
                            } else {
                                let word = std::ptr::read_unaligned(scales.as_ptr().add(c * 4) as *const u32);
                                (_mm256_setzero_si256(), i64::from(word))
                            };
                            let sums = _mm256_hadd_epi32(chunk(a, packed, c, lut, nib), second);
                            let sums = _mm256_add_epi32(sums, _mm256_loadu_si256(a.pair_corr.as_ptr().add(p * 8) as *const __m256i));
                            // e4m3 codes in each dword's top byte: the sign is f32's, the 7 magnitude
                            // bits go under the exponent, then × 2^120 (exact for normals and subnormals).
                            let top = _mm256_shuffle_epi8(_mm256_set1_epi64x(codes), pattern);
                            let mag = _mm256_srli_epi32(_mm256_and_si256(top, _mm256_set1_epi32(0x7F00_0000)), 4);
                            let sign = _mm256_and_si256(top, _mm256_set1_epi32(i32::MIN));
                            let ws = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(f32::from_bits(247 << 23)));
                            let ws = _mm256_or_ps(ws, _mm256_castsi256_ps(sign));
                            let s = _mm256_mul_ps(ws, _mm256_loadu_ps(a.pair_d.as_ptr().add(p * 8)));
                            _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), s, acc)
                        }
                    }
                    let chunks = a.q.len() / CHUNK;
                    // The row PREFETCH_ROWS on (as dot_vnni): its scales now, a line of its codes per pair.
                    let ahead = |p: *const u8, len: usize| p.wrapping_add(super::PREFETCH_ROWS * len);
                    let (pa, sa) = (ahead(packed.as_ptr(), chunks * 32), ahead(scales.as_ptr(), chunks * 4));
                    for line in (0..chunks * 4).step_by(64) {
                        _mm_prefetch::<_MM_HINT_T0>(sa.wrapping_add(line).cast());
                    }
                    let (row, consts) = ((packed, scales, pa), (lut, nib, pattern));
                    // Two pairs a step into two accumulators (no branch in the loop); then the rest.
                    let (mut t0, mut t1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
                    let full = chunks / 2;
                    let mut p = 0;
                    while p + 2 <= full {
                        t0 = pair::<true>(a, row, p, consts, t0);
                        t1 = pair::<true>(a, row, p + 1, consts, t1);
                        p += 2;
                    }
                    if p < full {
                        t0 = pair::<true>(a, row, p, consts, t0);
                        p += 1;
                    }
                    if chunks % 2 == 1 {
                        t1 = pair::<false>(a, row, p, consts, t1);
                    }
                    let total = _mm256_add_ps(t0, t1);
                    let s = _mm_add_ps(_mm256_castps256_ps128(total), _mm256_extractf128_ps(total, 1));
                    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
                    _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)))
                }
            }
        };
    }

    dot_256!(
        /// AVX2: `vpmaddubsw` + `vpmaddwd`.
        dot_avx2,
        "avx2,fma",
        sums_avx2
    );
    dot_256!(
        /// AVX-VNNI: one 256-bit `vpdpbusd` (the caller checked the CPU has it).
        dot_avx_vnni,
        "avx2,fma,avxvnni",
        sums_avx_vnni
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::nvfp4::{dequant_row, e2m1_to_f32, E2M1};

    fn row(k: usize, seed: usize) -> (Vec<u8>, Vec<u8>, Vec<f32>) {
        let packed: Vec<u8> = (0..k / 2).map(|i| ((i * 37 + seed * 11) % 256) as u8).collect();
        // Scales over normals and subnormals, both signs never (ModelOpt scales are positive).
        let scales: Vec<u8> = (0..k / 16).map(|i| [0x38, 0x30, 0x41, 0x05, 0x7E, 0x01, 0x2A][(i + seed) % 7]).collect();
        let x: Vec<f32> = (0..k).map(|i| (((i * 7919 + seed * 31) % 97) as f32 / 48.5) - 1.0).collect();
        (packed, scales, x)
    }

    #[test]
    fn the_table_is_twice_e2m1_plus_twelve() {
        for c in 0u8..16 {
            assert_eq!(f32::from(LUT_U8[c as usize]) - 12.0, 2.0 * e2m1_to_f32(c), "code {c}");
        }
        assert_eq!(E2M1[7], 6.0);
    }

    #[test]
    fn every_path_computes_the_same_integers_as_the_portable_one() {
        for (k, seed) in [(64, 0), (128, 1), (2048, 2), (512, 3), (192, 6)] {
            let (packed, scales, x) = row(k, seed);
            let a = quantize(&x);
            let want = dot(Isa::Portable, &a, &packed, &scales, 0.75);
            for isa in Isa::available() {
                let got = dot(isa, &a, &packed, &scales, 0.75);
                // Same integer sums and scales; f32 accumulation order only.
                assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{isa:?} k={k}: {got} vs {want}");
            }
        }
    }

    #[test]
    fn the_int8_dot_is_within_activation_rounding_of_the_exact_one() {
        for (k, seed) in [(64, 4), (2048, 5)] {
            let (packed, scales, x) = row(k, seed);
            let mut w = vec![0f32; k];
            dequant_row(&packed, &scales, 0.75, &mut w);
            let exact: f64 = x.iter().zip(&w).map(|(a, b)| f64::from(*a) * f64::from(*b)).sum();
            // Each activation moves by at most half a step of its block (max|x| / 254): the error is
            // bounded by Σ |w| · step / 2.
            let bound: f64 = x
                .chunks(16)
                .zip(w.chunks(16))
                .map(|(xb, wb)| {
                    let step = f64::from(xb.iter().fold(0f32, |m, v| m.max(v.abs()))) / 127.0;
                    wb.iter().map(|v| f64::from(v.abs())).sum::<f64>() * step / 2.0
                })
                .sum();
            let got = f64::from(dot(Isa::detected(), &quantize(&x), &packed, &scales, 0.75));
            assert!((got - exact).abs() <= bound * 1.001 + 1e-4, "k={k}: {got} vs {exact} (bound {bound})");
        }
    }
}
