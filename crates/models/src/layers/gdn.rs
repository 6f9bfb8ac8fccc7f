//! Gated DeltaNet (Qwen3.5 `linear_attn`): in_proj_qkv → causal conv (carried state) + silu → split
//! `q | k | v` → L2-normalised q, k → gated delta rule with an fp32 recurrent state → RMSNormGated with
//! silu(z) → out_proj. Prefill chunks use the chunked rule, single-token steps the recurrent one (as
//! transformers does: the chunked rule restarts its 64-token chunks at each call).

use std::ops::Range;

use osprey_backend::{Backend, GdnShape, HostTensor, Tensor};

use super::{load_linear, load_vector, Segment};
use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::error::Result;

/// Conv + recurrent state of one Gated DeltaNet layer, on the backend.
#[derive(Clone, Debug)]
pub struct LinearState {
    /// The last `kernel - 1` pre-conv inputs `[kernel-1, conv_dim]`, oldest first.
    pub(crate) conv: Tensor,
    /// `[nv, dk, dv]` in f32.
    pub(crate) recurrent: Tensor,
    /// After a verification: `(conv, recurrent)` after each of its tokens (what [`LinearState::rewind`]
    /// picks from); emptied by the next forward.
    pub(crate) kept: Vec<(Tensor, Tensor)>,
}

impl LinearState {
    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.conv.bytes() + self.recurrent.bytes()
    }

    /// A host copy.
    pub fn to_host(&self, b: &dyn Backend) -> Result<HostLinearState> {
        Ok(HostLinearState { conv: b.download_host(&self.conv)?, recurrent: b.download_host(&self.recurrent)? })
    }

    /// Replaces the state with a host copy's.
    pub fn restore(&mut self, h: &HostLinearState, b: &dyn Backend) -> Result<()> {
        self.conv = b.upload_host(&h.conv)?;
        self.recurrent = b.upload_host(&h.recurrent)?;
        self.kept.clear();
        Ok(())
    }

    /// The state after the first `keep` tokens of the last verification.
    pub fn rewind(&mut self, keep: usize) -> Result<()> {
        if keep == 0 || keep > self.kept.len() {
            return Err(crate::error::Error::InvalidInput(format!(
                "rewind to {keep} of {} kept states",
                self.kept.len()
            )));
        }
        let (conv, recurrent) = self.kept.swap_remove(keep - 1);
        (self.conv, self.recurrent) = (conv, recurrent);
        self.kept.clear();
        Ok(())
    }
}

/// A [`LinearState`] in host memory (a snapshot's).
#[derive(Clone, Debug)]
pub struct HostLinearState {
    conv: HostTensor,
    recurrent: HostTensor,
}

impl HostLinearState {
    /// Host bytes held.
    pub fn bytes(&self) -> usize {
        self.conv.bytes() + self.recurrent.bytes()
    }
}

/// The input projections a layer's token mixing reads, for all rows of the batch.
struct Projected {
    mixed: Tensor,
    a: Tensor,
    bb: Tensor,
}

/// The delta rule's inputs for some rows: normalised q and k, v, and the gates.
struct Inputs {
    q: Tensor,
    k: Tensor,
    v: Tensor,
    beta: Tensor,
    g: Tensor,
}

/// One Gated DeltaNet layer.
#[derive(Debug)]
pub struct GatedDeltaNet {
    in_proj_qkv: Tensor,
    in_proj_z: Tensor,
    in_proj_b: Tensor,
    in_proj_a: Tensor,
    out_proj: Tensor,
    /// `[conv_dim, kernel]`.
    conv_w: Tensor,
    /// `-exp(A_log)`, precomputed.
    neg_a: Tensor,
    dt_bias: Tensor,
    norm_w: Tensor,
    shape: GdnShape,
    kernel: usize,
    eps: f32,
    /// The output norm's gate: silu (Qwen3.5) or sigmoid (`qwen4_exp`'s `output_gate_type`).
    sigmoid_gate: bool,
}

impl GatedDeltaNet {
    /// Loads `{prefix}.*` onto `b` (see REFERENCE.md §1 for the shapes).
    pub fn load(b: &dyn Backend, ck: &Checkpoint, prefix: &str, cfg: &TextConfig) -> Result<Self> {
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
        let w = |n: &str, out: usize, inp: usize| load_linear(b, ck, &format!("{prefix}.{n}"), out, inp);
        let a_log = ck.vector(&format!("{prefix}.A_log"), shape.nv)?;
        let neg_a: Vec<f32> = a_log.iter().map(|a| -a.exp()).collect();
        let conv_w = ck.weight(&format!("{prefix}.conv1d.weight"), &[conv_dim, 1, kernel])?.to_f32();
        Ok(GatedDeltaNet {
            in_proj_qkv: w("in_proj_qkv", conv_dim, h)?,
            in_proj_z: w("in_proj_z", vd, h)?,
            in_proj_b: w("in_proj_b", shape.nv, h)?,
            in_proj_a: w("in_proj_a", shape.nv, h)?,
            out_proj: w("out_proj", h, vd)?,
            conv_w: b.upload_f32(&conv_w, &[conv_dim, kernel])?,
            neg_a: b.upload_f32(&neg_a, &[shape.nv])?,
            dt_bias: load_vector(b, ck, &format!("{prefix}.dt_bias"), shape.nv)?,
            norm_w: load_vector(b, ck, &format!("{prefix}.norm.weight"), shape.dv)?,
            shape,
            kernel,
            eps: cfg.rms_norm_eps as f32,
            sigmoid_gate: false,
        })
    }

    /// The same layer with a sigmoid output gate instead of silu.
    pub fn with_sigmoid_gate(mut self, sigmoid: bool) -> Self {
        self.sigmoid_gate = sigmoid;
        self
    }

    fn conv_dim(&self) -> usize {
        2 * self.shape.nk * self.shape.dk + self.shape.nv * self.shape.dv
    }

    /// Zeroed state for a new sequence.
    pub fn new_state(&self, b: &dyn Backend) -> Result<LinearState> {
        let s = self.shape;
        Ok(LinearState {
            conv: b.zeros_f32(&[self.kernel - 1, self.conv_dim()])?,
            recurrent: b.zeros_f32(&[s.nv, s.dk, s.dv])?,
            kept: Vec::new(),
        })
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`, advancing each segment's state. A segment marked
    /// in `verify` runs token by token with the recurrent rule (the numerics of single-token steps) and
    /// keeps its state after each token ([`LinearState::rewind`]).
    pub fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        segs: &[Segment],
        states: &mut [&mut LinearState],
        verify: &[bool],
    ) -> Result<Tensor> {
        // 1. Projections for all rows of the batch.
        // q|k|v [T, cd], a and b [T, nv], z [T, vd]: one pass over x on a device.
        let [mixed, a, bb, z] =
            super::linears(b, x, [&self.in_proj_qkv, &self.in_proj_a, &self.in_proj_b, &self.in_proj_z])?;
        let p = Projected { mixed, a, bb };
        states.iter_mut().for_each(|st| st.kept.clear());
        // A decode step of several sequences: one token each, past its first, not verifying. Every row's
        // ops run on the whole batch at once (one launch each on a device, not one per sequence), each
        // row's answer the one it gets alone.
        let decode = segs.len() > 1
            && segs.iter().enumerate().all(|(i, seg)| seg.row == i && seg.len == 1 && seg.past > 0)
            && !verify.iter().any(|&v| v);
        let mut core =
            if decode { self.mix_rows(b, &p, states)? } else { self.mix_segments(b, &p, segs, states, verify)? };
        // 5. Gated norm per (token, head) with silu(z), then the output projection.
        if self.sigmoid_gate {
            b.rms_norm_gated_sigmoid(&mut core, &z, &self.norm_w, self.eps);
        } else {
            b.rms_norm_gated(&mut core, &z, &self.norm_w, self.eps);
        }
        Ok(b.linear(&core, &self.out_proj)?)
    }

    /// Steps 2–4 segment by segment → `core [T, vd]`; a segment marked in `verify` token by token, its
    /// state kept after each.
    fn mix_segments(
        &self,
        b: &dyn Backend,
        p: &Projected,
        segs: &[Segment],
        states: &mut [&mut LinearState],
        verify: &[bool],
    ) -> Result<Tensor> {
        let mut core = b.zeros_f32(&[p.mixed.rows(), self.shape.nv * self.shape.dv])?;
        for (si, (seg, st)) in segs.iter().zip(states.iter_mut()).enumerate() {
            if verify.get(si).copied().unwrap_or(false) {
                for j in 0..seg.len {
                    let one = Segment { row: seg.row + j, len: 1, past: seg.past + j };
                    self.mix(b, p, one, st, &mut core)?;
                    st.kept.push((st.conv.clone(), st.recurrent.clone()));
                }
            } else {
                self.mix(b, p, *seg, st, &mut core)?;
            }
        }
        Ok(core)
    }

    /// Steps 2–4 for one segment: conv, q/k/v, gates and the delta rule into its rows of `core`.
    fn mix(&self, b: &dyn Backend, p: &Projected, seg: Segment, st: &mut LinearState, core: &mut Tensor) -> Result<()> {
        let (s, vd) = (self.shape, self.shape.nv * self.shape.dv);
        let rows = seg.row..seg.row + seg.len;
        // 2. Causal conv + silu, continuing from the sequence's last kernel-1 inputs.
        let conv = b.causal_conv_silu(&p.mixed, rows.clone(), &self.conv_w, self.kernel, &mut st.conv)?;
        // A decode token (the recurrent form): steps 3–4 as one op, one launch on a device.
        let out = if seg.len == 1 && seg.past > 0 {
            self.step(b, p, &conv, rows, &mut [&mut st.recurrent])?
        } else {
            let Inputs { q, k, v, beta, g } = self.inputs(b, p, &conv, rows)?;
            b.gated_delta(s, false, &q, &k, &v, &g, &beta, &mut st.recurrent)?
        };
        b.write_rows(core, seg.row * vd, &out, 0..seg.len);
        Ok(())
    }

    /// Steps 2–4 for a decode step of several sequences, row `i` sequence `i`: [`Self::mix`]'s ops over
    /// every row at once → `core [T, vd]`.
    fn mix_rows(&self, b: &dyn Backend, p: &Projected, states: &mut [&mut LinearState]) -> Result<Tensor> {
        let mut convs: Vec<&mut Tensor> = states.iter_mut().map(|st| &mut st.conv).collect();
        let conv = b.causal_conv_silu_rows(&p.mixed, &self.conv_w, self.kernel, &mut convs)?;
        let mut recurrent: Vec<&mut Tensor> = states.iter_mut().map(|st| &mut st.recurrent).collect();
        self.step(b, p, &conv, 0..conv.rows(), &mut recurrent)
    }

    /// Steps 3–4 of decode tokens from the conv's output, rows `rows` of the batch's gates, row `i` the
    /// state `states[i]`: one op (`gated_delta_step`, one launch on a device).
    fn step(
        &self,
        b: &dyn Backend,
        p: &Projected,
        conv: &Tensor,
        rows: Range<usize>,
        states: &mut [&mut Tensor],
    ) -> Result<Tensor> {
        let (s, scale) = (self.shape, self.q_scale());
        Ok(b.gated_delta_step(s, conv, &p.a, &p.bb, rows, &self.neg_a, &self.dt_bias, scale, states)?)
    }

    /// Steps 3–4 on the conv's output for `rows` of the batch: split, L2-normalise q and k, scale q; the
    /// gates β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias).
    fn inputs(&self, b: &dyn Backend, p: &Projected, conv: &Tensor, rows: Range<usize>) -> Result<Inputs> {
        let s = self.shape;
        let (kd, vd) = (s.nk * s.dk, s.nv * s.dv);
        let mut qkv = b.split_cols(conv, 1, &[kd, kd, vd])?.into_iter();
        let (mut q, mut k, v) = (qkv.next().expect("q"), qkv.next().expect("k"), qkv.next().expect("v"));
        b.l2_norm(&mut q, s.dk, 1e-6);
        b.l2_norm(&mut k, s.dk, 1e-6);
        b.scale(&mut q, self.q_scale());
        let (beta, g) = b.delta_gates(&p.a, &p.bb, rows, &self.neg_a, &self.dt_bias)?;
        Ok(Inputs { q, k, v, beta, g })
    }

    /// q's scale after its L2 norm, `dk^-½`.
    fn q_scale(&self) -> f32 {
        (self.shape.dk as f32).powf(-0.5)
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
