//! The QSA indexer (`Qwen4ExpTextQSAIndexer`): which earlier tokens each query of an indexed-attention
//! layer may attend to. Each token gives one raw key; every complete block of `ratio` tokens is pooled
//! (mean of its raw keys), normalised and roped at the block's first position. A query (its own heads,
//! normalised and roped at its position) scores each complete block it can see as
//! `Σ_heads relu(q_h · k_b) / √d`, keeps the `top_blocks` best and the tokens of its incomplete tail
//! block, and attends only to those (causal within them).
//!
//! A sequence keeps its blocks' keys as they complete and the raw keys of its incomplete block, so a
//! chunked prefill selects exactly what a one-shot one does.

use osprey_backend::{Backend, MRope, RopeTable, Tensor};

use super::params::Qsa;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::layers::{load_linear, load_vector, Segment};

/// A sequence's indexer keys for one layer.
#[derive(Clone, Debug, Default)]
pub(crate) struct IndexerState {
    /// Complete blocks' keys, normalised and roped, `[blocks · d]`.
    blocks: Vec<f32>,
    /// Raw keys of the incomplete block, `[< ratio · d]`.
    tail: Vec<f32>,
}

impl IndexerState {
    pub(crate) fn bytes(&self) -> usize {
        4 * (self.blocks.len() + self.tail.len())
    }
}

#[derive(Debug)]
pub(crate) struct Indexer {
    qk: Tensor,
    q_norm: Tensor,
    k_norm: Tensor,
    rope: MRope,
    g: Qsa,
    eps: f32,
}

impl Indexer {
    /// Loads `{prefix}.indexer` (`index_qk_proj`, `q_layernorm`, `k_layernorm`); `rot` is the decoder's
    /// rotary (its rotary dims and sections apply to the indexer's heads).
    pub(crate) fn load(
        b: &dyn Backend,
        ck: &Checkpoint,
        prefix: &str,
        g: Qsa,
        hidden: usize,
        rot: &MRope,
        eps: f32,
    ) -> Result<Self> {
        let d = g.head_dim;
        Ok(Indexer {
            qk: load_linear(b, ck, &format!("{prefix}.index_qk_proj"), (g.heads + 1) * d, hidden)?,
            q_norm: load_vector(b, ck, &format!("{prefix}.q_layernorm.weight"), d)?,
            k_norm: load_vector(b, ck, &format!("{prefix}.k_layernorm.weight"), d)?,
            rope: rot.with_head_dim(d),
            g,
            eps,
        })
    }

    /// For each segment and each of its rows, the key positions the row's query may attend to
    /// (ascending). `x` is the block input `[n, hidden]`, `rope` the batch's rotary table, `positions`
    /// each segment's whole position history (past and new rows).
    pub(crate) fn select(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        segs: &[Segment],
        rope: &RopeTable,
        positions: &[&[[i64; 3]]],
        states: &mut [&mut IndexerState],
    ) -> Result<Vec<Vec<Vec<usize>>>> {
        let (d, heads, ratio) = (self.g.head_dim, self.g.heads, self.g.ratio);
        let qk = b.linear(x, &self.qk)?;
        let mut parts = b.split_cols(&qk, 1, &[heads * d, d])?.into_iter();
        let (mut q, raw) = (parts.next().expect("q"), parts.next().expect("k"));
        b.rms_norm(&mut q, &self.q_norm, self.eps, true);
        b.rope(&mut q, &self.rope, rope);
        let (q, raw) = (b.download_f32(&q)?, b.download_f32(&raw)?);
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = Vec::with_capacity(segs.len());
        for ((seg, st), pos) in segs.iter().zip(states.iter_mut()).zip(positions) {
            let mut rows = Vec::with_capacity(seg.len);
            for j in 0..seg.len {
                let (r, p) = (seg.row + j, seg.past + j);
                st.tail.extend_from_slice(&raw[r * d..(r + 1) * d]);
                if st.tail.len() == ratio * d {
                    let start = p + 1 - ratio;
                    let key = self.block_key(b, &st.tail, pos[start])?;
                    st.blocks.extend_from_slice(&key);
                    st.tail.clear();
                }
                let complete = st.blocks.len() / d;
                let qr = &q[r * heads * d..(r + 1) * heads * d];
                let mut scored: Vec<(f32, usize)> = (0..complete)
                    .map(|blk| {
                        let kb = &st.blocks[blk * d..(blk + 1) * d];
                        let s: f32 =
                            qr.chunks(d).map(|qh| qh.iter().zip(kb).map(|(a, b)| a * b).sum::<f32>().max(0.0)).sum();
                        (s * scale, blk)
                    })
                    .collect();
                // Best first; equal scores keep the lower block first.
                scored.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
                let mut keep: Vec<usize> = scored.iter().take(self.g.top_blocks).map(|&(_, blk)| blk).collect();
                keep.sort_unstable();
                let mut sel: Vec<usize> = keep.iter().flat_map(|&blk| blk * ratio..(blk + 1) * ratio).collect();
                sel.extend(complete * ratio..=p);
                rows.push(sel);
            }
            out.push(rows);
        }
        Ok(out)
    }

    /// A complete block's key: the mean of its raw keys, normalised, roped at its first position.
    fn block_key(&self, b: &dyn Backend, raw: &[f32], first: [i64; 3]) -> Result<Vec<f32>> {
        let d = self.g.head_dim;
        let n = raw.len() / d;
        let mean: Vec<f32> = (0..d).map(|c| (0..n).map(|t| raw[t * d + c]).sum::<f32>() / n as f32).collect();
        let mut k = b.upload_f32(&mean, &[1, d])?;
        b.rms_norm(&mut k, &self.k_norm, self.eps, true);
        let table = b.rope_table(&self.rope, &[first])?;
        b.rope(&mut k, &self.rope, &table);
        Ok(b.download_f32(&k)?)
    }

    /// Bytes of weights.
    pub(crate) fn bytes(&self) -> usize {
        self.qk.bytes() + self.q_norm.bytes() + self.k_norm.bytes()
    }
}
