//! Dot products and row conversions, AVX2+FMA(+F16C) when the CPU has them, portable otherwise.
//!
//! bf16 → f32 is a 16-bit shift (exact); f16 → f32 uses F16C (exact). Dots keep 4 independent 8-lane
//! accumulators so the FMA latency is hidden; the portable path keeps 8 scalar accumulators.

use half::f16;

/// CPU features detected once per call site (cheap: std caches the cpuid result).
#[inline]
pub(crate) fn has_avx2_fma() -> bool {
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
pub(crate) fn bf16_to_f32(b: u16) -> f32 {
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

/// `row[i] = exp(row[i] − max)` for every element; returns the sum (softmax numerator and denominator).
/// The AVX2 path uses a Cephes-style polynomial exp (within 2 ulp of `f32::exp` over the softmax range).
pub fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_avx2_fma() {
        // SAFETY: the features were detected above.
        return unsafe { x86::exp_sub_sum(row, max) };
    }
    let mut sum = 0.0;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    sum
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
pub(crate) mod x86 {
    use std::arch::x86_64::*;

    #[inline]
    #[target_feature(enable = "avx2,fma")]
    pub(crate) unsafe fn hsum(v: __m256) -> f32 {
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
    pub(crate) unsafe fn load_bf16(p: *const u16) -> __m256 {
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

    /// Rows ahead the bf16 dot prefetches, as the bf16 tiles' decode rows do (`bf16::PREFETCH_ROWS`): the
    /// GEMV path passes a matrix's rows one after another, and a 2,048-wide bf16 row is a 4 KiB page,
    /// where the hardware prefetchers stop. Elsewhere the prefetch is wasted, never wrong.
    const BF16_PREFETCH_ROWS: usize = 4;

    macro_rules! dot_kernel {
        ($name:ident, $t:ty, $feat:literal, $load:expr, $scalar:expr, $ahead:expr) => {
            #[target_feature(enable = $feat)]
            pub unsafe fn $name(a: &[f32], b: &[$t]) -> f32 {
                let n = a.len().min(b.len());
                let (pa, pb) = (a.as_ptr(), b.as_ptr());
                let mut acc = [_mm256_setzero_ps(); 4];
                let mut i = 0;
                // The same column `$ahead` rows on (a row is `n` values); 32 bf16 values are one line.
                let ahead_rows: usize = $ahead;
                let ahead = pb.wrapping_add(ahead_rows * n).cast::<i8>();
                // SAFETY: every load below reads within [0, n) of both slices (a prefetch may point
                // anywhere: it never faults).
                unsafe {
                    while i + 32 <= n {
                        if ahead_rows > 0 {
                            _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(i * std::mem::size_of::<$t>()));
                        }
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

    dot_kernel!(dot_f32, f32, "avx2,fma", |p: *const f32| _mm256_loadu_ps(p), |v: f32| v, 0);
    dot_kernel!(dot_bf16, u16, "avx2,fma", |p| load_bf16(p), super::bf16_to_f32, BF16_PREFETCH_ROWS);
    dot_kernel!(dot_f16, u16, "avx2,fma,f16c", |p| load_f16(p), |v| half::f16::from_bits(v).to_f32(), 0);

    /// 8-lane exp: range reduction by ln 2, degree-6 polynomial, exponent bits from the integer part.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn exp8(x: __m256) -> __m256 {
        let x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3)), _mm256_set1_ps(88.3));
        let n = _mm256_round_ps(
            _mm256_mul_ps(x, _mm256_set1_ps(std::f32::consts::LOG2_E)),
            _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693_359_4), x);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.121_944_4e-4), r);
        let mut y = _mm256_set1_ps(1.987_569_1e-4);
        for c in [1.398_199_9e-3, 8.333_452e-3, 4.166_579_6e-2, 0.166_666_65, 0.5] {
            y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(c));
        }
        let y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0)));
        let e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
        _mm256_mul_ps(y, _mm256_castsi256_ps(e))
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn exp_sub_sum(row: &mut [f32], max: f32) -> f32 {
        let n = row.len();
        let m = _mm256_set1_ps(max);
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        let p = row.as_mut_ptr();
        // SAFETY: every access is within [0, n).
        unsafe {
            while i + 8 <= n {
                let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p.add(i)), m));
                _mm256_storeu_ps(p.add(i), e);
                acc = _mm256_add_ps(acc, e);
                i += 8;
            }
            let mut sum = hsum(acc);
            while i < n {
                let e = (*p.add(i) - max).exp();
                *p.add(i) = e;
                sum += e;
                i += 1;
            }
            sum
        }
    }

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
    fn vector_exp_is_within_two_ulp_of_libm() {
        let xs: Vec<f32> = (0..4000).map(|i| -80.0 + i as f32 * 0.0201).collect();
        let mut got = xs.clone();
        let sum = exp_sub_sum(&mut got, 0.0);
        let mut want_sum = 0f64;
        for (g, x) in got.iter().zip(&xs) {
            let w = x.exp();
            want_sum += w as f64;
            let ulp = (w.to_bits() as i64 - g.to_bits() as i64).abs();
            assert!(ulp <= 2, "exp({x}) = {g}, libm {w} ({ulp} ulp)");
        }
        assert!(((sum as f64 - want_sum) / want_sum).abs() < 1e-5);
    }

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
