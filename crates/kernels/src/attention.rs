//! Causal grouped-query attention of a sequence's new queries over its cached keys and values.

use rayon::prelude::*;

/// Head geometry of one attention layer.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (`heads` is a multiple of it).
    pub kv_heads: usize,
    /// Dims per head.
    pub head_dim: usize,
}

/// `out[i, h] = softmax(q[i,h]·K[..=start+i]ᵀ·scale)·V` for `n = q.len()/(heads·head_dim)` queries at
/// positions `start..start+n`. `k`, `v` are `[t, kv_heads, head_dim]` and already hold the new tokens.
pub fn causal_attention(q: &[f32], k: &[f32], v: &[f32], start: usize, s: AttnShape, scale: f32, out: &mut [f32]) {
    let n = q.len() / (s.heads * s.head_dim);
    assert!(k.len() >= (start + n) * s.kv_heads * s.head_dim, "attention cache too short: this is a bug");
    attend(q, k, v, s, scale, out, |i| start + i + 1);
}

/// Every query attends to every key (vision tower: one image or one video frame group at a time).
pub fn bidirectional_attention(q: &[f32], k: &[f32], v: &[f32], s: AttnShape, scale: f32, out: &mut [f32]) {
    let m = k.len() / (s.kv_heads * s.head_dim);
    attend(q, k, v, s, scale, out, |_| m);
}

/// Query `i` attends to keys `[0, visible(i))`.
fn attend(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    s: AttnShape,
    scale: f32,
    out: &mut [f32],
    visible: impl Fn(usize) -> usize + Sync,
) {
    let (hd, nh, nkv) = (s.head_dim, s.heads, s.kv_heads);
    let kv_row = nkv * hd;
    assert!(v.len() == k.len() && out.len() == q.len(), "attention shapes: this is a bug");
    let group = nh / nkv;
    out.par_chunks_mut(hd).enumerate().for_each_init(Vec::new, |scores: &mut Vec<f32>, (idx, o)| {
        let (i, h) = (idx / nh, idx % nh);
        let kvh = h / group;
        let qv = &q[idx * hd..(idx + 1) * hd];
        let t = visible(i);
        scores.clear();
        let mut max = f32::NEG_INFINITY;
        for j in 0..t {
            let kr = &k[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            let sc = crate::simd::dot_f32(qv, kr) * scale;
            max = max.max(sc);
            scores.push(sc);
        }
        let mut sum = 0.0;
        for sc in scores.iter_mut() {
            *sc = (*sc - max).exp();
            sum += *sc;
        }
        o.fill(0.0);
        for (j, p) in scores.iter().enumerate() {
            let w = p / sum;
            let vr = &v[j * kv_row + kvh * hd..j * kv_row + (kvh + 1) * hd];
            for (a, b) in o.iter_mut().zip(vr) {
                *a += w * b;
            }
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn single_key_returns_its_value_and_equal_scores_average() {
        let s = AttnShape { heads: 2, kv_heads: 1, head_dim: 2 };
        let q = vec![1.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0];
        let k = vec![0.0, 0.0, 0.0, 0.0];
        let v = vec![1.0, 2.0, 3.0, 4.0];
        let mut out = vec![0.0; 8];
        causal_attention(&q, &k, &v, 0, s, 1.0, &mut out);
        assert_eq!(&out[..4], &[1.0, 2.0, 1.0, 2.0]);
        assert_eq!(&out[4..], &[2.0, 3.0, 2.0, 3.0]);
        // Bidirectional: the first query also sees the second key.
        bidirectional_attention(&q, &k, &v, s, 1.0, &mut out);
        assert_eq!(&out[..4], &[2.0, 3.0, 2.0, 3.0]);
    }
}
