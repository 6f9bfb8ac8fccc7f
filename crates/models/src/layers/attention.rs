//! Gated full attention (Qwen3.5 `self_attn`): q_proj yields `[q_h | gate_h]` interleaved per head,
//! q/k get a zero-centred RMSNorm per head, partial mRoPE, GQA causal attention over the sequence's KV,
//! then `o_proj(attn · sigmoid(gate))`.

use osprey_kernels::attention::{causal_attention_paged, AttnShape, PagedKv};
use osprey_kernels::norm::rms_norm_1p;
use osprey_kernels::rope::MRope;
use osprey_kernels::sigmoid;

use super::{linear, Segment};
use crate::checkpoint::{Checkpoint, Weight};
use crate::config::TextConfig;
use crate::error::Result;
use crate::kv::PageTable;

/// Per-row rotary tables for one forward (shared by every full-attention layer).
#[derive(Clone, Debug)]
pub struct RopeTables {
    /// `[T, rot/2]`.
    pub cos: Vec<f32>,
    /// `[T, rot/2]`.
    pub sin: Vec<f32>,
    /// `rot/2`.
    pub half: usize,
}

impl RopeTables {
    /// Tables for positions `[T][t, h, w]`.
    pub fn new(rope: &MRope, positions: &[[i64; 3]]) -> Self {
        let half = rope.rot_dim() / 2;
        let mut cos = vec![0f32; positions.len() * half];
        let mut sin = vec![0f32; positions.len() * half];
        for (i, p) in positions.iter().enumerate() {
            rope.cos_sin(*p, &mut cos[i * half..(i + 1) * half], &mut sin[i * half..(i + 1) * half]);
        }
        RopeTables { cos, sin, half }
    }

    fn row(&self, i: usize) -> (&[f32], &[f32]) {
        (&self.cos[i * self.half..(i + 1) * self.half], &self.sin[i * self.half..(i + 1) * self.half])
    }
}

/// One gated full-attention layer.
#[derive(Debug)]
pub struct GatedAttention {
    q_proj: Weight,
    k_proj: Weight,
    v_proj: Weight,
    o_proj: Weight,
    q_norm: Vec<f32>,
    k_norm: Vec<f32>,
    shape: AttnShape,
    eps: f32,
}

impl GatedAttention {
    /// Loads `{prefix}.{q,k,v,o}_proj`, `q_norm`, `k_norm`.
    pub fn load(ck: &Checkpoint, prefix: &str, cfg: &TextConfig) -> Result<Self> {
        let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim());
        let w = |n: &str, s: &[usize]| ck.linear(&format!("{prefix}.{n}"), s[0], s[1]);
        Ok(GatedAttention {
            q_proj: w("q_proj", &[nh * hd * 2, h])?,
            k_proj: w("k_proj", &[nkv * hd, h])?,
            v_proj: w("v_proj", &[nkv * hd, h])?,
            o_proj: w("o_proj", &[h, nh * hd])?,
            q_norm: ck.vector(&format!("{prefix}.q_norm.weight"), hd)?,
            k_norm: ck.vector(&format!("{prefix}.k_norm.weight"), hd)?,
            shape: AttnShape { heads: nh, kv_heads: nkv, head_dim: hd },
            eps: cfg.rms_norm_eps as f32,
        })
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`, writing each segment's K/V into plane `kv_layer`
    /// of its page table (slots `[past, past + len)`, reserved by the caller) and attending through it.
    pub fn forward(
        &self,
        x: &[f32],
        segs: &[Segment],
        (tables, kv_layer): (&mut [&mut PageTable], usize),
        rope: &RopeTables,
        rot: &MRope,
    ) -> Vec<f32> {
        let AttnShape { heads: nh, kv_heads: nkv, head_dim: hd } = self.shape;
        let t = x.len() / self.q_proj.cols();
        // 1. Projections. q_proj rows are [q_h (hd) | gate_h (hd)] per head.
        let qg = linear(x, t, &self.q_proj); // [T, nh·2hd]
        let mut k = linear(x, t, &self.k_proj); // [T, nkv·hd]
        let v = linear(x, t, &self.v_proj); // [T, nkv·hd]
        let mut q = vec![0f32; t * nh * hd];
        let mut gate = vec![0f32; t * nh * hd];
        for i in 0..t {
            for h in 0..nh {
                let src = &qg[(i * nh + h) * 2 * hd..(i * nh + h + 1) * 2 * hd];
                q[(i * nh + h) * hd..(i * nh + h + 1) * hd].copy_from_slice(&src[..hd]);
                gate[(i * nh + h) * hd..(i * nh + h + 1) * hd].copy_from_slice(&src[hd..]);
            }
        }
        // 2. Per-head q/k norms, then rotary on the first rot dims.
        rms_norm_1p(&mut q, &self.q_norm, self.eps);
        rms_norm_1p(&mut k, &self.k_norm, self.eps);
        for i in 0..t {
            let (c, s) = rope.row(i);
            rot.apply(&mut q[i * nh * hd..(i + 1) * nh * hd], c, s);
            rot.apply(&mut k[i * nkv * hd..(i + 1) * nkv * hd], c, s);
        }
        // 3. Write into each sequence's pages and attend through its page table.
        let mut attn = vec![0f32; t * nh * hd];
        let kv_row = nkv * hd;
        for (seg, table) in segs.iter().zip(tables.iter_mut()) {
            let rows = seg.row..seg.row + seg.len;
            table.write(
                kv_layer,
                seg.past,
                &k[rows.start * kv_row..rows.end * kv_row],
                &v[rows.start * kv_row..rows.end * kv_row],
            );
            let (kp, vp) = table.planes(kv_layer);
            let paged = PagedKv { k: &kp, v: &vp, page: table.geometry().page_size };
            causal_attention_paged(
                &q[rows.start * nh * hd..rows.end * nh * hd],
                paged,
                seg.past,
                self.shape,
                (hd as f32).powf(-0.5),
                &mut attn[rows.start * nh * hd..rows.end * nh * hd],
            );
        }
        // 4. Output gate and projection.
        for (a, g) in attn.iter_mut().zip(&gate) {
            *a *= sigmoid(*g);
        }
        linear(&attn, t, &self.o_proj)
    }

    /// Bytes of weights.
    pub fn bytes(&self) -> usize {
        self.q_proj.bytes() + self.k_proj.bytes() + self.v_proj.bytes() + self.o_proj.bytes()
    }
}
