//! Dot products and row conversions, AVX2+FMA(+F16C) when the CPU has them, portable otherwise.
//!
//! bf16 → f32 is a 16-bit shift (exact); f16 → f32 uses F16C (exact). Dots keep 4 independent 8-lane
//! accumulators so the FMA latency is hidden; the portable path keeps 8 scalar accumulators.

use half::f16;

/// CPU features detected once per call site (cheap: std caches the cpuid result).
#[inline]
fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
fn has_f16c() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        has_avx2_fma() && is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

#[inline]
fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// `Σ a[i]·b[i]` with f32 weights.
pub fn dot_f32(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_f32(a, b) };
    }
    portable_dot(a, b.iter().copied())
}

/// `Σ a[i]·bf16(b[i])`.
pub fn dot_bf16(a: &[f32], b: &[u16]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_bf16(a, b) };
    }
    portable_dot(a, b.iter().map(|&v| bf16_to_f32(v)))
}

/// `Σ a[i]·f16(b[i])`.
pub fn dot_f16(a: &[f32], b: &[u16]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the features were detected above.
        return unsafe { x86::dot_f16(a, b) };
    }
    portable_dot(a, b.iter().map(|&v| f16::from_bits(v).to_f32()))
}

fn portable_dot(a: &[f32], b: impl Iterator<Item = f32>) -> f32 {
    let mut acc = [0f32; 8];
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        acc[i % 8] += x * y;
    }
    acc.iter().sum()
}

/// Widen a bf16 row to f32.
pub fn bf16_row_to_f32(src: &[u16], dst: &mut [f32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(s);
    }
}

/// Widen an f16 row to f32.
pub fn f16_row_to_f32(src: &[u16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_f16c() {
        // SAFETY: the features were detected above.
        unsafe { x86::f16_row_to_f32(src, dst) };
        return;
    }
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = f16::from_bits(s).to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        _mm_cvtss_f32(s)
    }

    /// Loads 8 bf16 values as f32.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        // SAFETY: caller guarantees 8 readable u16 at p.
        let h = unsafe { _mm_loadu_si128(p as *const __m128i) };
        _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        // SAFETY: caller guarantees 8 readable u16 at p.
        _mm256_cvtph_ps(unsafe { _mm_loadu_si128(p as *const __m128i) })
    }

    macro_rules! dot_kernel {
        ($name:ident, $t:ty, $feat:literal, $load:expr, $scalar:expr) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(a: &[f32], b: &[$t]) -> f32 {
                let n = a.len().min(b.len());
                let (pa, pb) = (a.as_ptr(), b.as_ptr());
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                // SAFETY: every load below reads within [0, n) of both slices.
                unsafe {
                    while i + 32 <= n {
                        for (j, acc) in acc.iter_mut().enumerate() {
                            let x = _mm256_loadu_ps(pa.add(i + 8 * j));
                            *acc = _mm256_fmadd_ps(x, $load(pb.add(i + 8 * j)), *acc);
                        }
                        i += 32;
                    }
                    while i + 8 <= n {
                        acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), $load(pb.add(i)), acc[0]);
                        i += 8;
                    }
                    let s = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
                    let mut total = hsum(s);
                    while i < n {
                        total += *pa.add(i) * $scalar(*pb.add(i));
                        i += 1;
                    }
                    total
                }
            }
        };
    }

    dot_kernel!(dot_f32, f32, "avx2,fma", |p: *const f32| _mm256_loadu_ps(p), |v: f32| v);
    dot_kernel!(dot_bf16, u16, "avx2,fma", |p| load_bf16(p), super::bf16_to_f32);
    dot_kernel!(dot_f16, u16, "avx2,fma,f16c", |p| load_f16(p), |v| half::f16::from_bits(v).to_f32());

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_row_to_f32(src: &[u16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let mut i = 0;
        // SAFETY: reads and writes stay within [0, n).
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_f16(src.as_ptr().add(i)));
                i += 8;
            }
        }
        for j in i..n {
            dst[j] = half::f16::from_bits(src[j]).to_f32();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dots_agree_with_scalar_reference() {
        for n in [1usize, 7, 8, 31, 32, 33, 100, 257] {
            let a: Vec<f32> = (0..n).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.25).collect();
            let bf: Vec<f32> = (0..n).map(|i| ((i * 13 % 7) as f32 - 3.0) * 0.5).collect();
            let want: f32 = a.iter().zip(&bf).map(|(x, y)| x * y).sum();
            let b16: Vec<u16> = bf.iter().map(|&v| half::bf16::from_f32(v).to_bits()).collect();
            let h16: Vec<u16> = bf.iter().map(|&v| half::f16::from_f32(v).to_bits()).collect();
            // Values are small multiples of 1/4: all products and sums are exact in f32.
            assert_eq!(dot_f32(&a, &bf), want, "n={n}");
            assert_eq!(dot_bf16(&a, &b16), want, "n={n}");
            assert_eq!(dot_f16(&a, &h16), want, "n={n}");
            let mut row = vec![0f32; n];
            f16_row_to_f32(&h16, &mut row);
            assert_eq!(row, bf);
            bf16_row_to_f32(&b16, &mut row);
            assert_eq!(row, bf);
        }
    }
}
