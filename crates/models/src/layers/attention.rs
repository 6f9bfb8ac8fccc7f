//! Gated full attention (Qwen3.5 `self_attn`): q_proj yields `[q_h | gate_h]` interleaved per head,
//! q/k get a zero-centred RMSNorm per head, partial mRoPE, GQA causal attention over the sequence's KV,
//! then `o_proj(attn · sigmoid(gate))`.

use osprey_backend::{AttnShape, Backend, MRope, PagedRows, PagedView, RopeTable, Tensor};

use super::{linears, load_linear, load_vector, Segment};
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
    /// of its page table (slots `[past, past + len)`, reserved by the caller) and attending through it;
    /// the segments of one store (a served batch) are written in one op and attend in one.
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
        // q|gate [T, nh·2hd], k and v [T, nkv·hd]: one pass over x on a device.
        let [qg, k, v] = linears(b, x, [&self.q_proj, &self.k_proj, &self.v_proj])?;
        let mut parts = b.split_cols(&qg, nh, &[hd, hd])?.into_iter();
        let (mut q, gate) = (parts.next().expect("q"), parts.next().expect("gate"));
        // 2. q's per-head norm and rotary on the first rot dims (one pass on a device).
        b.rms_norm_rope(&mut q, &self.q_norm, self.eps, true, rot, rope);
        // 3. The sequences' new K (normed and rotated on the way) and V into their pages, then attention
        //    through their page tables: each store's sequences (a served batch's, all) in one op each.
        let mut attn = b.zeros_f32(&[x.rows(), nh * hd])?;
        let scale = (hd as f32).powf(-0.5);
        let ps = tables.first().map_or(1, |t| t.geometry().page_size);
        let k_norm = (&self.k_norm, self.eps, true);
        crate::kv::by_store(tables, kv_layer, |pool, members| {
            let slots: Vec<(usize, usize)> = members
                .iter()
                .flat_map(|&i| {
                    tables[i].k_rows(segs[i].past, segs[i].len).enumerate().map(move |(j, r)| (segs[i].row + j, r))
                })
                .collect();
            b.write_kv(pool, &k, &v, &slots, ps, k_norm, (rot, rope))?;
            let view = |i: usize| PagedView { pool, table: tables[i].ids_on_backend(), page_size: ps };
            let rows = |i: usize| segs[i].row..segs[i].row + segs[i].len;
            match selected {
                Some((blocks, ratio)) => members.iter().for_each(|&i| {
                    let at = (segs[i].past, ratio);
                    b.attention_selected(&q, rows(i), view(i), &blocks[i], at, self.shape, scale, &mut attn)
                }),
                None => {
                    let seqs: Vec<PagedRows<'_>> =
                        members.iter().map(|&i| PagedRows { rows: rows(i), kv: view(i), past: segs[i].past }).collect();
                    b.attention_paged_rows(&q, &seqs, self.shape, scale, &mut attn);
                }
            }
            Ok(())
        })?;
        // 4. Output gate and projection.
        b.sigmoid_mul(&mut attn, &gate);
        Ok(b.linear(&attn, &self.o_proj)?)
    }

    /// Bytes of weights.
    pub fn bytes(&self) -> usize {
        self.q_proj.bytes() + self.k_proj.bytes() + self.v_proj.bytes() + self.o_proj.bytes()
    }
}
