//! The residency table: experts read from disk held under a RAM budget (total bytes, or experts per
//! layer). An expert in use is leased and never evicted; eviction picks among unleased experts by policy
//! (LRU, or LFU with exponential decay). Guessed experts (read ahead) are held beside the budget until
//! their layer's step uses or passes them over.

use std::sync::Arc;

use lru::LruCache;
use osprey_models::{ExpertKey, ExpertWeights};

use super::{ExpertMap, LayerStats, PrefetchStats};

/// How much RAM experts may hold.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Budget {
    /// Total bytes over all layers.
    Bytes(usize),
    /// Experts per layer.
    PerLayer(usize),
}

/// Which unleased expert to evict.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    /// Least recently used.
    Lru,
    /// Least frequently used, counts halved every `half_life` accesses of the layer.
    LfuDecay {
        /// Accesses per halving.
        half_life: u32,
    },
}

#[derive(Debug)]
struct Slot {
    weights: Arc<ExpertWeights>,
    bytes: usize,
    leases: u32,
    last_use: u64,
    freq: f64,
    /// Read because it was guessed, and not used since.
    guess: bool,
}

/// The synchronous core.
#[derive(Debug)]
pub struct ResidencyTable {
    pub(super) budget: Budget,
    policy: Policy,
    /// Resident experts in recency order (`lru`, unbounded: the budget is bytes or experts per layer,
    /// and leased experts must be skipped, so eviction walks from the least recent end itself).
    slots: LruCache<ExpertKey, Slot>,
    used: usize,
    per_layer: Vec<usize>,
    tick: u64,
    /// Per-layer counters.
    pub stats: Vec<LayerStats>,
    /// Per layer, per expert: (hits, misses) (grown as experts are seen).
    per_expert: Vec<Vec<(u64, u64)>>,
    /// Experts evicted.
    pub evictions: u64,
    /// Bytes of guessed experts not used yet, and their count per layer: held beside the budget (bounded
    /// by the manager's cap instead), so a guess never evicts an expert and the budget never evicts a
    /// guess before its layer's step.
    guess_bytes: usize,
    guesses: Vec<usize>,
    /// Per layer, the steps passed over so far ([`ResidencyTable::pass_over`]).
    steps: Vec<u64>,
    /// What guesses did.
    pub prefetch: PrefetchStats,
}

impl ResidencyTable {
    /// An empty table for `layers` layers.
    pub fn new(layers: usize, budget: Budget, policy: Policy) -> Self {
        ResidencyTable {
            budget,
            policy,
            slots: LruCache::unbounded(),
            used: 0,
            per_layer: vec![0; layers],
            tick: 0,
            stats: vec![LayerStats::default(); layers],
            per_expert: vec![Vec::new(); layers],
            evictions: 0,
            guess_bytes: 0,
            guesses: vec![0; layers],
            steps: vec![0; layers],
            prefetch: PrefetchStats::default(),
        }
    }

    /// Per layer of `experts_per_layer[layer]` experts: the resident ids and each expert's counts.
    pub fn expert_maps(&self, experts_per_layer: &[usize]) -> Vec<ExpertMap> {
        let mut maps: Vec<ExpertMap> = experts_per_layer
            .iter()
            .zip(&self.per_expert)
            .map(|(&count, c)| ExpertMap {
                count,
                resident: Vec::new(),
                hits: (0..count).map(|e| c.get(e).map_or(0, |x| x.0)).collect(),
                misses: (0..count).map(|e| c.get(e).map_or(0, |x| x.1)).collect(),
            })
            .collect();
        for k in self.slots.iter().map(|(k, _)| k) {
            if let Some(m) = maps.get_mut(k.layer()) {
                m.resident.push(k.expert);
            }
        }
        maps.iter_mut().for_each(|m| m.resident.sort_unstable());
        maps
    }

    /// Bytes held.
    pub fn used(&self) -> usize {
        self.used
    }

    /// Experts held.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    fn touch(&mut self, key: ExpertKey) {
        self.tick += 1;
        let tick = self.tick;
        let decay = match self.policy {
            Policy::LfuDecay { half_life } if half_life < u32::MAX => 0.5f64.powf(1.0 / half_life.max(1) as f64),
            _ => 1.0,
        };
        if decay != 1.0 {
            for (k, s) in self.slots.iter_mut() {
                if k.layer == key.layer {
                    s.freq *= decay;
                }
            }
        }
        if let Some(s) = self.slots.get_mut(&key) {
            // `get_mut` also makes it the most recent.
            s.last_use = tick;
            s.freq += 1.0;
        }
    }

    /// Overrides an expert's frequency (a static routing-frequency profile; with decay off, LFU then
    /// evicts the experts the profile says are rarest).
    pub fn set_frequency(&mut self, key: ExpertKey, freq: f64) {
        if let Some(s) = self.slots.peek_mut(&key) {
            s.freq = freq;
        }
    }

    /// A resident expert, leased; `None` on a miss.
    pub fn lease(&mut self, key: ExpertKey) -> Option<Arc<ExpertWeights>> {
        let (layer, expert) = (key.layer(), key.expert());
        let counts = &mut self.per_expert[layer];
        if counts.len() <= expert {
            counts.resize(expert + 1, (0, 0));
        }
        if !self.slots.contains(&key) {
            self.stats[layer].misses += 1;
            counts[expert].1 += 1;
            return None;
        }
        self.stats[layer].hits += 1;
        counts[expert].0 += 1;
        self.touch(key);
        self.took_guess(key);
        let s = self.slots.peek_mut(&key).expect("present");
        s.leases += 1;
        Some(s.weights.clone())
    }

    /// A resident expert, leased without counting an access or a guess's use, nor changing its recency
    /// (an upload ahead of its layer's step: the step counts the use); `None` if not resident.
    pub fn lease_quiet(&mut self, key: ExpertKey) -> Option<Arc<ExpertWeights>> {
        let s = self.slots.peek_mut(&key)?;
        s.leases += 1;
        Some(s.weights.clone())
    }

    /// Counts a use of a resident expert that needs no lease (it sits in a backend slot that holds one):
    /// a hit, and the most recent. An expert not resident is ignored.
    pub fn hit(&mut self, key: ExpertKey) {
        let (layer, expert) = (key.layer(), key.expert());
        if !self.slots.contains(&key) {
            return;
        }
        self.stats[layer].hits += 1;
        let counts = &mut self.per_expert[layer];
        if counts.len() <= expert {
            counts.resize(expert + 1, (0, 0));
        }
        counts[expert].0 += 1;
        self.touch(key);
        self.took_guess(key);
    }

    /// A guessed expert's first use: the guess was right.
    fn took_guess(&mut self, key: ExpertKey) {
        if let Some(s) = self.slots.peek_mut(&key).filter(|s| s.guess) {
            s.guess = false;
            self.guess_bytes -= s.bytes;
            self.guesses[key.layer()] -= 1;
            self.prefetch.used += 1;
        }
    }

    /// Marks a resident expert as read for a guess (after [`ResidencyTable::insert`] and its release).
    pub fn guessed(&mut self, key: ExpertKey) {
        if let Some(s) = self.slots.peek_mut(&key).filter(|s| !s.guess) {
            s.guess = true;
            self.guess_bytes += s.bytes;
            self.guesses[key.layer()] += 1;
            self.prefetch.issued += 1;
            self.prefetch.bytes_read += s.bytes as u64;
        }
    }

    /// Bytes of guessed experts not used yet.
    pub fn guess_bytes(&self) -> usize {
        self.guess_bytes
    }

    /// Whether the expert is held.
    pub fn contains(&self, key: ExpertKey) -> bool {
        self.slots.contains(&key)
    }

    /// `layer` has had its step: its guesses still unused were wrong. They are counted wasted and go to
    /// the front of the eviction order (least recent, least frequent).
    pub fn pass_over(&mut self, layer: usize) {
        self.steps[layer] += 1;
        let wrong: Vec<ExpertKey> =
            self.slots.iter().filter(|(k, s)| k.layer() == layer && s.guess).map(|(k, _)| *k).collect();
        wrong.into_iter().for_each(|k| self.waste(k));
        // Back inside the budget, the wrong guesses go first.
        self.evict(layer);
    }

    /// Steps `layer` has had (guesses asked for at an earlier count came too late).
    pub fn steps(&self, layer: usize) -> u64 {
        self.steps[layer]
    }

    /// A guess that was wrong: counted wasted, moved inside the budget, first in line for eviction.
    fn waste(&mut self, k: ExpertKey) {
        let Some(s) = self.slots.peek_mut(&k).filter(|s| s.guess) else { return };
        (s.guess, s.freq, s.last_use) = (false, 0.0, 0);
        let bytes = s.bytes;
        self.guess_bytes -= bytes;
        self.guesses[k.layer()] -= 1;
        self.prefetch.wasted += 1;
        self.prefetch.wasted_bytes += bytes as u64;
        self.slots.demote(&k);
    }

    /// A guess that landed after its layer's step: wasted at once.
    pub fn late_guess(&mut self, key: ExpertKey) {
        self.waste(key);
        self.evict(key.layer());
    }

    /// Inserts a freshly read expert, leased once, then evicts unleased experts over the budget.
    pub fn insert(&mut self, key: ExpertKey, weights: Arc<ExpertWeights>, bytes: usize) -> Arc<ExpertWeights> {
        let layer = key.layer();
        if let Some(s) = self.slots.peek_mut(&key) {
            // Read twice in one batch (duplicate request): keep the first copy.
            s.leases += 1;
            return s.weights.clone();
        }
        self.slots.put(key, Slot { weights: weights.clone(), bytes, leases: 1, last_use: 0, freq: 0.0, guess: false });
        self.used += bytes;
        self.per_layer[layer] += 1;
        self.touch(key);
        self.evict(layer);
        weights
    }

    /// The experts of `layer` (of `count`) a warm-up may read without evicting anything: the lowest ids
    /// not resident, as many as the budget has room for (`bytes(key)` each), at most `most`.
    pub fn room_for(
        &self,
        layer: usize,
        count: usize,
        bytes: &dyn Fn(ExpertKey) -> usize,
        most: usize,
    ) -> Vec<ExpertKey> {
        let (mut used, mut in_layer) = (self.used, self.per_layer[layer]);
        let mut out = Vec::new();
        for e in (0..count).map(|e| ExpertKey::new(layer, e)).filter(|k| !self.slots.contains(k)) {
            if out.len() >= most {
                break;
            }
            let b = bytes(e);
            let fits = match self.budget {
                Budget::Bytes(total) => used + b <= total,
                Budget::PerLayer(n) => in_layer < n,
            };
            if fits {
                (used, in_layer) = (used + b, in_layer + 1);
                out.push(e);
            }
        }
        out
    }

    /// Drops one lease.
    pub fn release(&mut self, key: ExpertKey) {
        // A release is not a use: `peek_mut` leaves the recency order alone.
        if let Some(s) = self.slots.peek_mut(&key) {
            s.leases = s.leases.saturating_sub(1);
        }
        self.evict(key.layer());
    }

    fn over(&self, layer: usize) -> bool {
        match self.budget {
            Budget::Bytes(b) => self.used - self.guess_bytes > b,
            Budget::PerLayer(n) => self.per_layer[layer] - self.guesses[layer] > n,
        }
    }

    fn evict(&mut self, layer: usize) {
        while self.over(layer) {
            let scope = |k: &ExpertKey| matches!(self.budget, Budget::Bytes(_)) || k.layer() == layer;
            let candidates = self.slots.iter().rev().filter(|(k, s)| s.leases == 0 && !s.guess && scope(k));
            let victim = match self.policy {
                // Least recent first: the first unleased expert in scope from the old end.
                Policy::Lru => candidates.map(|(k, _)| *k).next(),
                Policy::LfuDecay { .. } => candidates
                    .min_by(|a, b| a.1.freq.total_cmp(&b.1.freq).then(a.1.last_use.cmp(&b.1.last_use)))
                    .map(|(k, _)| *k),
            };
            let Some(k) = victim else { return };
            let s = self.slots.pop(&k).expect("present");
            self.used -= s.bytes;
            self.per_layer[k.layer()] -= 1;
            self.evictions += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use osprey_models::Weight;

    use super::*;

    fn k(e: usize) -> ExpertKey {
        ExpertKey::new(0, e)
    }

    fn w() -> Arc<ExpertWeights> {
        let m = Weight::from_f32(1, 1, vec![0.0]);
        Arc::new(ExpertWeights { gate: m.clone(), up: m.clone(), down: m })
    }

    #[test]
    fn a_release_is_not_a_use() {
        let mut t = ResidencyTable::new(1, Budget::PerLayer(2), Policy::Lru);
        t.insert(k(1), w(), 10);
        t.insert(k(2), w(), 10);
        t.release(k(2));
        t.release(k(1)); // released last, but used first
        t.insert(k(3), w(), 10);
        assert!(t.lease(k(1)).is_none(), "1 was the least recently used");
        assert!(t.lease(k(2)).is_some());
    }

    #[test]
    fn leased_experts_are_never_evicted_and_lru_goes_first() {
        let mut t = ResidencyTable::new(1, Budget::PerLayer(2), Policy::Lru);
        assert!(t.lease(k(1)).is_none());
        t.insert(k(1), w(), 10);
        t.insert(k(2), w(), 10);
        t.release(k(1));
        t.release(k(2));
        assert!(t.lease(k(1)).is_some()); // 1 is now more recent than 2
        t.release(k(1));
        t.insert(k(3), w(), 10); // over budget: 2 (least recent, unleased) goes
        assert!(t.lease(k(2)).is_none());
        assert!(t.lease(k(1)).is_some());
        // 1 and 3 leased: inserting 4 exceeds the budget but nothing can be evicted.
        t.insert(k(4), w(), 10);
        assert_eq!(t.len(), 3);
        t.release(k(1));
        t.release(k(3));
        t.release(k(4));
        assert_eq!(t.len(), 2);
        assert_eq!(t.stats[0].hits, 2);
    }

    #[test]
    fn lfu_decay_keeps_the_frequent_expert() {
        let mut t = ResidencyTable::new(1, Budget::Bytes(20), Policy::LfuDecay { half_life: 100 });
        t.insert(k(1), w(), 10);
        t.release(k(1));
        for _ in 0..5 {
            t.lease(k(1));
            t.release(k(1));
        }
        t.insert(k(2), w(), 10);
        t.release(k(2));
        t.insert(k(3), w(), 10); // 2 is newer but rarer than 1: LFU evicts 2
        t.release(k(3));
        assert!(t.lease(k(1)).is_some());
        assert!(t.lease(k(2)).is_none());
    }
}
