//! `out[i, r] = scale · Σ_c x[i, c] · W[r, c]` on AMX-BF16 tiles, for bf16 weights and NVFP4 weights
//! (decoded exactly into bf16 without the global scale, which then scales the sums): the same numbers
//! as [`crate::bf16`]'s tiles, activations rounded to bf16 once, products exact in f32.
//!
//! Layout: activations rounded into a zero-padded `[m↑16, k↑32]` bf16 matrix, read by tiles of 16 rows
//! × 32 values. A task takes 32 weight rows and packs them as two B tiles per 32-column step, in the
//! pair-interleaved layout `tdpbf16ps` reads (tile row `kk`, column `col` = the pair `W[col, 2kk..2kk+2]`).
//! Four accumulator tiles hold 32 activation rows × 32 weight rows over all of `k`, so a step loads 2 A
//! and 2 B tiles for 4 tile products.

use super::{configure, TileConfig};
use osprey_backend::types::WeightView;

use crate::pool::{self, OutPtr};

/// Activation rows and weight rows per tile.
const T: usize = 16;
/// Values per tile step (64 bytes of bf16).
const STEP: usize = 32;

/// tmm0–3: accumulators (16 × 16 f32); tmm4–5: activations (16 × 32 bf16); tmm6–7: weights (16 pairs
/// × 16 columns).
static CONFIG: TileConfig = TileConfig::new(&[(16, 64); 8]);

/// The weights of one task as B tiles: per tile (2), per step, 16 × 16 pairs.
fn pack(
    w: WeightView<'_>,
    (r0, r1): (usize, usize),
    k: usize,
    steps: usize,
    scratch: &mut (Vec<f32>, Vec<u16>),
    bp: &mut Vec<u32>,
) -> f32 {
    bp.clear();
    bp.resize(2 * steps * T * T, 0);
    let mut scale = 1.0;
    for (j, r) in (r0..r1).enumerate() {
        let row: &[u16] = match w {
            WeightView::Bf16(wb) => &wb[r * k..(r + 1) * k],
            WeightView::Nvfp4 { packed, scales, global } => {
                let (wide, narrow) = scratch;
                narrow.resize(k, 0);
                let (pk, sk) = (k / 2, k / crate::nvfp4::BLOCK);
                crate::bf16::nvfp4_row(&packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk], wide, narrow);
                scale = global;
                narrow
            }
            _ => unreachable!("AMX-BF16 takes bf16 and NVFP4 weights"),
        };
        let (tile, col) = (j / T, j % T);
        for (p, pair) in row.chunks(2).enumerate() {
            let v = u32::from(pair[0]) | (u32::from(*pair.get(1).unwrap_or(&0)) << 16);
            let (s, kk) = (p / T, p % T);
            bp[((tile * steps + s) * T + kk) * T + col] = v;
        }
    }
    scale
}

/// The GEMM (see the module docs). Panics (a bug) unless [`super::available`] and the shapes agree.
pub fn gemm(x: &[f32], m: usize, w: WeightView<'_>, n: usize, k: usize, out: &mut [f32]) {
    assert!(super::available(), "AMX tiles without permission: a bug");
    assert!(x.len() == m * k && w.len() == n * k && out.len() == m * n, "AMX bf16 shapes: a bug");
    if m == 0 || n == 0 {
        return;
    }
    let (mp, kp) = (m.next_multiple_of(T), k.next_multiple_of(STEP));
    let steps = kp / STEP;
    let mut xa = vec![0u16; mp * kp];
    pool::chunks_mut(&mut xa[..m * kp], kp, |i, row| crate::bf16::round_row(&x[i * k..(i + 1) * k], &mut row[..k]));
    let ptr = OutPtr(out.as_mut_ptr());
    pool::for_each_init(
        n.div_ceil(2 * T),
        || ((Vec::new(), Vec::new()), Vec::new(), vec![0f32; 4 * T * T]),
        |(scratch, bp, c), t| {
            let (r0, r1) = (t * 2 * T, ((t + 1) * 2 * T).min(n));
            let scale = pack(w, (r0, r1), k, steps, scratch, bp);
            let p = ptr;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AMX is granted (asserted); every tile load reads inside xa (mp × kp) and bp (2 tiles
            // × steps), stores go to c (4 tiles), and this task alone writes out[:, r0..r1].
            unsafe {
                configure(&CONFIG);
                let (a_stride, b_stride, c_stride) = (kp * 2, 64usize, 64usize);
                for i0 in (0..mp).step_by(2 * T) {
                    let two = i0 + T < mp;
                    super::tile!(zero 0);
                    super::tile!(zero 1);
                    super::tile!(zero 2);
                    super::tile!(zero 3);
                    for s in 0..steps {
                        let a = xa.as_ptr().add(i0 * kp + s * STEP);
                        let b = bp.as_ptr().add(s * T * T);
                        super::tile!(load 4, a, a_stride);
                        super::tile!(load 6, b, b_stride);
                        super::tile!(load 7, b.add(steps * T * T), b_stride);
                        super::tile!(bf16 0, 4, 6);
                        super::tile!(bf16 1, 4, 7);
                        if two {
                            super::tile!(load 5, a.add(T * kp), a_stride);
                            super::tile!(bf16 2, 5, 6);
                            super::tile!(bf16 3, 5, 7);
                        }
                    }
                    super::tile!(store 0, c.as_mut_ptr(), c_stride);
                    super::tile!(store 1, c.as_mut_ptr().add(T * T), c_stride);
                    super::tile!(store 2, c.as_mut_ptr().add(2 * T * T), c_stride);
                    super::tile!(store 3, c.as_mut_ptr().add(3 * T * T), c_stride);
                    for (q, tile) in c.chunks(T * T).enumerate() {
                        let (ia, rb) = (i0 + (q / 2) * T, r0 + (q % 2) * T);
                        for i in ia..(ia + T).min(m) {
                            for r in rb..(rb + T).min(r1) {
                                *p.0.add(i * n + r) = scale * tile[(i - ia) * T + (r - rb)];
                            }
                        }
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (scale, p, c);
        },
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(b: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(b) << 16))
    }

    /// Odd shapes (rows not multiples of 16 or 32, k not a multiple of 32, odd k) against an f64 sum of
    /// the same bf16 values, for bf16 and NVFP4 weights.
    #[test]
    fn odd_shapes_equal_an_f64_sum_of_the_bf16_values() {
        if !super::super::available() {
            eprintln!("AMX-BF16 tile tests skipped: {}", super::super::status().describe());
            return;
        }
        for (m, n, k) in [(1, 1, 2), (5, 17, 48), (17, 33, 100), (33, 70, 128), (40, 64, 2048), (16, 16, 31)] {
            let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
            let wb: Vec<u16> =
                (0..n * k).map(|i| crate::bf16::round(((i * 104729 % 89) as f32 / 89.0) - 0.5)).collect();
            let mut got = vec![f32::NAN; m * n];
            gemm(&x, m, WeightView::Bf16(&wb), n, k, &mut got);
            for i in 0..m {
                for r in 0..n {
                    let want: f64 = (0..k).map(|c| f(crate::bf16::round(x[i * k + c])) * f(wb[r * k + c])).sum();
                    let g = f64::from(got[i * n + r]);
                    // k exact products of magnitude <= 0.25 summed in f32.
                    assert!(
                        (g - want).abs() < 1e-5 * (k as f64).sqrt().max(1.0),
                        "m={m} n={n} k={k} ({i},{r}): {g} vs {want}"
                    );
                }
            }
        }
        let (m, n, k) = (19, 21, 64);
        let packed: Vec<u8> = (0..n * k / 2).map(|i| (i * 131 % 256) as u8).collect();
        let scales: Vec<u8> = (0..n * k / 16).map(|i| 0x30 + (i % 16) as u8).collect();
        let x: Vec<f32> = (0..m * k).map(|i| ((i * 7919 % 97) as f32 / 97.0) - 0.5).collect();
        let view = WeightView::Nvfp4 { packed: &packed, scales: &scales, global: 0.25 };
        let mut got = vec![0f32; m * n];
        gemm(&x, m, view, n, k, &mut got);
        for r in 0..n {
            let mut w = vec![0f32; k];
            crate::nvfp4::dequant_row(
                &packed[r * k / 2..(r + 1) * k / 2],
                &scales[r * k / 16..(r + 1) * k / 16],
                0.25,
                &mut w,
            );
            for i in 0..m {
                let want: f64 = (0..k).map(|c| f(crate::bf16::round(x[i * k + c])) * f64::from(w[c])).sum();
                assert!((f64::from(got[i * n + r]) - want).abs() < 1e-4, "nvfp4 ({i},{r})");
            }
        }
    }
}
