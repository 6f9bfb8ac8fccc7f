//! Per-sequence decoder state: a page table of KV rows for the full-attention layers ([`crate::kv`]), conv
//! + fp32 recurrent state for Gated DeltaNet layers, the token count and the mRoPE delta.
//!
//! Invariant: `len` tokens have been fed; the page table covers at least `len` slots and rows `[0, len)`
//! are written; every linear state is the state after token `len - 1`. A [`StateSnapshot`] holds only what
//! cannot be recovered from KV pages: the linear states (they cannot be rewound) plus `len` and the rope
//! delta; the KV pages `[..len]` are kept by whoever holds them (this state, or the prefix cache).

use crate::error::{Error, Result};
use crate::kv::{PageRef, PageTable};

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
    /// A full-attention layer: its rows are plane `kv_layer` of the page table.
    Full {
        kv_layer: usize,
    },
}

/// Everything one sequence carries between forwards.
#[derive(Clone, Debug)]
pub struct SeqState {
    pub(crate) len: usize,
    /// mRoPE delta: text position of the token at index `t` is `t + rope_delta` on all three axes
    /// (0 for text-only prompts; negative after images, which advance positions by less than their length).
    pub rope_delta: i64,
    pub(crate) layers: Vec<LayerState>,
    pub(crate) kv: PageTable,
}

/// The part of a [`SeqState`] that cannot be rebuilt from KV pages: taken at a token boundary.
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
    pub(crate) fn new(layers: Vec<LayerState>, kv: PageTable) -> Self {
        SeqState { len: 0, rope_delta: 0, layers, kv }
    }

    /// Tokens fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by linear states and KV pages (shared pages counted in full).
    pub fn bytes(&self) -> usize {
        let linear: usize = self
            .layers
            .iter()
            .map(|l| match l {
                LayerState::Linear(s) => (s.conv.len() + s.recurrent.len()) * 4,
                LayerState::Full { .. } => 0,
            })
            .sum();
        linear + self.kv.pages().len() * self.kv.geometry().bytes()
    }

    /// The KV page table.
    pub fn pages(&self) -> &PageTable {
        &self.kv
    }

    /// The KV page table, for a pool to reserve pages in before a forward.
    pub fn pages_mut(&mut self) -> &mut PageTable {
        &mut self.kv
    }

    /// Page `i` (tokens `[i·page_size, (i+1)·page_size)`), once full: what the prefix cache stores.
    pub fn full_page(&self, i: usize) -> PageRef {
        let ps = self.kv.geometry().page_size;
        assert!((i + 1) * ps <= self.len, "page {i} is not full: this is a bug");
        self.kv.pages()[i].clone()
    }

    /// Rebuilds a fresh state from cached pages (in order, from token 0; shared, not copied) and the
    /// snapshot taken right after them.
    pub fn restore_prefix(&mut self, pages: &[&PageRef], snap: &StateSnapshot) -> Result<()> {
        let ps = self.kv.geometry().page_size;
        if self.len != 0 || pages.len() * ps != snap.len {
            return Err(Error::InvalidInput(format!(
                "prefix of {} pages does not match a snapshot at {}",
                pages.len(),
                snap.len
            )));
        }
        self.kv.share(pages).map_err(|e| Error::InvalidInput(format!("page from another model: {e}")))?;
        self.len = snap.len;
        self.restore(snap)
    }

    /// Copies the linear states at the current length.
    pub fn snapshot(&self) -> StateSnapshot {
        let linear = self
            .layers
            .iter()
            .filter_map(|l| match l {
                LayerState::Linear(s) => Some(s.clone()),
                LayerState::Full { .. } => None,
            })
            .collect();
        StateSnapshot { len: self.len, rope_delta: self.rope_delta, linear }
    }

    /// Rewinds to `snap`: the page table is cut to `snap.len` slots and linear states replaced. The KV rows
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
            if let LayerState::Linear(s) = l {
                if let Some(src) = lin.next() {
                    s.clone_from(src);
                }
            }
        }
        self.kv.truncate(snap.len);
        self.len = snap.len;
        self.rope_delta = snap.rope_delta;
        Ok(())
    }
}
