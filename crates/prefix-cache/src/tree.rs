//! The radix tree core: a tree whose edges are pages of `page_size` cache ids, each node holding that
//! page's KV rows and optionally the recurrent-state snapshot taken right after it.
//!
//! Rules (each enforced here, in code):
//! - keys are `cache_ids`, not token ids: media placeholders carry content-hash ids, so a different image
//!   diverges at its first placeholder;
//! - a match is capped by the caller (prompt length − 1) and page-aligned, and is truncated to the
//!   deepest node that has a snapshot (Gated DeltaNet state cannot be rewound);
//! - a matched path is pinned (lock count) until its lease is released, so pages being copied into a
//!   sequence are never evicted under it; pages are immutable once inserted (never shared while written);
//! - eviction drops least-recently-used unlocked leaves until pages + snapshots fit the byte budget, and
//!   with them snapshots that have a deeper snapshot below them (a long conversation holds one every
//!   snapshot interval; its next turn needs the deepest, so the shallow ones go before its pages do).

use std::collections::HashMap;
use std::sync::Arc;

/// Anything with a size in bytes (pages, snapshots).
pub trait Bytes {
    /// Bytes held.
    fn bytes(&self) -> usize;
}

impl Bytes for dyn osprey_protocol::Opaque {
    fn bytes(&self) -> usize {
        osprey_protocol::Opaque::bytes(self)
    }
}

#[derive(Debug)]
struct Node<P: ?Sized, S: ?Sized> {
    parent: usize,
    key: Vec<u64>,
    children: HashMap<Vec<u64>, usize>,
    page: Option<Arc<P>>,
    snapshot: Option<Arc<S>>,
    lock: u32,
    last_use: u64,
}

/// A match: the pinned path and what it holds.
#[derive(Debug)]
pub struct Hit<P: ?Sized, S: ?Sized> {
    /// Tokens covered.
    pub tokens: usize,
    /// Pages from the root.
    pub pages: Vec<Arc<P>>,
    /// Snapshot after the last page.
    pub snapshot: Option<Arc<S>>,
    /// Lease id (None on a miss).
    pub lease: Option<u64>,
}

/// Counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TreeStats {
    /// Lookups.
    pub lookups: u64,
    /// Lookups with a hit.
    pub hits: u64,
    /// Tokens served.
    pub cached_tokens: u64,
    /// Nodes evicted.
    pub evictions: u64,
    /// Matches of preempted sequences coming back (their hit recomputes what they had: not reuse, so
    /// not in `lookups`, `hits` or `cached_tokens`).
    pub resumed: u64,
}

/// The tree.
#[derive(Debug)]
pub struct RadixTree<P: ?Sized, S: ?Sized> {
    page: usize,
    budget: usize,
    used: usize,
    /// Of `used`, the snapshots' bytes: host memory (pages are the KV pool's, on the device).
    host: usize,
    nodes: Vec<Option<Node<P, S>>>,
    free: Vec<usize>,
    tick: u64,
    leases: HashMap<u64, Vec<usize>>,
    next_lease: u64,
    stats: TreeStats,
}

impl<P: Bytes + ?Sized, S: Bytes + ?Sized> RadixTree<P, S> {
    /// An empty tree of `page`-token pages holding at most `budget` bytes when nothing is pinned.
    pub fn new(page: usize, budget: usize) -> Self {
        let root = Node {
            parent: 0,
            key: Vec::new(),
            children: HashMap::new(),
            page: None,
            snapshot: None,
            lock: 0,
            last_use: 0,
        };
        RadixTree {
            page: page.max(1),
            budget,
            used: 0,
            host: 0,
            nodes: vec![Some(root)],
            free: Vec::new(),
            tick: 0,
            leases: HashMap::new(),
            next_lease: 1,
            stats: TreeStats::default(),
        }
    }

    /// Page size in tokens.
    pub fn page_size(&self) -> usize {
        self.page
    }

    fn node(&self, i: usize) -> &Node<P, S> {
        self.nodes[i].as_ref().expect("live node: this is a bug")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<P, S> {
        self.nodes[i].as_mut().expect("live node: this is a bug")
    }

    /// Longest cached prefix of `ids` usable up to `cap` tokens, ending at a snapshot; pins it.
    pub fn match_prefix(&mut self, ids: &[u64], cap: usize) -> Hit<P, S> {
        self.stats.lookups += 1;
        let h = self.lookup(ids, cap);
        if h.tokens > 0 {
            self.stats.hits += 1;
            self.stats.cached_tokens += h.tokens as u64;
        }
        h
    }

    /// [`RadixTree::match_prefix`] for a preempted sequence coming back: counted as `resumed`, not as
    /// reuse.
    pub fn rematch_prefix(&mut self, ids: &[u64], cap: usize) -> Hit<P, S> {
        self.stats.resumed += 1;
        self.lookup(ids, cap)
    }

    fn lookup(&mut self, ids: &[u64], cap: usize) -> Hit<P, S> {
        self.tick += 1;
        let mut path = Vec::new();
        let mut cur = 0;
        let mut d = 0;
        while (d + 1) * self.page <= cap.min(ids.len()) {
            let key = &ids[d * self.page..(d + 1) * self.page];
            match self.node(cur).children.get(key) {
                Some(&c) => {
                    path.push(c);
                    cur = c;
                    d += 1;
                }
                None => break,
            }
        }
        while let Some(&last) = path.last() {
            if self.node(last).snapshot.is_some() {
                break;
            }
            path.pop();
        }
        if path.is_empty() {
            return Hit { tokens: 0, pages: Vec::new(), snapshot: None, lease: None };
        }
        let tick = self.tick;
        for &n in &path {
            let node = self.node_mut(n);
            node.lock += 1;
            node.last_use = tick;
        }
        let lease = self.next_lease;
        self.next_lease += 1;
        let pages = path.iter().map(|&n| self.node(n).page.clone().expect("non-root page")).collect();
        let snapshot = self.node(*path.last().expect("non-empty")).snapshot.clone();
        self.leases.insert(lease, path.clone());
        Hit { tokens: path.len() * self.page, pages, snapshot, lease: Some(lease) }
    }

    /// Unpins a lease (unknown ids are ignored).
    pub fn release(&mut self, lease: u64) {
        if let Some(path) = self.leases.remove(&lease) {
            for n in path {
                if let Some(node) = self.nodes[n].as_mut() {
                    node.lock -= 1;
                }
            }
        }
        self.evict();
    }

    /// Stores `ids` (a page multiple) with the snapshot after them. `pages` gives the rows of pages the
    /// tree may lack (by page index); insertion stops where a missing page is not provided.
    pub fn insert(&mut self, ids: &[u64], pages: &[(usize, Arc<P>)], snapshot: Arc<S>) {
        self.tick += 1;
        let n_pages = ids.len() / self.page;
        if n_pages == 0 || !ids.len().is_multiple_of(self.page) {
            return;
        }
        let given: HashMap<usize, &Arc<P>> = pages.iter().map(|(i, p)| (*i, p)).collect();
        let mut cur = 0;
        for d in 0..n_pages {
            let key = ids[d * self.page..(d + 1) * self.page].to_vec();
            let next = match self.node(cur).children.get(&key) {
                Some(&c) => c,
                None => {
                    let Some(page) = given.get(&d) else { return };
                    self.used += page.bytes();
                    let node = Node {
                        parent: cur,
                        key: key.clone(),
                        children: HashMap::new(),
                        page: Some((*page).clone()),
                        snapshot: None,
                        lock: 0,
                        last_use: self.tick,
                    };
                    let idx = match self.free.pop() {
                        Some(i) => {
                            self.nodes[i] = Some(node);
                            i
                        }
                        None => {
                            self.nodes.push(Some(node));
                            self.nodes.len() - 1
                        }
                    };
                    self.node_mut(cur).children.insert(key, idx);
                    idx
                }
            };
            let tick = self.tick;
            self.node_mut(next).last_use = tick;
            cur = next;
        }
        if self.node(cur).snapshot.is_none() {
            self.used += snapshot.bytes();
            self.host += snapshot.bytes();
            self.node_mut(cur).snapshot = Some(snapshot);
        }
        self.evict();
    }

    /// Drops LRU unlocked leaves and shadowed snapshots until the budget holds (or nothing more can go).
    pub fn evict(&mut self) {
        while self.used > self.budget && self.evict_one(true) {}
    }

    /// Drops LRU unlocked leaves until `pages` pages are gone (or nothing more can go): the KV pool
    /// needs the pages back for running sequences. Returns the pages dropped.
    pub fn reclaim(&mut self, pages: usize) -> usize {
        let mut dropped = 0;
        while dropped < pages && self.evict_one(false) {
            dropped += 1;
        }
        dropped
    }

    /// Drops the least recently used of: an unlocked leaf (its page and snapshot), or, with
    /// `snapshots`, the snapshot of a node that has another snapshot below it. A shadowed
    /// snapshot only lets a prompt resume exactly there; the pages under it serve every continuation, and
    /// the deeper snapshot the one that goes on. So on equal use the snapshot goes first, the shallowest
    /// of them first: a conversation holds one per snapshot interval and touches its whole path every
    /// turn, and it is the oldest turns' that its next turn needs least. Without this, a conversation
    /// whose snapshots outgrow the budget lost its newest pages (the only leaf) every turn. False when
    /// nothing can go.
    fn evict_one(&mut self, snapshots: bool) -> bool {
        let leaf = self
            .nodes
            .iter()
            .enumerate()
            .skip(1)
            .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
            .filter(|(_, n)| n.children.is_empty() && n.lock == 0)
            .min_by_key(|(_, n)| n.last_use)
            .map(|(i, n)| (n.last_use, i));
        // Only while dropping every shadowed snapshot would be enough: past that, pages must go whichever
        // snapshots do, and a path is cut from its newest page back, keeping the snapshots above the cut
        // (dropping those first would leave pages that no match can end on).
        let shadowed = match snapshots.then(|| self.shadowed_snapshots()).flatten() {
            Some((victim, bytes)) if self.used - bytes <= self.budget => Some(victim),
            _ => None,
        };
        match (leaf, shadowed) {
            (_, Some((used, v))) if leaf.is_none_or(|(l, _)| used <= l) => {
                let snap = self.node_mut(v).snapshot.take().map_or(0, |s| s.bytes());
                self.used -= snap;
                self.host -= snap;
                self.stats.evictions += 1;
            }
            (Some((_, v)), _) => {
                let node = self.nodes[v].take().expect("live");
                let snap = node.snapshot.as_ref().map_or(0, |s| s.bytes());
                self.used -= node.page.as_ref().map_or(0, |p| p.bytes()) + snap;
                self.host -= snap;
                self.node_mut(node.parent).children.remove(&node.key);
                self.free.push(v);
                self.stats.evictions += 1;
            }
            (None, _) => return false,
        }
        true
    }

    /// The least recently used node whose snapshot has another snapshot below it (the shallowest on
    /// equal use) with its last use, and the bytes of all such snapshots; `None` when there are none.
    fn shadowed_snapshots(&self) -> Option<((u64, usize), usize)> {
        // Breadth first from the root, then back: children come before their parents.
        let mut order = vec![(0usize, 0usize)];
        let mut i = 0;
        while i < order.len() {
            let (n, d) = order[i];
            order.extend(self.node(n).children.values().map(|&c| (c, d + 1)));
            i += 1;
        }
        let mut below = vec![false; self.nodes.len()];
        let (mut best, mut bytes): (Option<(u64, usize, usize)>, usize) = (None, 0);
        for &(n, depth) in order.iter().rev() {
            let node = self.node(n);
            below[n] = node.children.values().any(|&c| below[c] || self.node(c).snapshot.is_some());
            // A pinned node's snapshot may go too: its hit holds the snapshot it resumed from (an Arc),
            // and the pin is there for the pages the sequence shares.
            let Some(snap) = node.snapshot.as_ref().filter(|_| n != 0 && below[n]) else { continue };
            bytes += snap.bytes();
            let key = (node.last_use, depth, n);
            if best.is_none_or(|b| key < b) {
                best = Some(key);
            }
        }
        best.map(|(used, _, n)| ((used, n), bytes))
    }

    /// Bytes held.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Bytes of snapshots held (host memory); the rest of [`Self::used`] is KV pages (device memory).
    pub fn host_bytes(&self) -> usize {
        self.host
    }

    /// Bytes of KV pages held (device memory).
    pub fn device_bytes(&self) -> usize {
        self.used - self.host
    }

    /// Byte budget.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Live nodes (root excluded).
    pub fn len(&self) -> usize {
        self.nodes.iter().skip(1).filter(|n| n.is_some()).count()
    }

    /// Nodes holding a recurrent-state snapshot.
    pub fn snapshots(&self) -> usize {
        self.nodes.iter().skip(1).flatten().filter(|n| n.snapshot.is_some()).count()
    }

    /// Whether only the root is left.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Counters.
    pub fn stats(&self) -> TreeStats {
        self.stats
    }

    /// Checks every structural invariant (tests).
    pub fn check(&self) {
        let (mut bytes, mut host) = (0, 0);
        let mut locks: HashMap<usize, u32> = HashMap::new();
        for path in self.leases.values() {
            for &n in path {
                *locks.entry(n).or_default() += 1;
            }
        }
        for (i, n) in self.nodes.iter().enumerate().skip(1) {
            let Some(n) = n else { continue };
            bytes += n.page.as_ref().map_or(0, |p| p.bytes()) + n.snapshot.as_ref().map_or(0, |s| s.bytes());
            host += n.snapshot.as_ref().map_or(0, |s| s.bytes());
            assert_eq!(n.key.len(), self.page, "edge length");
            assert_eq!(self.node(n.parent).children.get(&n.key), Some(&i), "parent link");
            assert_eq!(n.lock, locks.get(&i).copied().unwrap_or(0), "lock count = leases through the node");
            assert!(n.page.is_some());
        }
        assert_eq!(bytes, self.used, "byte accounting");
        assert_eq!(host, self.host, "host (snapshot) byte accounting");
        if self.leases.is_empty() {
            assert!(self.used <= self.budget, "over budget with nothing pinned");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, PartialEq)]
    struct Blob(usize, u64);
    impl Bytes for Blob {
        fn bytes(&self) -> usize {
            self.0
        }
    }

    fn pages(ids: &[u64], page: usize) -> Vec<(usize, Arc<Blob>)> {
        (0..ids.len() / page).map(|i| (i, Arc::new(Blob(10, ids[i * page])))).collect()
    }

    #[test]
    fn match_truncates_to_the_deepest_snapshot_and_respects_the_cap() {
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(2, 1000);
        let ids = [1, 2, 3, 4, 5, 6, 7, 8];
        t.insert(&ids[..4], &pages(&ids, 2), Arc::new(Blob(5, 4)));
        t.insert(&ids, &pages(&ids, 2), Arc::new(Blob(5, 8)));
        let h = t.match_prefix(&ids, 7);
        assert_eq!(
            (h.tokens, h.snapshot.as_ref().map(|s| s.1)),
            (4, Some(4)),
            "cap 7 → page 3 unusable → snapshot at 4"
        );
        let h2 = t.match_prefix(&[1, 2, 3, 4, 5, 6, 7, 8, 9], 8);
        assert_eq!(h2.tokens, 8);
        assert_eq!(h2.pages.iter().map(|p| p.1).collect::<Vec<_>>(), vec![1, 3, 5, 7]);
        let miss = t.match_prefix(&[1, 2, 9, 9], 4);
        assert_eq!((miss.tokens, miss.lease), (0, None), "page 1 exists but has no snapshot");
        t.check();
        t.release(h.lease.expect("lease"));
        t.release(h2.lease.expect("lease"));
        t.check();
    }

    /// Issue 53: a conversation with a snapshot on every page, longer than the budget holds in snapshots.
    /// The shallow snapshots go and every page stays, so the whole path still matches at its deepest
    /// snapshot (before, the path's only leaf, its newest page, went at every insert). A stale branch
    /// older than the path goes before the path's snapshots, and a pinned node's snapshot may go too.
    #[test]
    fn shadowed_snapshots_go_before_the_pages_of_a_long_path() {
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(1, 200);
        t.insert(&[9, 9], &pages(&[9, 9], 1), Arc::new(Blob(40, 0)));
        let ids: Vec<u64> = (0..10).collect();
        for end in 1..=ids.len() {
            // Every turn resends the whole path and adds a page with its snapshot.
            t.insert(&ids[..end], &pages(&ids[..end], 1), Arc::new(Blob(40, end as u64)));
            t.check();
        }
        // 10 pages of 10 bytes and room for 2 snapshots of 40: the deepest two stay.
        assert_eq!(t.used(), 180);
        assert_eq!(t.snapshots(), 2);
        assert_eq!(t.match_prefix(&[9, 9], 2).tokens, 0, "the stale branch went first");
        let h = t.match_prefix(&ids, ids.len());
        assert_eq!((h.tokens, h.snapshot.as_ref().map(|s| s.1)), (10, Some(10)), "the whole path, at its tip");
        assert_eq!(t.match_prefix(&ids[..9], 9).tokens, 9, "and the snapshot before it");
        assert_eq!(t.match_prefix(&ids[..8], 8).tokens, 0, "the shallow snapshots are gone");
        // When dropping every shadowed snapshot would not be enough, the path is cut from its newest page
        // back and keeps the snapshot above the cut (dropping that one first would strand its pages).
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(1, 65);
        for end in 1..=3 {
            t.insert(&ids[..end], &pages(&ids[..end], 1), Arc::new(Blob(40, end as u64)));
        }
        assert_eq!((t.used(), t.snapshots()), (60, 1));
        let h = t.match_prefix(&ids[..3], 3);
        assert_eq!((h.tokens, h.snapshot.as_ref().map(|s| s.1)), (2, Some(2)), "pages 1-2 and the snapshot at 2");
        t.release(h.lease.expect("lease"));
        // A running turn pins the path it resumed from; its own new pages and snapshot are inserted
        // below. Over budget, the pinned snapshot it resumed from goes (the hit holds it), not the
        // turn's new pages, which no snapshot above them could let the next turn reach.
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(1, 1000);
        t.insert(&ids[..2], &pages(&ids[..2], 1), Arc::new(Blob(40, 2)));
        let pinned = t.match_prefix(&ids[..4], 4);
        assert_eq!(pinned.tokens, 2);
        t.budget = 100;
        t.insert(&ids[..4], &pages(&ids[..4], 1), Arc::new(Blob(40, 4)));
        assert_eq!((t.used(), t.snapshots()), (80, 1), "the pinned node's shadowed snapshot went");
        assert_eq!(pinned.snapshot.as_ref().map(|s| s.1), Some(2), "the hit still holds it");
        let again = t.match_prefix(&ids[..4], 4);
        assert_eq!(again.tokens, 4, "the new pages and their snapshot stay");
        t.release(pinned.lease.expect("lease"));
        t.release(again.lease.expect("lease"));
        t.check();
    }

    #[test]
    fn reclaim_gives_back_unpinned_pages_oldest_first_and_keeps_pinned_ones() {
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(1, 1000);
        for k in 0..3u64 {
            let ids = [k, 100 + k];
            t.insert(&ids, &pages(&ids, 1), Arc::new(Blob(1, k)));
        }
        let pinned = t.match_prefix(&[0, 100], 2);
        // Leaves go oldest first: branch 1's two pages, then branch 2's leaf (with its snapshot).
        assert_eq!(t.reclaim(3), 3, "three unpinned pages are given back");
        assert_eq!(t.match_prefix(&[1, 101], 2).tokens, 0, "branch 1 is gone");
        assert_eq!(t.match_prefix(&[2, 102], 2).tokens, 0, "branch 2 lost its snapshot page");
        assert_eq!(t.reclaim(5), 1, "then branch 2's first page; the pinned path stays");
        assert_eq!(pinned.tokens, 2);
        t.release(pinned.lease.expect("lease"));
        assert_eq!(t.reclaim(5), 2, "unpinned, its two pages go");
        assert!(t.is_empty());
        t.check();
    }

    #[test]
    fn eviction_is_lru_over_unlocked_leaves_and_never_touches_pinned_paths() {
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(1, 45);
        for k in 0..3u64 {
            let ids = [k, 100 + k];
            t.insert(&ids, &pages(&ids, 1), Arc::new(Blob(1, k)));
        }
        // Budget 45 < 3 × 21: the oldest branch (0) lost its leaf, then its page.
        assert!(t.used() <= 45);
        assert_eq!(t.match_prefix(&[0, 100], 2).tokens, 0);
        let pinned = t.match_prefix(&[2, 102], 2);
        assert_eq!(pinned.tokens, 2);
        for k in 3..6u64 {
            let ids = [k, 100 + k];
            t.insert(&ids, &pages(&ids, 1), Arc::new(Blob(1, k)));
        }
        assert_eq!(t.match_prefix(&[2, 102], 2).tokens, 2, "a pinned path survives");
        t.check();
        assert!(t.stats().evictions >= 4);
    }

    #[test]
    fn randomized_invariants_small_vocabulary() {
        let mut seed = 42u64;
        let mut rnd = |n: u64| {
            seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(2, 300);
        let mut leases = Vec::new();
        for _ in 0..5000 {
            let len = 2 * (1 + rnd(5)) as usize;
            let ids: Vec<u64> = (0..len).map(|_| rnd(3)).collect();
            match rnd(4) {
                0 | 1 => t.insert(&ids, &pages(&ids, 2), Arc::new(Blob(3, len as u64))),
                2 => {
                    let cap = rnd(len as u64 + 1) as usize;
                    let h = t.match_prefix(&ids, cap);
                    assert!(h.tokens <= cap && h.tokens.is_multiple_of(2));
                    assert_eq!(h.pages.len() * 2, h.tokens);
                    if let Some(s) = &h.snapshot {
                        // The snapshot was inserted for a prefix of exactly this length.
                        assert_eq!(s.1 as usize, h.tokens);
                    }
                    if let Some(l) = h.lease {
                        leases.push(l);
                    }
                }
                _ => {
                    if !leases.is_empty() {
                        let i = rnd(leases.len() as u64) as usize;
                        t.release(leases.swap_remove(i));
                    }
                }
            }
            t.check();
        }
        for l in leases {
            t.release(l);
        }
        t.check();
        assert!(t.used() <= t.budget());
    }

    #[test]
    fn a_preempted_sequence_coming_back_is_not_counted_as_reuse() {
        let mut t: RadixTree<Blob, Blob> = RadixTree::new(2, 1000);
        let ids = [1, 2, 3, 4];
        t.insert(&ids, &pages(&ids, 2), Arc::new(Blob(5, 4)));
        let h = t.rematch_prefix(&[1, 2, 3, 4, 5], 4);
        assert_eq!(h.tokens, 4, "the pages come back all the same");
        let s = t.stats();
        assert_eq!((s.lookups, s.hits, s.cached_tokens, s.resumed), (0, 0, 0, 1));
        let h2 = t.match_prefix(&[1, 2, 3, 4, 5], 4);
        assert_eq!(h2.tokens, 4);
        let s = t.stats();
        assert_eq!((s.lookups, s.hits, s.cached_tokens, s.resumed), (1, 1, 4, 1));
    }
}
