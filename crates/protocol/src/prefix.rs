//! Messages to the prefix-cache actor: one batched exchange per scheduler step.

use std::sync::Arc;

use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::oneshot;

use crate::{Handle, SeqId};

/// The id of a pin on a matched path of the tree.
pub type LeaseId = u64;

/// A pin on a matched path of the tree (an RAII guard, like an expert lease): while any clone is alive the
/// path's pages and snapshot cannot be evicted; dropping the last clone sends a
/// [`PrefixCommand::Release`], which the cache handles in order, before the next step.
#[derive(Clone, Debug)]
pub struct PrefixPin(Arc<PinInner>);

#[derive(Debug)]
struct PinInner {
    lease: LeaseId,
    release: Option<UnboundedSender<PrefixCommand>>,
}

impl PrefixPin {
    /// A pin on lease `lease` that `release` (the cache's inbox) gets back; `None`: nothing to release.
    pub fn new(lease: LeaseId, release: Option<UnboundedSender<PrefixCommand>>) -> Self {
        PrefixPin(Arc::new(PinInner { lease, release }))
    }

    /// The lease id.
    pub fn lease(&self) -> LeaseId {
        self.0.lease
    }
}

impl Drop for PinInner {
    fn drop(&mut self) {
        if let Some(tx) = &self.release {
            // The cache may be gone (shutdown): then there is nothing left to unpin.
            let _ = tx.send(PrefixCommand::Release { lease: self.lease });
        }
    }
}

/// Look up the longest cached prefix of a new sequence.
#[derive(Clone, Debug)]
pub struct MatchRequest {
    /// The sequence (echoed in the answer).
    pub seq: SeqId,
    /// Its prompt's cache ids.
    pub cache_ids: Arc<Vec<u64>>,
    /// Longest usable hit (prompt length − 1: the last prompt token must be computed for its logits).
    pub cap: usize,
    /// A preempted sequence coming back: its hit recomputes what it had, and is not counted as reuse.
    pub resumed: bool,
}

/// The answer to a [`MatchRequest`] (opaque pages, never tree nodes).
#[derive(Clone, Debug)]
pub struct PrefixMatch {
    /// The sequence.
    pub seq: SeqId,
    /// Tokens served from the cache (a page multiple; 0 on a miss).
    pub cached_tokens: usize,
    /// KV pages covering `[0, cached_tokens)`.
    pub pages: Vec<Handle>,
    /// Recurrent state after `cached_tokens` tokens.
    pub snapshot: Option<Handle>,
    /// The pin; the path is unpinned when the last clone drops (the sequence ended).
    pub lease: Option<PrefixPin>,
}

/// Store the prefix `cache_ids` (a page multiple) with the state after it.
#[derive(Clone, Debug)]
pub struct InsertRequest {
    /// Cache ids of the prefix.
    pub cache_ids: Vec<u64>,
    /// Pages `(page index, rows)` the inserting sequence computed (the pages it matched are not sent).
    pub pages: Vec<(usize, Handle)>,
    /// Recurrent state after the prefix.
    pub snapshot: Handle,
}

/// Counters of the prefix cache.
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefixStats {
    /// Lookups.
    pub lookups: u64,
    /// Lookups that returned at least one page.
    pub hits: u64,
    /// Tokens served from the cache.
    pub cached_tokens: u64,
    /// Nodes evicted.
    pub evictions: u64,
    /// Matches of preempted sequences coming back (not in `lookups`, `hits` or `cached_tokens`).
    pub resumed: u64,
    /// Bytes held (pages + snapshots).
    pub bytes: u64,
    /// Of `bytes`, the KV pages (the KV pool's memory, on the compute device).
    pub device_bytes: u64,
    /// Of `bytes`, the recurrent-state snapshots (host memory).
    pub host_bytes: u64,
    /// Budget in bytes.
    pub budget: u64,
    /// Nodes in the tree.
    pub nodes: u64,
    /// Recurrent-state snapshots held (nodes with one).
    pub snapshots: u64,
}

/// Commands of the prefix-cache actor.
#[derive(Debug)]
pub enum PrefixCommand {
    /// A step's batch: inserts, then reclaim, then matches.
    Step {
        /// New sequences to match.
        matches: Vec<MatchRequest>,
        /// Prefixes to store.
        inserts: Vec<InsertRequest>,
        /// KV pages the pool needs back: evict this many unpinned pages (least recently used first)
        /// before matching.
        reclaim_pages: usize,
        /// One answer per match, in order.
        reply: oneshot::Sender<Vec<PrefixMatch>>,
    },
    /// A pin was dropped (sent by [`PrefixPin`]'s last clone).
    Release {
        /// Its lease.
        lease: LeaseId,
    },
    /// Counters.
    Stats {
        /// Counters.
        reply: oneshot::Sender<PrefixStats>,
    },
}
