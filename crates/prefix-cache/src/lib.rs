//! # osprey-prefix-cache — the prefix-cache actor
//!
//! Brief overview: owns a [`RadixTree`] of KV pages keyed by `cache_ids` (token ids, with media
//! placeholders replaced by content-hash ids) plus recurrent-state snapshots. Accepts one batched
//! [`PrefixCommand::Step`] per scheduler step (inserts, pages reclaimed for the KV pool, then matches) and
//! emits [`PrefixMatch`]es: cached length, opaque pages (shared with the runner's pool), the snapshot, and
//! a pin ([`PrefixPin`], an RAII guard whose last clone sends `Release` back here). Runs on its own thread.

mod tree;

use std::thread;

use osprey_protocol::prefix::{PrefixCommand, PrefixMatch, PrefixPin, PrefixStats};
use osprey_protocol::Opaque;
use tokio::sync::mpsc;

pub use tree::{Bytes, Hit, RadixTree, TreeStats};

/// Starts the prefix-cache thread: pages of `page_size` tokens, at most `budget_bytes` unpinned.
pub fn spawn(page_size: usize, budget_bytes: usize) -> mpsc::UnboundedSender<PrefixCommand> {
    let (tx, mut rx) = mpsc::unbounded_channel::<PrefixCommand>();
    let weak = tx.downgrade();
    thread::Builder::new()
        .name("osprey-prefix-cache".into())
        .spawn(move || {
            let mut tree: RadixTree<dyn Opaque, dyn Opaque> = RadixTree::new(page_size, budget_bytes);
            // Pins send their release here; the actor keeps only a weak sender so that it still stops
            // when every outside handle is gone.
            let inbox = weak;
            while let Some(cmd) = rx.blocking_recv() {
                match cmd {
                    PrefixCommand::Release { lease } => tree.release(lease),
                    PrefixCommand::Step { matches, inserts, reclaim_pages, reply } => {
                        for ins in inserts {
                            tree.insert(&ins.cache_ids, &ins.pages, ins.snapshot);
                        }
                        if reclaim_pages > 0 {
                            let dropped = tree.reclaim(reclaim_pages);
                            tracing::debug!(asked = reclaim_pages, dropped, "prefix cache gave KV pages back");
                        }
                        let out = matches
                            .into_iter()
                            .map(|m| {
                                let h = if m.resumed {
                                    tree.rematch_prefix(&m.cache_ids, m.cap)
                                } else {
                                    tree.match_prefix(&m.cache_ids, m.cap)
                                };
                                PrefixMatch {
                                    seq: m.seq,
                                    cached_tokens: h.tokens,
                                    pages: h.pages,
                                    snapshot: h.snapshot,
                                    lease: h.lease.map(|l| PrefixPin::new(l, inbox.upgrade())),
                                }
                            })
                            .collect();
                        let _ = reply.send(out);
                    }
                    PrefixCommand::Stats { reply } => {
                        let s = tree.stats();
                        let _ = reply.send(PrefixStats {
                            lookups: s.lookups,
                            hits: s.hits,
                            cached_tokens: s.cached_tokens,
                            evictions: s.evictions,
                            resumed: s.resumed,
                            bytes: tree.used() as u64,
                            device_bytes: tree.device_bytes() as u64,
                            host_bytes: tree.host_bytes() as u64,
                            budget: tree.budget() as u64,
                            nodes: tree.len() as u64,
                            snapshots: tree.snapshots() as u64,
                        });
                    }
                }
            }
        })
        .expect("spawn prefix-cache thread");
    tx
}
