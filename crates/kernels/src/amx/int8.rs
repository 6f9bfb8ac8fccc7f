//! NVFP4 × int8 on AMX-INT8 tiles: the numbers of [`crate::q8_gemm`] (activations quantised per
//! 16-value block, weight codes as `u = 2·e2m1 + 12`, the `+12` removed by the correction), with one
//! `tdpbusd` per block computing 16 weight rows × 16 activation rows × 16 columns.
//!
//! Why 16 columns and not the tile's 64: each 16-column block has its own weight and activation scale,
//! so its integer sums must be scaled before they are added to another block's. A block's tile is
//! stored (1 KiB) and each weight row's 16 sums are converted, multiplied by the activation scales, and
//! added with the weight row's block scale: 4 AVX-512 instructions per 16×16×16 products.
//!
//! Layout: A (unsigned, `tdpbusd`'s first source) is 16 weight rows × 16 codes per block, decoded per
//! task; B (signed) is the activations in the 4-byte-interleaved layout (tile row `kk`, column `j` = row
//! `j`'s columns `4kk..4kk+4` of the block), built once per call; C is 16 weight rows × 16 activation
//! rows of i32.

use super::{configure, TileConfig};
use crate::nvfp4::{e4m3_to_f32, BLOCK};
use crate::pool::{self, OutPtr};
use crate::q8::LUT_U8 as LUT;
use crate::q8_gemm::Q8Rows;

/// Rows per tile (weight rows and activation rows).
const T: usize = 16;

/// tmm0: sums (16 × 16 i32); tmm1: weights (16 rows × 16 codes); tmm2: activations (4 × 16 rows × 4).
static CONFIG: TileConfig = TileConfig::new(&[(16, 64), (16, 16), (4, 64)]);

/// The activations as B tiles, with per block and row the scale and the correction times the scale.
struct Acts {
    /// Per 16-row group and block: 4 × 64 bytes.
    b: Vec<i8>,
    /// Per group and block: the 16 rows' scales.
    d: Vec<f32>,
    /// Per group and block: the 16 rows' `corr · d`.
    cd: Vec<f32>,
}

fn acts(a: &Q8Rows) -> Acts {
    let (m, k, kb) = (a.rows(), a.k, a.k / BLOCK);
    let groups = m.div_ceil(T);
    let mut o = Acts { b: vec![0; groups * kb * 256], d: vec![0.0; groups * kb * T], cd: vec![0.0; groups * kb * T] };
    for i in 0..m {
        let (g, j) = (i / T, i % T);
        for blk in 0..kb {
            let base = (g * kb + blk) * 256;
            for kk in 0..4 {
                let src = &a.q[i * k + blk * BLOCK + kk * 4..][..4];
                o.b[base + kk * 64 + j * 4..][..4].copy_from_slice(src);
            }
            let d = a.d[i * kb + blk];
            o.d[(g * kb + blk) * T + j] = d;
            o.cd[(g * kb + blk) * T + j] = a.corr[i * kb + blk] as f32 * d;
        }
    }
    o
}

/// Weight rows `r0..r1` (at most 16) as A tiles (per block 16 rows × 16 codes) and their block scales
/// (zero for missing rows, so their sums never count).
fn decode(packed: &[u8], scales: &[u8], (r0, r1): (usize, usize), k: usize, au: &mut [u8], ws: &mut [f32]) {
    let kb = k / BLOCK;
    au.fill(12);
    ws.fill(0.0);
    for (j, r) in (r0..r1).enumerate() {
        for blk in 0..kb {
            for c in 0..BLOCK {
                let byte = packed[r * k / 2 + (blk * BLOCK + c) / 2];
                let code = if c % 2 == 0 { byte & 0x0F } else { byte >> 4 };
                au[(blk * T + j) * BLOCK + c] = LUT[code as usize];
            }
            ws[blk * T + j] = e4m3_to_f32(scales[r * kb + blk]);
        }
    }
}

/// `out[i, r] = Σ_c x[i, c] · W[r, c]` for quantised rows `a` and NVFP4 weights (as
/// [`crate::q8_gemm::gemm`]). Panics (a bug) unless [`super::available`] and the slices hold their rows.
pub fn gemm(a: &Q8Rows, (packed, scales, global): (&[u8], &[u8], f32), n: usize, out: &mut [f32]) {
    let (m, k) = (a.rows(), a.k);
    assert!(super::available(), "AMX tiles without permission: a bug");
    assert!(k.is_multiple_of(BLOCK) && k > 0, "AMX int8 width: a bug");
    assert!(packed.len() >= n * k / 2 && scales.len() >= n * k / BLOCK && out.len() >= m * n, "AMX int8: a bug");
    if m == 0 || n == 0 {
        return;
    }
    let kb = k / BLOCK;
    let x = acts(a);
    let ptr = OutPtr(out.as_mut_ptr());
    pool::for_each_init(
        n.div_ceil(T),
        || (vec![0u8; kb * 256], vec![0f32; kb * T], vec![0i32; T * T]),
        |(au, ws, c), t| {
            let (r0, r1) = (t * T, ((t + 1) * T).min(n));
            decode(packed, scales, (r0, r1), k, au, ws);
            let p = ptr;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AMX is granted (asserted); `multiply` runs where the CPU has AVX-512 (every CPU with
            // AMX has it; the emulated tiles may run where it has not); tile loads read inside au and x.b,
            // the store writes c, and this task alone writes out[:, r0..r1].
            unsafe {
                let args = (&x, &au[..], &ws[..], &mut c[..]);
                if std::arch::is_x86_feature_detected!("avx512f") {
                    multiply(args, (m, kb), (r0, r1), n, global * 0.5, p)
                } else {
                    multiply_portable(args, (m, kb), (r0, r1), n, global * 0.5, p)
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (p, c);
        },
    );
}

/// The operands of a task: the activations, its weight tiles and block scales, and the i32 sums' buffer.
#[cfg(target_arch = "x86_64")]
type Operands<'a> = (&'a Acts, &'a [u8], &'a [f32], &'a mut [i32]);

/// One block's integer sums into `c`: 16 weight rows × 16 activation rows of group `g`.
///
/// # Safety
/// AMX is granted, and the tiles are configured with [`CONFIG`].
#[cfg(target_arch = "x86_64")]
unsafe fn block_sums(x: &Acts, au: &[u8], c: &mut [i32], (g, kb, blk): (usize, usize, usize)) {
    // SAFETY: see `gemm`.
    unsafe {
        super::tile!(zero 0);
        super::tile!(load 1, au.as_ptr().add(blk * 256), 16usize);
        super::tile!(load 2, x.b.as_ptr().add((g * kb + blk) * 256), 64usize);
        super::tile!(busd 0, 1, 2);
        super::tile!(store 0, c.as_mut_ptr(), 64usize);
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn multiply(
    (x, au, ws, c): Operands<'_>,
    (m, kb): (usize, usize),
    (r0, r1): (usize, usize),
    n: usize,
    scale: f32,
    out: OutPtr,
) {
    use std::arch::x86_64::*;
    // SAFETY: see `gemm`.
    unsafe {
        configure(&CONFIG);
        for g in 0..m.div_ceil(T) {
            let mut acc = [_mm512_setzero_ps(); T];
            for blk in 0..kb {
                block_sums(x, au, c, (g, kb, blk));
                let d = _mm512_loadu_ps(x.d.as_ptr().add((g * kb + blk) * T));
                let cd = _mm512_loadu_ps(x.cd.as_ptr().add((g * kb + blk) * T));
                for (r, v) in acc.iter_mut().enumerate() {
                    let sums = _mm512_cvtepi32_ps(_mm512_loadu_si512(c.as_ptr().add(r * T).cast()));
                    *v = _mm512_fmadd_ps(_mm512_set1_ps(ws[blk * T + r]), _mm512_fmadd_ps(sums, d, cd), *v);
                }
            }
            let mut row = [0f32; T];
            for (r, v) in acc.iter().enumerate().take(r1 - r0) {
                _mm512_storeu_ps(row.as_mut_ptr(), _mm512_mul_ps(*v, _mm512_set1_ps(scale)));
                for (j, val) in row.iter().enumerate().take(m - g * T) {
                    *out.0.add((g * T + j) * n + r0 + r) = *val;
                }
            }
        }
    }
}

/// [`multiply`] without AVX-512, for the emulated tiles on a CPU without it (a CPU with AMX has
/// AVX-512): the same operations lane by lane — `mul_add` is the fused multiply-add `_mm512_fmadd_ps`
/// computes, `as f32` the conversion's rounding — so the same bits. An AVX2-only machine ran
/// `multiply` here and died of SIGILL in `tests/amx_emulated.rs`.
#[cfg(target_arch = "x86_64")]
unsafe fn multiply_portable(
    (x, au, ws, c): Operands<'_>,
    (m, kb): (usize, usize),
    (r0, r1): (usize, usize),
    n: usize,
    scale: f32,
    out: OutPtr,
) {
    // SAFETY: see `gemm`.
    unsafe {
        configure(&CONFIG);
        for g in 0..m.div_ceil(T) {
            let mut acc = [[0f32; T]; T];
            for blk in 0..kb {
                block_sums(x, au, c, (g, kb, blk));
                let (d, cd) = (&x.d[(g * kb + blk) * T..][..T], &x.cd[(g * kb + blk) * T..][..T]);
                for (r, v) in acc.iter_mut().enumerate() {
                    let w = ws[blk * T + r];
                    for (j, a) in v.iter_mut().enumerate() {
                        *a = w.mul_add((c[r * T + j] as f32).mul_add(d[j], cd[j]), *a);
                    }
                }
            }
            for (r, v) in acc.iter().enumerate().take(r1 - r0) {
                for (j, val) in v.iter().enumerate().take(m - g * T) {
                    *out.0.add((g * T + j) * n + r0 + r) = val * scale;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::q8_gemm::{quantize_rows, reference_bound, reference_with_magnitude};

    /// Odd shapes (rows not multiples of 16, one block, many) against the same integers summed in f64,
    /// within f32's rounding of the block terms (`reference_with_magnitude`: relative to the result
    /// itself the bound fails where blocks cancel, as the emulated tiles showed at 40 × 16 × 2048, and the
    /// AVX-512 int8 GEMM there as well).
    #[test]
    fn odd_shapes_compute_the_same_integers_as_the_reference() {
        if !super::super::available() {
            eprintln!("AMX-INT8 tile tests skipped: {}", super::super::status().describe());
            return;
        }
        for (m, n, k) in [(1, 1, 16), (5, 17, 48), (17, 33, 96), (33, 70, 128), (40, 16, 2048)] {
            let packed: Vec<u8> = (0..n * k / 2).map(|i| ((i * 131 + m) % 256) as u8).collect();
            let scales: Vec<u8> = (0..n * k / 16).map(|i| [0x38, 0x30, 0x41, 0x05, 0x7E, 0x01][i % 6]).collect();
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 48.5) - 1.0).collect();
            let a = quantize_rows(&x, m, k);
            let want = reference_with_magnitude(&a, (&packed, &scales, 0.75), n);
            let mut got = vec![f32::NAN; m * n];
            gemm(&a, (&packed, &scales, 0.75), n, &mut got);
            for (idx, (g, (w, mag))) in got.iter().zip(&want).enumerate() {
                let tol = reference_bound(k, *mag);
                assert!((f64::from(*g) - w).abs() <= tol, "m={m} n={n} k={k} [{idx}]: {g} vs {w} (bound {tol})");
            }
        }
    }
}
