//! Partial NeoX rotary embedding with interleaved multimodal sections (mRoPE), as Qwen3.5 applies it.
//!
//! Frequency `f` of the `rot/2` rotary frequencies takes its angle from one of three position axes
//! (T, H, W): `H if f%3==1 && f < 3·sec[1]`, `W if f%3==2 && f < 3·sec[2]`, else `T` (so the real
//! `[11, 11, 10]` gives `THWTHW…TH`). Text tokens have equal axes, so this reduces to plain 1-D rope.

pub use osprey_backend::types::MRope;

/// NeoX rotation of every `head_dim`-wide head of `x`: with `half = cos.len()`, dims `f` and `f + half`
/// rotate by the angle whose cosine/sine are `cos[f]`/`sin[f]`; dims from `2·half` on pass through.
/// (`q·cos + rotate_half(q)·sin` with `cos = cat(c, c)`.)
pub fn rotate_half_pairs(x: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for head in x.chunks_mut(head_dim) {
        for f in 0..half {
            let (a, b) = (head[f], head[f + half]);
            head[f] = a * cos[f] - b * sin[f];
            head[f + half] = b * cos[f] + a * sin[f];
        }
    }
}

/// Rotates the first `rot_dim` dims of every head in `x` (`[heads, head_dim]`) with one token's tables.
pub fn apply(rope: &MRope, x: &mut [f32], cos: &[f32], sin: &[f32]) {
    rotate_half_pairs(x, rope.head_dim(), cos, sin);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rotation_is_norm_preserving_and_identity_at_zero() {
        let r = MRope::new(8, 4, 10000.0, [1, 1, 0]);
        let (mut c, mut s) = (vec![0.0; 2], vec![0.0; 2]);
        r.cos_sin([0, 0, 0], &mut c, &mut s);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = x.clone();
        apply(&r, &mut x, &c, &s);
        assert_eq!(x, orig);
        r.cos_sin([5, 5, 5], &mut c, &mut s);
        apply(&r, &mut x, &c, &s);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x[..4]) - n(&orig[..4])).abs() < 1e-4);
        assert_eq!(&x[4..], &orig[4..]);
    }
}
