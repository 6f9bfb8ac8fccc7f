//! NVFP4 quantisation of a dense weight, the ModelOpt recipe with round-to-nearest-even everywhere:
//! `global = amax(W) / (6 · 448)`; per 16-value block `s = e4m3(amax(block) / 6 / global)`;
//! `q = e2m1(clamp(w / (s · global), −6, 6))`. `tools/nvfp4_ref.py` is the numpy reference the tests
//! compare against byte for byte.

use osprey_kernels::nvfp4::{e4m3_to_f32, f32_to_e4m3, BLOCK, E2M1};

/// Nearest e2m1 code (ties to the even mantissa, i.e. `torch.round` on the e2m1 grid).
pub fn f32_to_e2m1(x: f32) -> u8 {
    let sign = if x < 0.0 { 8u8 } else { 0 };
    let a = x.abs().min(6.0);
    let mut best = 0usize;
    for (i, v) in E2M1.iter().enumerate() {
        let (d, db) = ((a - v).abs(), (a - E2M1[best]).abs());
        if d < db || (d == db && i % 2 == 0) {
            best = i;
        }
    }
    if best == 0 {
        0
    } else {
        sign | best as u8
    }
}

/// A quantised matrix.
#[derive(Clone, Debug, PartialEq)]
pub struct Nvfp4Tensor {
    /// `[rows, cols/2]`, even column in the low nibble.
    pub packed: Vec<u8>,
    /// `[rows, cols/16]` e4m3.
    pub scales: Vec<u8>,
    /// Global scale (`weight_scale_2`).
    pub global: f32,
}

/// Quantises a row-major `[rows, cols]` matrix (`cols` a multiple of 16).
pub fn quantize_nvfp4(w: &[f32], rows: usize, cols: usize) -> Nvfp4Tensor {
    assert!(cols.is_multiple_of(BLOCK) && w.len() == rows * cols, "nvfp4 shapes: this is a bug");
    let amax = w.iter().fold(0f32, |m, v| m.max(v.abs()));
    let global = if amax > 0.0 { amax / (6.0 * 448.0) } else { 1.0 };
    let mut packed = vec![0u8; rows * cols / 2];
    let mut scales = vec![0u8; rows * cols / BLOCK];
    for (b, block) in w.chunks(BLOCK).enumerate() {
        let bmax = block.iter().fold(0f32, |m, v| m.max(v.abs()));
        let s = f32_to_e4m3(bmax / 6.0 / global);
        scales[b] = s;
        let denom = e4m3_to_f32(s) * global;
        for (j, v) in block.iter().enumerate() {
            let code = if denom > 0.0 { f32_to_e2m1(v / denom) } else { 0 };
            let at = (b * BLOCK + j) / 2;
            packed[at] |= if j % 2 == 0 { code } else { code << 4 };
        }
    }
    Nvfp4Tensor { packed, scales, global }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn e2m1_rounding_is_nearest_even() {
        let cases = [
            (0.26, 1u8),
            (0.24, 0),
            (0.25, 0),
            (0.75, 2),
            (1.25, 2),
            (1.75, 4),
            (2.5, 4),
            (3.5, 6),
            (5.0, 6),
            (7.0, 7),
            (-0.5, 9),
            (-0.1, 0),
        ];
        for (x, code) in cases {
            assert_eq!(f32_to_e2m1(x), code, "{x}");
        }
    }

    #[test]
    fn quantised_error_is_bounded_by_half_a_step() {
        let (rows, cols) = (4, 32);
        let w: Vec<f32> = (0..rows * cols).map(|i| ((i * 7919 % 101) as f32 - 50.0) / 25.0).collect();
        let q = quantize_nvfp4(&w, rows, cols);
        let mut back = vec![0f32; cols];
        for r in 0..rows {
            osprey_kernels::nvfp4::dequant_row(
                &q.packed[r * cols / 2..(r + 1) * cols / 2],
                &q.scales[r * 2..(r + 1) * 2],
                q.global,
                &mut back,
            );
            for (j, (a, b)) in w[r * cols..(r + 1) * cols].iter().zip(&back).enumerate() {
                let s = e4m3_to_f32(q.scales[r * 2 + j / 16]) * q.global;
                // The largest e2m1 gap is 2 (between 4 and 6): error ≤ one step of the block's scale.
                assert!((a - b).abs() <= s * 1.0 + 1e-6, "row {r} col {j}: {a} vs {b}");
            }
        }
    }
}
