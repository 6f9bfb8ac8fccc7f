//! NVFP4 (NVIDIA ModelOpt layout): 4-bit e2m1 values, two per byte (even column in the low nibble), one
//! e4m3 scale per 16 consecutive values of a row, one f32 global scale per tensor:
//! `W[n, k] = e2m1(q[n, k]) · e4m3(s[n, k/16]) · global`.
//!
//! The dot product dequantises in registers: per 16-value block, 8 bytes are widened to 16 codes, the
//! 3-bit magnitude indexes an 8-entry table (`vpermps`), the sign bit is xor-ed in, and the block scale
//! multiplies the partial sum once. A portable path does the same with scalar code.

/// The 8 e2m1 magnitudes; bit 3 of a code is the sign.
pub const E2M1: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Values per scale block.
pub const BLOCK: usize = 16;

/// Every e4m3 code as f32 (kernels that read a scale per row and block: a table beats converting).
pub(crate) static E4M3: [f32; 256] = {
    let mut t = [0f32; 256];
    let mut c = 0;
    while c < 256 {
        t[c] = e4m3_to_f32(c as u8);
        c += 1;
    }
    t
};

/// Decodes one float8 e4m3fn (bias 7, no infinities; 0x7F/0xFF are NaN), by moving its bits into an f32.
#[inline]
pub const fn e4m3_to_f32(b: u8) -> f32 {
    let sign = ((b & 0x80) as u32) << 24;
    let e = ((b >> 3) & 0x0F) as u32;
    let m = (b & 0x07) as u32;
    if e == 0x0F && m == 0x07 {
        return f32::NAN;
    }
    if e == 0 {
        // Subnormal: m/8 · 2^-6 = m · 2^-9 (exact).
        let v = m as f32 * (1.0 / 512.0);
        return if sign != 0 { -v } else { v };
    }
    f32::from_bits(sign | ((e + 120) << 23) | (m << 20))
}

/// Encodes to e4m3fn with round-to-nearest-even, saturating at ±448 (what torch's `to(float8_e4m3fn)`
/// does for finite inputs; callers keep scales in range). Positive codes 0x00..=0x7E are increasing, so
/// the nearest is found by binary search.
pub fn f32_to_e4m3(x: f32) -> u8 {
    if x.is_nan() {
        return 0x7F;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs().min(448.0);
    // Largest code whose value is <= a.
    let (mut lo, mut hi) = (0u8, 0x7Eu8);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if e4m3_to_f32(mid) <= a {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let below = lo;
    let best = if below == 0x7E {
        below
    } else {
        let (d0, d1) = (a - e4m3_to_f32(below), e4m3_to_f32(below + 1) - a);
        if d1 < d0 || (d1 == d0 && (below + 1) % 2 == 0) {
            below + 1
        } else {
            below
        }
    };
    sign | best
}

/// Decodes one e2m1 code.
#[inline]
pub fn e2m1_to_f32(code: u8) -> f32 {
    let v = E2M1[(code & 7) as usize];
    if code & 8 != 0 {
        -v
    } else {
        v
    }
}

/// Dequantises one row of `k` values.
pub fn dequant_row(packed: &[u8], scales: &[u8], global: f32, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") && out.len().is_multiple_of(BLOCK) {
        // SAFETY: the features were detected above; lengths are checked inside.
        unsafe { x86::dequant_row(packed, scales, global, out) };
        return;
    }
    for (b, o) in out.chunks_mut(BLOCK).enumerate() {
        let s = e4m3_to_f32(scales[b]) * global;
        for (j, v) in o.iter_mut().enumerate() {
            let byte = packed[(b * BLOCK + j) / 2];
            let code = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            *v = e2m1_to_f32(code) * s;
        }
    }
}

/// `Σ x[i]·W[i]` for one NVFP4 row (`x.len()` a multiple of 16).
pub fn dot(x: &[f32], packed: &[u8], scales: &[u8], global: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot(x, packed, scales, global) };
    }
    let mut total = 0f32;
    for (b, xb) in x.chunks(BLOCK).enumerate() {
        let mut acc = 0f32;
        for (j, xv) in xb.iter().enumerate() {
            let byte = packed[(b * BLOCK + j) / 2];
            let code = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 };
            acc += xv * e2m1_to_f32(code);
        }
        total += acc * e4m3_to_f32(scales[b]);
    }
    total * global
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{e4m3_to_f32, BLOCK, E2M1};

    /// The 16 codes of one block (8 bytes) as two vectors of 8 f32 values.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn block16(p: *const u8, lut: __m256) -> (__m256, __m256) {
        // SAFETY: caller guarantees 8 readable bytes.
        let b = unsafe { _mm_loadl_epi64(p as *const __m128i) };
        let mask = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(b, mask);
        let hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
        // Byte j holds column 2j (low nibble) and 2j+1 (high nibble): interleave to column order.
        let codes = _mm_unpacklo_epi8(lo, hi);
        let c0 = _mm256_cvtepu8_epi32(codes);
        let c1 = _mm256_cvtepu8_epi32(_mm_srli_si128(codes, 8));
        // SAFETY: same target features as this function.
        unsafe { (values8(c0, lut), values8(c1, lut)) }
    }

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn values8(codes: __m256i, lut: __m256) -> __m256 {
        let mag = _mm256_permutevar8x32_ps(lut, codes);
        let sign = _mm256_slli_epi32(_mm256_and_si256(codes, _mm256_set1_epi32(8)), 28);
        _mm256_xor_ps(mag, _mm256_castsi256_ps(sign))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dequant_row(packed: &[u8], scales: &[u8], global: f32, out: &mut [f32]) {
        let blocks = out.len() / BLOCK;
        assert!(packed.len() >= blocks * BLOCK / 2 && scales.len() >= blocks, "nvfp4 row: this is a bug");
        // SAFETY: E2M1 holds 8 floats; every block access below is within the checked lengths.
        unsafe {
            let lut = _mm256_loadu_ps(E2M1.as_ptr());
            for b in 0..blocks {
                let s = _mm256_set1_ps(e4m3_to_f32(scales[b]) * global);
                let (w0, w1) = block16(packed.as_ptr().add(b * BLOCK / 2), lut);
                let o = out.as_mut_ptr().add(b * BLOCK);
                _mm256_storeu_ps(o, _mm256_mul_ps(w0, s));
                _mm256_storeu_ps(o.add(8), _mm256_mul_ps(w1, s));
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn dot(x: &[f32], packed: &[u8], scales: &[u8], global: f32) -> f32 {
        // SAFETY: E2M1 holds exactly 8 floats.
        let lut = unsafe { _mm256_loadu_ps(E2M1.as_ptr()) };
        let mut total = _mm256_setzero_ps();
        let blocks = x.len() / BLOCK;
        for b in 0..blocks {
            // SAFETY: block b covers x[16b..16b+16] and packed[8b..8b+8], both in bounds.
            unsafe {
                let xp = x.as_ptr().add(b * BLOCK);
                let (w0, w1) = block16(packed.as_ptr().add(b * BLOCK / 2), lut);
                let part = _mm256_fmadd_ps(_mm256_loadu_ps(xp), w0, _mm256_mul_ps(_mm256_loadu_ps(xp.add(8)), w1));
                total = _mm256_fmadd_ps(part, _mm256_set1_ps(e4m3_to_f32(scales[b])), total);
            }
        }
        let lo = _mm256_castps256_ps128(total);
        let hi = _mm256_extractf128_ps(total, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s) * global
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e4m3_round_trips_and_known_values() {
        assert_eq!(e4m3_to_f32(0x38), 1.0);
        assert_eq!(e4m3_to_f32(0x7E), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0xB8), -1.0);
        assert!(e4m3_to_f32(0x7F).is_nan());
        for code in 0u8..0x7F {
            assert_eq!(f32_to_e4m3(e4m3_to_f32(code)), code, "code {code:#x}");
        }
        // 1.0625 is halfway between 1.0 (0x38, even) and 1.125 (0x39): ties to even.
        assert_eq!(f32_to_e4m3(1.0625), 0x38);
    }

    #[test]
    fn vector_dot_equals_dequantise_then_dot() {
        let k = 64;
        let packed: Vec<u8> = (0..k / 2).map(|i| (i * 37 % 256) as u8).collect();
        let scales: Vec<u8> = vec![0x38, 0x30, 0x41, 0xB4];
        let x: Vec<f32> = (0..k).map(|i| ((i * 13 % 17) as f32 - 8.0) * 0.125).collect();
        let mut w = vec![0f32; k];
        dequant_row(&packed, &scales, 0.5, &mut w);
        let want: f32 = x.iter().zip(&w).map(|(a, b)| a * b).sum();
        let got = dot(&x, &packed, &scales, 0.5);
        // Exact products of dyadic values; only the summation order differs.
        assert!((got - want).abs() <= 1e-5 * want.abs().max(1.0), "{got} vs {want}");
        // Nibble order: byte 0x21 holds column 0 = code 1 (0.5) and column 1 = code 2 (1.0).
        let mut row = vec![0f32; 16];
        dequant_row(&[0x21, 0, 0, 0, 0, 0, 0, 0x9F], &[0x38], 1.0, &mut row);
        assert_eq!((row[0], row[1], row[14], row[15]), (0.5, 1.0, -6.0, -0.5));
    }
}
