//! Normalisations, in the operation order transformers uses (so rounding matches closely).

use crate::act::silu;

#[inline]
fn inv_rms(x: &[f32], eps: f32) -> f32 {
    let ms = x.iter().map(|v| v * v).sum::<f32>() / x.len() as f32;
    1.0 / (ms + eps).sqrt()
}

/// Zero-centred RMSNorm of every `w.len()`-wide row of `x`, in place: `(x·rsqrt(mean(x²)+eps))·(1+w)`.
pub fn rms_norm_1p(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_mut(w.len()) {
        let r = inv_rms(row, eps);
        for (v, wi) in row.iter_mut().zip(w) {
            *v = (*v * r) * (1.0 + wi);
        }
    }
}

/// RMSNorm of every `w.len()`-wide row of `x`, in place: `(x·rsqrt(mean(x²)+eps))·w`.
pub fn rms_norm(x: &mut [f32], w: &[f32], eps: f32) {
    for row in x.chunks_mut(w.len()) {
        let r = inv_rms(row, eps);
        for (v, wi) in row.iter_mut().zip(w) {
            *v = (*v * r) * wi;
        }
    }
}

/// Zero-centred RMSNorm from `x` into `out` (same shapes).
pub fn rms_norm_1p_into(x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
    out.copy_from_slice(x);
    rms_norm_1p(out, w, eps);
}

/// Gated RMSNorm (RMSNormGated, norm before gate) of every row, in place: `w·(x·rsqrt(mean(x²)+eps))·silu(z)`.
pub fn rms_norm_gated(x: &mut [f32], z: &[f32], w: &[f32], eps: f32) {
    for (row, zr) in x.chunks_mut(w.len()).zip(z.chunks(w.len())) {
        let r = inv_rms(row, eps);
        for ((v, wi), zi) in row.iter_mut().zip(w).zip(zr) {
            *v = (wi * (*v * r)) * silu(*zi);
        }
    }
}

/// L2 normalisation of every `dim`-wide row, in place: `x·rsqrt(Σx²+eps)` (the FLA-compatible form).
pub fn l2_norm(x: &mut [f32], dim: usize, eps: f32) {
    for row in x.chunks_mut(dim) {
        let r = 1.0 / (row.iter().map(|v| v * v).sum::<f32>() + eps).sqrt();
        row.iter_mut().for_each(|v| *v *= r);
    }
}

/// LayerNorm of every `w.len()`-wide row, in place: `(x − mean)·rsqrt(var + eps)·w + b` (biased variance).
pub fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32], eps: f32) {
    let d = w.len() as f32;
    for row in x.chunks_mut(w.len()) {
        let mean = row.iter().sum::<f32>() / d;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / d;
        let r = 1.0 / (var + eps).sqrt();
        for ((v, wi), bi) in row.iter_mut().zip(w).zip(b) {
            *v = (*v - mean) * r * wi + bi;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norms_on_a_known_row() {
        let mut x = vec![3.0f32, 4.0];
        rms_norm_1p(&mut x, &[0.0, 1.0], 0.0);
        let r = (12.5f32).sqrt();
        assert!((x[0] - 3.0 / r).abs() < 1e-6 && (x[1] - 8.0 / r).abs() < 1e-6);
        let mut y = vec![3.0f32, 4.0];
        l2_norm(&mut y, 2, 0.0);
        assert!((y[0] - 0.6).abs() < 1e-6 && (y[1] - 0.8).abs() < 1e-6);
        let mut g = vec![3.0f32, 4.0];
        rms_norm_gated(&mut g, &[0.0, 100.0], &[1.0, 2.0], 0.0);
        assert!(g[0].abs() < 1e-7 && (g[1] - 8.0 / r * 100.0).abs() < 1e-3);
        let mut l = vec![1.0f32, 3.0];
        layer_norm(&mut l, &[2.0, 2.0], &[0.5, 0.5], 0.0);
        assert!((l[0] + 1.5).abs() < 1e-6 && (l[1] - 2.5).abs() < 1e-6);
    }
}
