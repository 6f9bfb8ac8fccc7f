//! Partial NeoX rotary embedding with interleaved multimodal sections (mRoPE), as Qwen3.5 applies it.
//!
//! Frequency `f` of the `rot/2` rotary frequencies takes its angle from one of three position axes
//! (T, H, W): `H if f%3==1 && f < 3·sec[1]`, `W if f%3==2 && f < 3·sec[2]`, else `T` (so the real
//! `[11, 11, 10]` gives `THWTHW…TH`). Text tokens have equal axes, so this reduces to plain 1-D rope.

/// Precomputed inverse frequencies and the axis each frequency reads.
#[derive(Clone, Debug)]
pub struct MRope {
    inv_freq: Vec<f32>,
    axis: Vec<usize>,
    rot_dim: usize,
    head_dim: usize,
}

impl MRope {
    /// `head_dim·partial_rotary_factor` rotary dims, base `theta`, sections `[t, h, w]` (frequency counts).
    pub fn new(head_dim: usize, rot_dim: usize, theta: f64, section: [usize; 3]) -> Self {
        let half = rot_dim / 2;
        // transformers computes `base ** (arange(0, dim, 2).float() / dim)` in f32.
        let inv_freq = (0..half).map(|f| 1.0f32 / (theta as f32).powf((2 * f) as f32 / rot_dim as f32)).collect();
        let axis = (0..half)
            .map(|f| {
                if f % 3 == 1 && f < 3 * section[1] {
                    1
                } else if f % 3 == 2 && f < 3 * section[2] {
                    2
                } else {
                    0
                }
            })
            .collect();
        MRope { inv_freq, axis, rot_dim, head_dim }
    }

    /// The same rotary (dims, frequencies, sections) for heads of another width (QSA's indexer heads
    /// share the decoder's rotary).
    pub fn with_head_dim(&self, head_dim: usize) -> Self {
        MRope { head_dim, ..self.clone() }
    }

    /// Number of rotated dims at the start of each head.
    pub fn rot_dim(&self) -> usize {
        self.rot_dim
    }

    /// `(cos, sin)` tables of length `rot/2` for one token at `pos = [t, h, w]`.
    pub fn cos_sin(&self, pos: [i64; 3], cos: &mut [f32], sin: &mut [f32]) {
        for f in 0..self.inv_freq.len() {
            let angle = pos[self.axis[f]] as f32 * self.inv_freq[f];
            cos[f] = angle.cos();
            sin[f] = angle.sin();
        }
    }

    /// Rotates the first `rot_dim` dims of every head in `x` (`[heads, head_dim]`) with one token's tables.
    pub fn apply(&self, x: &mut [f32], cos: &[f32], sin: &[f32]) {
        rotate_half_pairs(x, self.head_dim, cos, sin);
    }
}

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axis_assignment_matches_real_sections() {
        let r = MRope::new(256, 64, 1e7, [11, 11, 10]);
        let s: String = r.axis.iter().map(|&a| ['T', 'H', 'W'][a]).collect();
        assert_eq!(s, "THWTHWTHWTHWTHWTHWTHWTHWTHWTHWTH");
        let tiny = MRope::new(64, 16, 1e7, [3, 3, 2]);
        let s: String = tiny.axis.iter().map(|&a| ['T', 'H', 'W'][a]).collect();
        assert_eq!(s, "THWTHWTH");
    }

    #[test]
    fn rotation_is_norm_preserving_and_identity_at_zero() {
        let r = MRope::new(8, 4, 10000.0, [1, 1, 0]);
        let (mut c, mut s) = (vec![0.0; 2], vec![0.0; 2]);
        r.cos_sin([0, 0, 0], &mut c, &mut s);
        let mut x = vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0];
        let orig = x.clone();
        r.apply(&mut x, &c, &s);
        assert_eq!(x, orig);
        r.cos_sin([5, 5, 5], &mut c, &mut s);
        r.apply(&mut x, &c, &s);
        let n = |v: &[f32]| v.iter().map(|a| a * a).sum::<f32>();
        assert!((n(&x[..4]) - n(&orig[..4])).abs() < 1e-4);
        assert_eq!(&x[4..], &orig[4..]);
    }
}
