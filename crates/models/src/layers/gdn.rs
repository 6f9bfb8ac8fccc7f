//! Gated DeltaNet (Qwen3.5 `linear_attn`): in_proj_qkv → causal conv (carried state) + silu → split
//! `q | k | v` → L2-normalised q, k → gated delta rule with an fp32 recurrent state → RMSNormGated with
//! silu(z) → out_proj. Prefill chunks use the chunked rule, single-token steps the recurrent one (as
//! transformers does: the chunked rule restarts its 64-token chunks at each call).

use osprey_kernels::gdn::{causal_conv_silu, gated_delta_chunked, gated_delta_recurrent, DeltaInputs, GdnShape};
use osprey_kernels::norm::{l2_norm, rms_norm_gated};
use osprey_kernels::{sigmoid, softplus};

use super::{linear, Segment};
use crate::checkpoint::{Checkpoint, Weight};
use crate::config::TextConfig;
use crate::error::Result;

/// Conv + recurrent state of one Gated DeltaNet layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearState {
    /// The last `kernel - 1` pre-conv inputs `[kernel-1, conv_dim]`, oldest first.
    pub(crate) conv: Vec<f32>,
    /// `[nv, dk, dv]` in f32.
    pub(crate) recurrent: Vec<f32>,
}

impl LinearState {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        (self.conv.len() + self.recurrent.len()) * std::mem::size_of::<f32>()
    }
}

/// One Gated DeltaNet layer.
#[derive(Debug)]
pub struct GatedDeltaNet {
    in_proj_qkv: Weight,
    in_proj_z: Weight,
    in_proj_b: Weight,
    in_proj_a: Weight,
    out_proj: Weight,
    /// `[conv_dim, kernel]`.
    conv_w: Vec<f32>,
    /// `-exp(A_log)`, precomputed.
    neg_a: Vec<f32>,
    dt_bias: Vec<f32>,
    norm_w: Vec<f32>,
    shape: GdnShape,
    kernel: usize,
    eps: f32,
}

impl GatedDeltaNet {
    /// Loads `{prefix}.*` (see REFERENCE.md §1 for the shapes).
    pub fn load(ck: &Checkpoint, prefix: &str, cfg: &TextConfig) -> Result<Self> {
        let h = cfg.hidden_size;
        let shape = GdnShape {
            nk: cfg.linear_num_key_heads,
            nv: cfg.linear_num_value_heads,
            dk: cfg.linear_key_head_dim,
            dv: cfg.linear_value_head_dim,
        };
        let (kd, vd) = (shape.nk * shape.dk, shape.nv * shape.dv);
        let conv_dim = 2 * kd + vd;
        let kernel = cfg.linear_conv_kernel_dim;
        let w = |n: &str, s: &[usize]| ck.linear(&format!("{prefix}.{n}"), s[0], s[1]);
        let a_log = ck.vector(&format!("{prefix}.A_log"), shape.nv)?;
        Ok(GatedDeltaNet {
            in_proj_qkv: w("in_proj_qkv", &[conv_dim, h])?,
            in_proj_z: w("in_proj_z", &[vd, h])?,
            in_proj_b: w("in_proj_b", &[shape.nv, h])?,
            in_proj_a: w("in_proj_a", &[shape.nv, h])?,
            out_proj: w("out_proj", &[h, vd])?,
            conv_w: ck.weight(&format!("{prefix}.conv1d.weight"), &[conv_dim, 1, kernel])?.to_f32(),
            neg_a: a_log.iter().map(|a| -a.exp()).collect(),
            dt_bias: ck.vector(&format!("{prefix}.dt_bias"), shape.nv)?,
            norm_w: ck.vector(&format!("{prefix}.norm.weight"), shape.dv)?,
            shape,
            kernel,
            eps: cfg.rms_norm_eps as f32,
        })
    }

    fn conv_dim(&self) -> usize {
        2 * self.shape.nk * self.shape.dk + self.shape.nv * self.shape.dv
    }

    /// Zeroed state for a new sequence.
    pub fn new_state(&self) -> LinearState {
        LinearState {
            conv: vec![0.0; (self.kernel - 1) * self.conv_dim()],
            recurrent: vec![0.0; self.shape.state_len()],
        }
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`, advancing each segment's state.
    pub fn forward(&self, x: &[f32], segs: &[Segment], states: &mut [&mut LinearState]) -> Vec<f32> {
        let s = self.shape;
        let t = x.len() / self.in_proj_qkv.cols();
        let (kd, vd, cd) = (s.nk * s.dk, s.nv * s.dv, self.conv_dim());
        // 1. Projections for all rows of the batch.
        let mixed = linear(x, t, &self.in_proj_qkv); // [T, cd] rows q|k|v
        let z = linear(x, t, &self.in_proj_z); // [T, vd]
        let b = linear(x, t, &self.in_proj_b); // [T, nv]
        let a = linear(x, t, &self.in_proj_a); // [T, nv]
        let mut core = vec![0f32; t * vd];
        for (seg, st) in segs.iter().zip(states.iter_mut()) {
            let (r0, n) = (seg.row, seg.len);
            // 2. Causal conv + silu, continuing from the sequence's last kernel-1 inputs.
            let mut conv = vec![0f32; n * cd];
            causal_conv_silu(&mixed[r0 * cd..(r0 + n) * cd], cd, &self.conv_w, self.kernel, &mut st.conv, &mut conv);
            // 3. Split, L2-normalise q and k, scale q.
            let mut q = Vec::with_capacity(n * kd);
            let mut k = Vec::with_capacity(n * kd);
            let mut v = Vec::with_capacity(n * vd);
            for row in conv.chunks(cd) {
                q.extend_from_slice(&row[..kd]);
                k.extend_from_slice(&row[kd..2 * kd]);
                v.extend_from_slice(&row[2 * kd..]);
            }
            l2_norm(&mut q, s.dk, 1e-6);
            l2_norm(&mut k, s.dk, 1e-6);
            let scale = (s.dk as f32).powf(-0.5);
            q.iter_mut().for_each(|x| *x *= scale);
            // 4. β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias).
            let mut beta = vec![0f32; n * s.nv];
            let mut g = vec![0f32; n * s.nv];
            for i in 0..n {
                for h in 0..s.nv {
                    let idx = (r0 + i) * s.nv + h;
                    beta[i * s.nv + h] = sigmoid(b[idx]);
                    g[i * s.nv + h] = self.neg_a[h] * softplus(a[idx] + self.dt_bias[h]);
                }
            }
            let inp = DeltaInputs { q: &q, k: &k, v: &v, g: &g, beta: &beta };
            let out = &mut core[r0 * vd..(r0 + n) * vd];
            if n == 1 && seg.past > 0 {
                gated_delta_recurrent(s, inp, &mut st.recurrent, out);
            } else {
                gated_delta_chunked(s, inp, &mut st.recurrent, out);
            }
        }
        // 5. Gated norm per (token, head) with silu(z), then the output projection.
        rms_norm_gated(&mut core, &z, &self.norm_w, self.eps);
        linear(&core, t, &self.out_proj)
    }

    /// Bytes of weights.
    pub fn bytes(&self) -> usize {
        self.in_proj_qkv.bytes()
            + self.in_proj_z.bytes()
            + self.in_proj_b.bytes()
            + self.in_proj_a.bytes()
            + self.out_proj.bytes()
    }
}
