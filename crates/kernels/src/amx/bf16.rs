//! `out[i, r] = scale · Σ_c x[i, c] · W[r, c]` on AMX-BF16 tiles, for bf16 weights and NVFP4 weights
//! (decoded exactly into bf16 without the global scale, which then scales the sums): the same numbers
//! as [`crate::bf16`]'s tiles, activations rounded to bf16 once, products exact in f32.
//!
//! Layout (issue 54: the first version packed every weight row into the pair-interleaved B layout on
//! every call with scalar stores, which cost more than the tile products at a routed expert's 16–64
//! rows): the **weights are the A operand**, which `tdpbf16ps` reads row-major, 16 rows × 32 values —
//! the layout a bf16 weight matrix already has, so its tiles load straight from the model's memory
//! with the row stride. NVFP4 rows are decoded per task into a scratch of the same layout (AVX-512:
//! two blocks' 32 values are one `vpermw` from their rows of a table of every e4m3 × e2m1 product,
//! [`PRODUCTS`]). The **activations
//! are the B operand**, pair-interleaved (tile row `kk`, column `j` = activation row `j`'s values
//! `2kk, 2kk+1`), rounded and packed once per call for every task. A task takes 32 weight rows; per 32
//! activation rows, 4 accumulator tiles hold 32 × 32 sums over all of `k`, so each step loads 2 A and
//! 2 B tiles for 4 tile products, and the sums are scaled once at the end (no per-block work: an
//! NVFP4 block's scale is inside its bf16 values).
//!
//! Batch-invariant: an output's sum runs over the same tile steps whatever the rows around it.

use super::{configure, TileConfig};
use osprey_backend::types::WeightView;

use crate::nvfp4::BLOCK;
use crate::pool::{self, OutPtr};

/// Activation rows and weight rows per tile.
const T: usize = 16;
/// Values per tile step (64 bytes of bf16).
const STEP: usize = 32;
/// u32 pairs in one B tile.
const B_TILE: usize = T * T;

/// tmm0–3: accumulators (16 weight rows × 16 activation rows of f32); tmm4–5: weights (16 rows × 32
/// bf16); tmm6–7: activations (16 pairs × 16 rows).
static CONFIG: TileConfig = TileConfig::new(&[(16, 64); 8]);

/// The activations as B tiles: per 16-row group, per step, 16 pair rows × 16 activation rows (zero
/// past `m` and past `k`).
fn pack_acts(x: &[f32], m: usize, k: usize, steps: usize) -> Vec<u32> {
    let per_group = steps * B_TILE;
    let mut b = vec![0u32; m.div_ceil(T) * per_group];
    pool::chunks_mut_init(
        &mut b,
        per_group,
        || vec![0u16; steps * STEP],
        |row, g, tiles| {
            for j in 0..T.min(m - g * T) {
                let i = g * T + j;
                // Values past k stay zero (the buffer is made zero and only its first k are written).
                crate::bf16::round_row(&x[i * k..(i + 1) * k], &mut row[..k]);
                for (p, pair) in row.chunks_exact(2).enumerate() {
                    tiles[p * T + j] = u32::from(pair[0]) | (u32::from(pair[1]) << 16);
                }
            }
        },
    );
    b
}

/// Where a task's weight tiles are: tile `t` (0 or 1) at step `s` starts at
/// `base + t · tile + s · step` elements, its rows `stride` bytes apart.
#[derive(Clone, Copy)]
struct ATiles {
    base: *const u16,
    stride: usize,
    tile: usize,
    step: usize,
}

/// The A tiles of weight rows `r0..r1` (at most 32): read in place for full bf16 tasks with whole
/// steps, else decoded or copied into `scratch` (per tile and step, 16 rows × 32 values; zero past the
/// rows and past `k`). Returns the tiles and the scale of the sums.
fn weight_tiles(
    w: WeightView<'_>,
    (r0, r1): (usize, usize),
    k: usize,
    steps: usize,
    scratch: &mut Vec<u16>,
) -> (ATiles, f32) {
    if let WeightView::Bf16(wb) = w {
        if r1 - r0 == 2 * T && k.is_multiple_of(STEP) {
            return (ATiles { base: wb[r0 * k..].as_ptr(), stride: 2 * k, tile: T * k, step: STEP }, 1.0);
        }
    }
    let tile = steps * T * STEP;
    scratch.resize(2 * tile, 0);
    // Decoded NVFP4 rows fill their steps whole; rows past r1 and copied bf16 tails must read zero.
    if r1 - r0 < 2 * T || matches!(w, WeightView::Bf16(_)) {
        scratch.fill(0);
    }
    let mut scale = 1.0;
    for (j, r) in (r0..r1).enumerate() {
        let at = (j / T) * tile + (j % T) * STEP;
        match w {
            WeightView::Bf16(wb) => {
                for (s, chunk) in wb[r * k..(r + 1) * k].chunks(STEP).enumerate() {
                    scratch[at + s * T * STEP..][..chunk.len()].copy_from_slice(chunk);
                }
            }
            WeightView::Nvfp4 { packed, scales, global } => {
                let (pk, sk) = (k / 2, k / BLOCK);
                decode_nvfp4_row(&packed[r * pk..(r + 1) * pk], &scales[r * sk..(r + 1) * sk], &mut scratch[at..]);
                scale = global;
            }
            _ => unreachable!("AMX-BF16 takes bf16 and NVFP4 weights"),
        }
    }
    (ATiles { base: scratch.as_ptr(), stride: 2 * STEP, tile, step: T * STEP }, scale)
}

/// One NVFP4 row as bf16 (exact: e2m1 × e4m3 has at most 6 significant bits) into the scratch layout:
/// step `s`'s 32 values at `dst[s · 16 · 32..]`.
fn decode_nvfp4_row(packed: &[u8], scales: &[u8], dst: &mut [u16]) {
    #[cfg(target_arch = "x86_64")]
    if crate::bf16::available() {
        // SAFETY: the CPU has AVX-512 F/BW/BF16 (checked); the kernel reads packed and scales and writes
        // dst within the lengths it is given, asserted there.
        unsafe { x86::decode_nvfp4_row(packed, scales, dst) };
        return;
    }
    let k = scales.len() * BLOCK;
    let (mut wide, mut row) = (Vec::new(), vec![0u16; k]);
    crate::bf16::nvfp4_row(packed, scales, &mut wide, &mut row);
    for (s, chunk) in row.chunks(STEP).enumerate() {
        dst[s * T * STEP..][..chunk.len()].copy_from_slice(chunk);
    }
}

/// The GEMM (see the module docs). Panics (a bug) unless [`super::available`] and the shapes agree.
pub fn gemm(x: &[f32], m: usize, w: WeightView<'_>, n: usize, k: usize, out: &mut [f32]) {
    assert!(super::available(), "AMX tiles without permission: a bug");
    assert!(x.len() == m * k && w.len() == n * k && out.len() == m * n, "AMX bf16 shapes: a bug");
    if m == 0 || n == 0 {
        return;
    }
    let steps = k.div_ceil(STEP);
    let groups = m.div_ceil(T);
    let acts = pack_acts(x, m, k, steps);
    let ptr = OutPtr(out.as_mut_ptr());
    pool::for_each_init(
        n.div_ceil(2 * T),
        || (Vec::new(), vec![0f32; 4 * T * T]),
        |(scratch, c), t| {
            let (r0, r1) = (t * 2 * T, ((t + 1) * 2 * T).min(n));
            let (a, scale) = weight_tiles(w, (r0, r1), k, steps, scratch);
            let p = ptr;
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AMX is granted (asserted). A loads read 16 rows of 64 bytes `a.stride` apart from
            // inside the weights (full tasks of whole steps) or the scratch (2 tiles × steps); B loads
            // read inside `acts` (groups × steps tiles); stores go to c (4 tiles); this task alone
            // writes out[:, r0..r1].
            unsafe {
                configure(&CONFIG);
                let two_a = r1 - r0 > T;
                for g0 in (0..groups).step_by(2) {
                    let two_b = g0 + 1 < groups;
                    super::tile!(zero 0);
                    super::tile!(zero 1);
                    super::tile!(zero 2);
                    super::tile!(zero 3);
                    for s in 0..steps {
                        let a0 = a.base.add(s * a.step);
                        let b0 = acts.as_ptr().add((g0 * steps + s) * B_TILE);
                        super::tile!(load 4, a0, a.stride);
                        super::tile!(load 6, b0, 64usize);
                        super::tile!(bf16 0, 4, 6);
                        if two_b {
                            super::tile!(load 7, b0.add(steps * B_TILE), 64usize);
                            super::tile!(bf16 1, 4, 7);
                        }
                        if two_a {
                            super::tile!(load 5, a0.add(a.tile), a.stride);
                            super::tile!(bf16 2, 5, 6);
                            if two_b {
                                super::tile!(bf16 3, 5, 7);
                            }
                        }
                    }
                    super::tile!(store 0, c.as_mut_ptr(), 64usize);
                    super::tile!(store 1, c.as_mut_ptr().add(T * T), 64usize);
                    super::tile!(store 2, c.as_mut_ptr().add(2 * T * T), 64usize);
                    super::tile!(store 3, c.as_mut_ptr().add(3 * T * T), 64usize);
                    // Tile q: weight tile q / 2, activation group g0 + q % 2; C[r][j] is out[j, r].
                    for (q, tile) in c.chunks(T * T).enumerate() {
                        let (ia, rb) = ((g0 + q % 2) * T, r0 + (q / 2) * T);
                        for i in ia..(ia + T).min(m) {
                            for r in rb..(rb + T).min(r1) {
                                *p.0.add(i * n + r) = scale * tile[(r - rb) * T + (i - ia)];
                            }
                        }
                    }
                }
            }
            #[cfg(not(target_arch = "x86_64"))]
            let _ = (a, scale, p, c, groups, &acts);
        },
    );
}

/// Every (e4m3 scale, e2m1 code) product as bf16: exact (at most 6 significant bits), so the top half
/// of the f32. 8 KiB, read per block by the decode instead of multiplying and rounding a table per
/// block.
static PRODUCTS: [[u16; 16]; 256] = {
    let mut t = [[0u16; 16]; 256];
    let mut s = 0;
    while s < 256 {
        let mut c = 0;
        while c < 16 {
            let v = crate::nvfp4::E2M1[c % 8] * crate::nvfp4::e4m3_to_f32(s as u8);
            t[s][c] = ((if c < 8 { v } else { -v }).to_bits() >> 16) as u16;
            c += 1;
        }
        s += 1;
    }
    t
};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{BLOCK, PRODUCTS, STEP, T};
    use std::arch::x86_64::*;

    /// [`super::decode_nvfp4_row`] on AVX-512: per step, 2 blocks' 16 bytes widened so each 32-bit lane
    /// holds a byte's two codes as 16-bit indices (the second block's offset by 16), and one `vpermw`
    /// from both blocks' rows of [`PRODUCTS`] gives the step's 32 values.
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn decode_nvfp4_row(packed: &[u8], scales: &[u8], dst: &mut [u16]) {
        let kb = scales.len();
        let steps = kb.div_ceil(2);
        assert!(packed.len() * 2 >= kb * BLOCK && dst.len() >= (steps.max(1) - 1) * T * STEP + STEP, "decode: a bug");
        // SAFETY: loads read 16 bytes of packed (of a copy for a lone last block) and 32 bytes of a
        // PRODUCTS row; stores write 64 bytes at dst[s · 512..] (asserted above).
        unsafe {
            let low = _mm512_set1_epi32(0x000F_000F);
            let second = _mm512_mask_blend_epi32(0xFF00, _mm512_setzero_si512(), _mm512_set1_epi32(0x0010_0010));
            let step = |bytes: *const u8, s0: u8, s1: u8, out: *mut u16| {
                let table = _mm512_inserti64x4::<1>(
                    _mm512_castsi256_si512(_mm256_loadu_si256(PRODUCTS[s0 as usize].as_ptr().cast())),
                    _mm256_loadu_si256(PRODUCTS[s1 as usize].as_ptr().cast()),
                );
                let w = _mm512_cvtepu8_epi32(_mm_loadu_si128(bytes.cast()));
                // Lane i: (byte i & 15) | (byte i >> 4) << 16 — values 2i and 2i + 1 — then the block.
                let idx =
                    _mm512_or_si512(_mm512_ternarylogic_epi32::<0xA8>(w, _mm512_slli_epi32::<12>(w), low), second);
                _mm512_storeu_si512(out.cast(), _mm512_permutexvar_epi16(idx, table));
            };
            for s in 0..kb / 2 {
                step(packed.as_ptr().add(s * 16), scales[2 * s], scales[2 * s + 1], dst.as_mut_ptr().add(s * T * STEP));
            }
            if kb % 2 == 1 {
                // A lone last block: its 8 bytes, then zero codes with scale code 0 (values +0).
                let s = kb / 2;
                let mut tail = [0u8; 16];
                tail[..8].copy_from_slice(&packed[s * 16..s * 16 + 8]);
                step(tail.as_ptr(), scales[2 * s], 0, dst.as_mut_ptr().add(s * T * STEP));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(b: u16) -> f64 {
        f64::from(f32::from_bits(u32::from(b) << 16))
    }

    /// The vector decode writes the bits of the scalar one (`bf16::nvfp4_row`), one lone last block
    /// included, and every e4m3 scale code (subnormal, NaN) appears.
    #[test]
    fn the_nvfp4_decode_equals_the_scalar_one() {
        for k in [16, 32, 48, 2048] {
            let packed: Vec<u8> = (0..k / 2).map(|i| (i * 131 % 256) as u8).collect();
            for first in (0..256).step_by(k / 16) {
                let scales: Vec<u8> = (0..k / 16).map(|i| ((first + i) % 256) as u8).collect();
                let mut want = vec![0u16; k];
                crate::bf16::nvfp4_row(&packed, &scales, &mut Vec::new(), &mut want);
                let mut got = vec![0xFFFFu16; k.div_ceil(STEP) * T * STEP];
                decode_nvfp4_row(&packed, &scales, &mut got);
                for c in 0..k {
                    let (g, w) = (got[(c / STEP) * T * STEP + c % STEP], want[c]);
                    let nan = |b: u16| b & 0x7FFF > 0x7F80;
                    assert!(g == w || nan(g) && nan(w), "k={k} scales from {first} [{c}]: {g:#06x} vs {w:#06x}");
                }
            }
        }
    }

    /// Odd shapes (rows not multiples of 16 or 32, k not a multiple of 32, odd k) against an f64 sum of
    /// the same bf16 values, for bf16 and NVFP4 weights.
    #[test]
    fn odd_shapes_equal_an_f64_sum_of_the_bf16_values() {
        if !super::super::available() {
            eprintln!("AMX-BF16 tile tests skipped: {}", super::super::status().describe());
            return;
        }
        for (m, n, k) in
            [(1, 1, 2), (5, 17, 48), (17, 33, 100), (33, 70, 128), (40, 64, 2048), (16, 16, 31), (48, 96, 64)]
        {
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
        for (m, n, k) in [(19, 21, 64), (33, 64, 48), (5, 40, 2048)] {
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
                    let tol = 1e-5 * (k as f64).sqrt() * want.abs().max(1.0);
                    assert!((f64::from(got[i * n + r]) - want).abs() < tol, "nvfp4 m={m} n={n} k={k} ({i},{r})");
                }
            }
        }
    }
}
