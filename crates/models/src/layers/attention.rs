//! Gated full attention (Qwen3.5 `self_attn`): q_proj yields `[q_h | gate_h]` interleaved per head,
//! q/k get a zero-centred RMSNorm per head, partial mRoPE, GQA causal attention over the sequence's KV,
//! then `o_proj(attn · sigmoid(gate))`.

use osprey_backend::{AttnShape, Backend, MRope, RopeTable, Tensor};

use super::{load_linear, load_vector, Segment};
use crate::checkpoint::Checkpoint;
use crate::config::TextConfig;
use crate::error::Result;
use crate::kv::PageTable;

/// One gated full-attention layer.
#[derive(Debug)]
pub struct GatedAttention {
    q_proj: Tensor,
    k_proj: Tensor,
    v_proj: Tensor,
    o_proj: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    shape: AttnShape,
    eps: f32,
}

impl GatedAttention {
    /// Loads `{prefix}.{q,k,v,o}_proj`, `q_norm`, `k_norm` onto `b`.
    pub fn load(b: &dyn Backend, ck: &Checkpoint, prefix: &str, cfg: &TextConfig) -> Result<Self> {
        let (h, nh, nkv, hd) = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim());
        let w = |n: &str, out: usize, inp: usize| load_linear(b, ck, &format!("{prefix}.{n}"), out, inp);
        Ok(GatedAttention {
            q_proj: w("q_proj", nh * hd * 2, h)?,
            k_proj: w("k_proj", nkv * hd, h)?,
            v_proj: w("v_proj", nkv * hd, h)?,
            o_proj: w("o_proj", h, nh * hd)?,
            q_norm: load_vector(b, ck, &format!("{prefix}.q_norm.weight"), hd)?,
            k_norm: load_vector(b, ck, &format!("{prefix}.k_norm.weight"), hd)?,
            shape: AttnShape { heads: nh, kv_heads: nkv, head_dim: hd },
            eps: cfg.rms_norm_eps as f32,
        })
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`, writing each segment's K/V into plane `kv_layer`
    /// of its page table (slots `[past, past + len)`, reserved by the caller) and attending through it.
    pub fn forward(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        segs: &[Segment],
        kv: (&mut [&mut PageTable], usize),
        rope: (&RopeTable, &MRope),
    ) -> Result<Tensor> {
        self.forward_selected(b, x, segs, kv, rope, None)
    }

    /// [`GatedAttention::forward`] where each query row attends only to QSA's selection (`selected`: per
    /// segment its rows' selected blocks on the backend, and the block size): those blocks and the row's
    /// own incomplete block; causally when `None`.
    pub fn forward_selected(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        segs: &[Segment],
        (tables, kv_layer): (&mut [&mut PageTable], usize),
        (rope, rot): (&RopeTable, &MRope),
        selected: Option<(&[Tensor], usize)>,
    ) -> Result<Tensor> {
        let AttnShape { heads: nh, head_dim: hd, .. } = self.shape;
        // 1. Projections. q_proj rows are [q_h (hd) | gate_h (hd)] per head.
        let qg = b.linear(x, &self.q_proj)?; // [T, nh·2hd]
        let mut k = b.linear(x, &self.k_proj)?; // [T, nkv·hd]
        let v = b.linear(x, &self.v_proj)?; // [T, nkv·hd]
        let mut parts = b.split_cols(&qg, nh, &[hd, hd])?.into_iter();
        let (mut q, gate) = (parts.next().expect("q"), parts.next().expect("gate"));
        // 2. Per-head q/k norms, then rotary on the first rot dims.
        b.rms_norm(&mut q, &self.q_norm, self.eps, true);
        b.rms_norm(&mut k, &self.k_norm, self.eps, true);
        b.rope(&mut q, rot, rope);
        b.rope(&mut k, rot, rope);
        // 3. Write into each sequence's pages and attend through its page table.
        let mut attn = b.zeros_f32(&[x.rows(), nh * hd])?;
        let scale = (hd as f32).powf(-0.5);
        for (si, (seg, table)) in segs.iter().zip(tables.iter_mut()).enumerate() {
            let rows = seg.row..seg.row + seg.len;
            table.write(b, kv_layer, seg.past, (&k, &v), rows.clone());
            table.attend(kv_layer, |view| match selected {
                Some((blocks, ratio)) => {
                    b.attention_selected(&q, rows, view, &blocks[si], (seg.past, ratio), self.shape, scale, &mut attn)
                }
                None => b.attention_paged(&q, rows, view, seg.past, self.shape, scale, &mut attn),
            });
        }
        // 4. Output gate and projection.
        b.sigmoid_mul(&mut attn, &gate);
        Ok(b.linear(&attn, &self.o_proj)?)
    }

    /// Bytes of weights.
    pub fn bytes(&self) -> usize {
        self.q_proj.bytes() + self.k_proj.bytes() + self.v_proj.bytes() + self.o_proj.bytes()
    }
}
