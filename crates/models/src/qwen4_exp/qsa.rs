//! The QSA indexer (`Qwen4ExpTextQSAIndexer`): which earlier tokens each query of an indexed-attention
//! layer may attend to. Each token gives one raw key; every complete block of `ratio` tokens is pooled
//! (mean of its raw keys), normalised and roped at the block's first position. A query (its own heads,
//! normalised and roped at its position) scores each complete block it can see as
//! `Σ_heads relu(q_h · k_b) / √d`, keeps the `top_blocks` best and the tokens of its incomplete tail
//! block, and attends only to those (causal within them).
//!
//! A sequence keeps its blocks' keys as they complete and the raw keys of its incomplete block, so a
//! chunked prefill selects exactly what a one-shot one does. All of it stays on the backend: the keys,
//! the scores and the selected blocks (`qsa_select` → `attention_selected`); the host only knows how many
//! blocks there are, which follows from the token count.

use osprey_backend::{Backend, HostTensor, MRope, RopeTable, Tensor};

use super::params::Qsa;
use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::layers::{load_linear, load_vector, Segment};

/// A sequence's indexer keys for one layer, on the backend.
#[derive(Clone, Debug, Default)]
pub(crate) struct IndexerState {
    /// Complete blocks' keys, normalised and roped, `[capacity, d]` (the first `blocks` rows are set).
    keys: Option<Tensor>,
    blocks: usize,
    /// Raw keys of the incomplete block, `[ratio, d]` (the first `tail` rows are set).
    tail_keys: Option<Tensor>,
    tail: usize,
}

/// [`IndexerState`] in host memory (a snapshot's).
#[derive(Clone, Debug)]
pub(crate) struct HostIndexerState {
    keys: Option<HostTensor>,
    blocks: usize,
    tail_keys: Option<HostTensor>,
    tail: usize,
}

impl IndexerState {
    pub(crate) fn bytes(&self) -> usize {
        self.keys.as_ref().map_or(0, Tensor::bytes) + self.tail_keys.as_ref().map_or(0, Tensor::bytes)
    }

    /// A host copy.
    pub(crate) fn to_host(&self, b: &dyn Backend) -> Result<HostIndexerState> {
        Ok(HostIndexerState {
            keys: self.keys.as_ref().map(|t| b.download_host(t)).transpose()?,
            blocks: self.blocks,
            tail_keys: self.tail_keys.as_ref().map(|t| b.download_host(t)).transpose()?,
            tail: self.tail,
        })
    }

    /// Replaces the state with a host copy's.
    pub(crate) fn restore(&mut self, h: &HostIndexerState, b: &dyn Backend) -> Result<()> {
        self.keys = h.keys.as_ref().map(|t| b.upload_host(t)).transpose()?;
        self.tail_keys = h.tail_keys.as_ref().map(|t| b.upload_host(t)).transpose()?;
        (self.blocks, self.tail) = (h.blocks, h.tail);
        Ok(())
    }
}

impl HostIndexerState {
    pub(crate) fn bytes(&self) -> usize {
        self.keys.as_ref().map_or(0, HostTensor::bytes) + self.tail_keys.as_ref().map_or(0, HostTensor::bytes)
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

    /// For each segment, its rows' selected blocks (`[seg.len, top_blocks]` i32 on the backend, for
    /// `attention_selected`). `x` is the block input `[n, hidden]`, `rope` the batch's rotary table,
    /// `positions` each segment's whole position history (past and new rows).
    pub(crate) fn select(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        segs: &[Segment],
        rope: &RopeTable,
        positions: &[&[[i64; 3]]],
        states: &mut [&mut IndexerState],
    ) -> Result<Vec<Tensor>> {
        let (d, heads) = (self.g.head_dim, self.g.heads);
        let qk = b.linear(x, &self.qk)?;
        let mut parts = b.split_cols(&qk, 1, &[heads * d, d])?.into_iter();
        let (mut q, raw) = (parts.next().expect("q"), parts.next().expect("k"));
        b.rms_norm(&mut q, &self.q_norm, self.eps, true);
        b.rope(&mut q, &self.rope, rope);
        let scale = 1.0 / (d as f32).sqrt();
        let mut out = Vec::with_capacity(segs.len());
        for ((seg, st), pos) in segs.iter().zip(states.iter_mut()).zip(positions) {
            self.absorb(b, &raw, seg, pos, st)?;
            let keys = st.keys.as_ref().expect("absorb allocates the keys");
            let (past, ratio, top) = (seg.past, self.g.ratio, self.g.top_blocks);
            let rows = seg.row..seg.row + seg.len;
            out.push(b.qsa_select(&q, rows, keys, past, ratio, top, heads, scale)?);
        }
        Ok(out)
    }

    /// Feeds a segment's raw keys into its state: every block they complete gets its key (mean of its
    /// raw keys, normalised, roped at its first position), the rest wait in the tail.
    fn absorb(
        &self,
        b: &dyn Backend,
        raw: &Tensor,
        seg: &Segment,
        pos: &[[i64; 3]],
        st: &mut IndexerState,
    ) -> Result<()> {
        let (d, ratio) = (self.g.head_dim, self.g.ratio);
        let complete_after = (seg.past + seg.len) / ratio;
        let capacity = st.keys.as_ref().map_or(0, Tensor::rows);
        if st.keys.is_none() || complete_after > capacity {
            let mut grown = b.zeros_f32(&[complete_after.max(2 * capacity).max(16), d])?;
            if let Some(old) = &st.keys {
                b.write_rows(&mut grown, 0, old, 0..st.blocks);
            }
            st.keys = Some(grown);
        }
        let tail = match &mut st.tail_keys {
            Some(t) => t,
            None => st.tail_keys.insert(b.zeros_f32(&[ratio, d])?),
        };
        let keys = st.keys.as_mut().expect("allocated above");
        let mut j = 0;
        while j < seg.len {
            let take = (ratio - st.tail).min(seg.len - j);
            let r0 = seg.row + j;
            b.write_rows(tail, st.tail * d, raw, r0..r0 + take);
            st.tail += take;
            j += take;
            if st.tail == ratio {
                let first = seg.past + j - ratio;
                let mut k = b.mean_rows(tail, 0..ratio)?;
                b.rms_norm(&mut k, &self.k_norm, self.eps, true);
                let table = b.rope_table(&self.rope, &[pos[first]])?;
                b.rope(&mut k, &self.rope, &table);
                b.write_rows(keys, st.blocks * d, &k, 0..1);
                st.blocks += 1;
                st.tail = 0;
            }
        }
        Ok(())
    }

    /// Tokens per block.
    pub(crate) fn ratio(&self) -> usize {
        self.g.ratio
    }

    /// Bytes of weights.
    pub(crate) fn bytes(&self) -> usize {
        self.qk.bytes() + self.q_norm.bytes() + self.k_norm.bytes()
    }
}
