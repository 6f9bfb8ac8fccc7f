//! Per-sequence decoder state behind the family seam: the token count, the mRoPE delta, the KV page table
//! (every full-attention layer's rows, [`crate::kv`]) and the family's own state ([`FamilyState`]: for
//! Qwen3.5 the Gated DeltaNet conv + fp32 recurrent states; `qwen4_exp` adds its PLE conv state, n-gram
//! history and indexer keys), which the runtime snapshots and restores without knowing its type.
//!
//! Invariant: `len` tokens have been fed; the page table covers at least `len` slots and rows `[0, len)`
//! are written; the family state is the state after token `len - 1`. A [`StateSnapshot`] holds only what
//! cannot be recovered from KV pages (the family's snapshot, plus `len` and the rope delta), in host
//! memory: taking one downloads the family's device tensors and restoring uploads them, so a prefix cache
//! full of snapshots fills RAM, not the device. On a device the downloads may be asynchronous (into pinned
//! host memory), so a snapshot carries the fence recorded after them and restoring waits for it before
//! it reads the host copy. The KV pages `[..len]` are kept by whoever holds them
//! (this state, or the prefix cache).

use std::any::Any;
use std::fmt::Debug;

use osprey_backend::{Backend, Fence};

use crate::error::{Error, Result};
use crate::kv::{PageRef, PageTable};

/// A family's own per-sequence state (everything but the KV pages).
pub trait FamilyState: Any + Send + Sync + Debug {
    /// Bytes held.
    fn bytes(&self) -> usize;
    /// What a resumed sequence needs from this state, taken now into host memory (its tensors
    /// downloaded from `b`).
    fn snapshot(&self, b: &dyn Backend) -> Result<Box<dyn FamilySnapshot>>;
    /// Replaces the state with a snapshot's (one this family made), its tensors uploaded to `b`.
    fn restore(&mut self, snap: &dyn FamilySnapshot, b: &dyn Backend) -> Result<()>;
    /// A copy.
    fn boxed_clone(&self) -> Box<dyn FamilyState>;
    /// Cuts the state back to after the first `keep` tokens of the last forward, which was a
    /// verification ([`crate::ForwardOptions::verify`]) that kept the state after each of its tokens.
    fn rewind(&mut self, keep: usize) -> Result<()> {
        let _ = keep;
        Err(Error::Unsupported("this model family cannot rewind a verification".into()))
    }
}

/// A family's snapshot of its [`FamilyState`], in host memory.
pub trait FamilySnapshot: Any + Send + Sync + Debug {
    /// Host bytes held (what a prefix cache charges for it).
    fn bytes(&self) -> usize;
}

/// Everything one sequence carries between forwards.
#[derive(Debug)]
pub struct SeqState {
    pub(crate) len: usize,
    /// mRoPE delta: text position of the token at index `t` is `t + rope_delta` on all three axes
    /// (0 for text-only prompts; negative after images, which advance positions by less than their length).
    pub rope_delta: i64,
    pub(crate) kv: PageTable,
    pub(crate) family: Box<dyn FamilyState>,
}

impl Clone for SeqState {
    fn clone(&self) -> Self {
        SeqState { len: self.len, rope_delta: self.rope_delta, kv: self.kv.clone(), family: self.family.boxed_clone() }
    }
}

/// The part of a [`SeqState`] that cannot be rebuilt from KV pages: taken at a token boundary.
#[derive(Debug)]
pub struct StateSnapshot {
    /// Tokens fed when the snapshot was taken.
    pub len: usize,
    /// mRoPE delta at that point.
    pub rope_delta: i64,
    family: Box<dyn FamilySnapshot>,
    /// Recorded after the downloads: the host copy may be read once it has completed.
    fence: Fence,
}

impl StateSnapshot {
    /// Host bytes held (what a prefix cache charges for it).
    pub fn bytes(&self) -> usize {
        self.family.bytes()
    }
}

impl SeqState {
    /// A fresh state of a family (its own state, and the KV page table it writes).
    pub fn new(family: Box<dyn FamilyState>, kv: PageTable) -> Self {
        SeqState { len: 0, rope_delta: 0, kv, family }
    }

    /// The family's state, when it is of type `T`.
    pub fn family<T: FamilyState>(&self) -> Option<&T> {
        let any: &dyn Any = self.family.as_ref();
        any.downcast_ref()
    }

    /// Tokens fed so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been fed.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held by the family state and KV pages (shared pages counted in full).
    pub fn bytes(&self) -> usize {
        self.family.bytes() + self.kv.pages().len() * self.kv.geometry().bytes()
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
    /// snapshot taken right after them (uploaded to `b`).
    pub fn restore_prefix(&mut self, pages: &[&PageRef], snap: &StateSnapshot, b: &dyn Backend) -> Result<()> {
        let ps = self.kv.geometry().page_size;
        if self.len != 0 || pages.len() * ps != snap.len {
            return Err(Error::Engine(format!(
                "prefix of {} pages does not match a snapshot at {}",
                pages.len(),
                snap.len
            )));
        }
        self.kv.share(pages).map_err(|e| Error::Engine(format!("page from another model: {e}")))?;
        self.len = snap.len;
        self.restore(snap, b)
    }

    /// Copies what cannot be recovered from KV pages, at the current length, into host memory.
    pub fn snapshot(&self, b: &dyn Backend) -> Result<StateSnapshot> {
        let family = self.family.snapshot(b)?;
        Ok(StateSnapshot { len: self.len, rope_delta: self.rope_delta, family, fence: b.record_fence() })
    }

    /// Cuts a state that has just run a verification of `n` tokens back to `len` tokens (between the
    /// length before it, exclusive, and after it): the recurrent state after the accepted tokens, the KV
    /// pages cut to `len` slots (rows past it are rewritten by the next forward).
    pub fn rewind(&mut self, len: usize, n: usize) -> Result<()> {
        let before = self.len.checked_sub(n).filter(|&b| b < len && len <= self.len);
        let Some(before) = before else {
            return Err(Error::Engine(format!("rewind to {len} of a verification ending at {}", self.len)));
        };
        self.family.rewind(len - before)?;
        self.kv.truncate(len);
        self.len = len;
        Ok(())
    }

    /// Rewinds to `snap`: the page table is cut to `snap.len` slots and the family state replaced. The KV rows
    /// `[..snap.len]` must be the ones the snapshot was taken over, so this state must descend from the
    /// snapshot's sequence (same prefix) and be at least as long.
    pub fn restore(&mut self, snap: &StateSnapshot, b: &dyn Backend) -> Result<()> {
        if snap.len > self.len {
            return Err(Error::Engine(format!(
                "snapshot at {} tokens is ahead of the state ({} tokens)",
                snap.len, self.len
            )));
        }
        // The copies into host memory must have landed before the host copy is read.
        b.wait_fence(snap.fence)?;
        self.family.restore(snap.family.as_ref(), b)?;
        self.kv.truncate(snap.len);
        self.len = snap.len;
        self.rope_delta = snap.rope_delta;
        Ok(())
    }
}
