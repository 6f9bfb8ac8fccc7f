//! Per-sequence decoder state: paged-later KV for full-attention layers, conv + fp32 recurrent state for
//! Gated DeltaNet layers, the token count and the mRoPE delta.
//!
//! Invariant: `len` tokens have been fed; every KV cache holds exactly `len` rows; every linear state is
//! the state after token `len - 1`. A [`StateSnapshot`] holds only what cannot be recomputed by slicing:
//! the linear states (they cannot be rewound) plus `len` and the rope delta; KV rows `[..len]` are kept by
//! whoever owns them (this state, or later the prefix cache's pages).

use crate::error::{Error, Result};

/// KV rows of one full-attention layer, `[len, kv_heads, head_dim]` each.
#[derive(Clone, Debug, Default)]
pub struct KvCache {
    pub(crate) k: Vec<f32>,
    pub(crate) v: Vec<f32>,
}

/// Conv + recurrent state of one Gated DeltaNet layer.
#[derive(Clone, Debug, PartialEq)]
pub struct LinearState {
    /// The last `kernel - 1` pre-conv inputs `[kernel-1, conv_dim]`, oldest first.
    pub(crate) conv: Vec<f32>,
    /// `[nv, dk, dv]` in f32.
    pub(crate) recurrent: Vec<f32>,
}

#[derive(Clone, Debug)]
pub(crate) enum LayerState {
    Linear(LinearState),
    Full(KvCache),
}

/// Everything one sequence carries between forwards.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub(crate) len: usize,
    /// mRoPE delta: text position of the token at index `t` is `t + rope_delta` on all three axes
    /// (0 for text-only prompts; negative after images, which advance positions by less than their length).
    pub rope_delta: i64,
    pub(crate) layers: Vec<LayerState>,
}

/// KV rows `[start, end)` of every full-attention layer: one page of the prefix cache.
#[derive(Clone, Debug, PartialEq)]
pub struct KvBlock {
    tokens: usize,
    /// Per full-attention layer: (K rows, V rows), each `[tokens, kv_heads·head_dim]`.
    kv: Vec<(Vec<f32>, Vec<f32>)>,
}

impl KvBlock {
    /// Tokens in the block.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.kv.iter().map(|(k, v)| (k.len() + v.len()) * 4).sum()
    }
}

/// The part of a [`SeqState`] that cannot be rebuilt from KV rows: taken at a token boundary.
#[derive(Clone, Debug, PartialEq)]
pub struct StateSnapshot {
    /// Tokens fed when the snapshot was taken.
    pub len: usize,
    /// mRoPE delta at that point.
    pub rope_delta: i64,
    linear: Vec<LinearState>,
}

impl StateSnapshot {
    /// Bytes held (what a prefix cache charges for it).
    pub fn bytes(&self) -> usize {
        self.linear.iter().map(|l| (l.conv.len() + l.recurrent.len()) * 4).sum()
    }
}

impl SeqState {
    pub(crate) fn new(layers: Vec<LayerState>) -> Self {
        SeqState { len: 0, rope_delta: 0, layers }
    }

    /// Tokens fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by KV and linear states.
    pub fn bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => (s.conv.len() + s.recurrent.len()) * 4,
                LayerState::Full(kv) => (kv.k.len() + kv.v.len()) * 4,
            })
            .sum()
    }

    /// KV rows `[start, end)` of every full-attention layer (a prefix-cache page).
    pub fn kv_block(&self, start: usize, end: usize) -> KvBlock {
        assert!(start <= end && end <= self.len, "kv_block range: this is a bug");
        let kv = self
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Full(c) => {
                    let row = c.k.len() / self.len.max(1);
                    Some((c.k[start * row..end * row].to_vec(), c.v[start * row..end * row].to_vec()))
                }
                LayerState::Linear(_) => None,
            })
            .collect();
        KvBlock { tokens: end - start, kv }
    }

    /// Rebuilds a fresh state from cached pages (in order, from token 0) and the snapshot taken right
    /// after them: KV rows are copied in, linear states replaced, the length set.
    pub fn restore_prefix(&mut self, blocks: &[&KvBlock], snap: &StateSnapshot) -> Result<()> {
        let total: usize = blocks.iter().map(|b| b.tokens).sum();
        if self.len != 0 || total != snap.len {
            return Err(Error::InvalidInput(format!(
                "prefix of {total} tokens does not match a snapshot at {}",
                snap.len
            )));
        }
        let mut full = 0;
        for l in &mut self.layers {
            if let LayerState::Full(c) = l {
                for b in blocks {
                    let (k, v) = b.kv.get(full).ok_or_else(|| Error::InvalidInput("page from another model".into()))?;
                    c.k.extend_from_slice(k);
                    c.v.extend_from_slice(v);
                }
                full += 1;
            }
        }
        self.len = total;
        self.restore(snap)
    }

    /// Copies the linear states at the current length.
    pub fn snapshot(&self) -> StateSnapshot {
        let linear = self
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Linear(s) => Some(s.clone()),
                LayerState::Full(_) => None,
            })
            .collect();
        StateSnapshot { len: self.len, rope_delta: self.rope_delta, linear }
    }

    /// Rewinds to `snap`: KV caches are cut to `snap.len` rows and linear states replaced. The KV rows
    /// `[..snap.len]` must be the ones the snapshot was taken over, so this state must descend from the
    /// snapshot's sequence (same prefix) and be at least as long.
    pub fn restore(&mut self, snap: &StateSnapshot) -> Result<()> {
        if snap.len > self.len {
            return Err(Error::InvalidInput(format!(
                "snapshot at {} tokens is ahead of the state ({} tokens)",
                snap.len, self.len
            )));
        }
        let n_linear = self.layers.iter().filter(|l| matches!(l, LayerState::Linear(_))).count();
        if n_linear != snap.linear.len() {
            return Err(Error::InvalidInput("snapshot belongs to another model".into()));
        }
        let mut lin = snap.linear.iter();
        for l in &mut self.layers {
            match l {
                LayerState::Linear(s) => {
                    if let Some(src) = lin.next() {
                        s.clone_from(src);
                    }
                }
                LayerState::Full(kv) => {
                    let row = kv.k.len() / self.len.max(1);
                    kv.k.truncate(snap.len * row);
                    kv.v.truncate(snap.len * row);
                }
            }
        }
        self.len = snap.len;
        self.rope_delta = snap.rope_delta;
        Ok(())
    }
}
