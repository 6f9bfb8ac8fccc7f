//! The residency table: experts read from disk held under a RAM budget (total bytes, or experts per
//! layer). An expert in use is leased and never evicted; eviction picks among unleased experts by policy
//! (LRU, or LFU with exponential decay). Guessed experts (read ahead) are held beside the budget until
//! their layer's step uses or passes them over.

use std::sync::Arc;

use lru::LruCache;
use osprey_models::ExpertWeights;

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
    slots: LruCache<(usize, usize), Slot>,
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
        for &(layer, expert) in self.slots.iter().map(|(k, _)| k) {
            if let Some(m) = maps.get_mut(layer) {
                m.resident.push(expert as u32);
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

    fn touch(&mut self, key: (usize, usize)) {
        self.tick += 1;
        let tick = self.tick;
        let decay = match self.policy {
            Policy::LfuDecay { half_life } if half_life < u32::MAX => 0.5f64.powf(1.0 / half_life.max(1) as f64),
            _ => 1.0,
        };
        if decay != 1.0 {
            for (k, s) in self.slots.iter_mut() {
                if k.0 == key.0 {
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
    pub fn set_frequency(&mut self, layer: usize, expert: usize, freq: f64) {
        if let Some(s) = self.slots.peek_mut(&(layer, expert)) {
            s.freq = freq;
        }
    }

    /// A resident expert, leased; `None` on a miss.
    pub fn lease(&mut self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        let key = (layer, expert);
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
    pub fn lease_quiet(&mut self, layer: usize, expert: usize) -> Option<Arc<ExpertWeights>> {
        let s = self.slots.peek_mut(&(layer, expert))?;
        s.leases += 1;
        Some(s.weights.clone())
    }

    /// Counts a use of a resident expert that needs no lease (it sits in a backend slot that holds one):
    /// a hit, and the most recent. An expert not resident is ignored.
    pub fn hit(&mut self, layer: usize, expert: usize) {
        let key = (layer, expert);
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
    fn took_guess(&mut self, key: (usize, usize)) {
        if let Some(s) = self.slots.peek_mut(&key).filter(|s| s.guess) {
            s.guess = false;
            self.guess_bytes -= s.bytes;
            self.guesses[key.0] -= 1;
            self.prefetch.used += 1;
        }
    }

    /// Marks a resident expert as read for a guess (after [`ResidencyTable::insert`] and its release).
    pub fn guessed(&mut self, layer: usize, expert: usize) {
        if let Some(s) = self.slots.peek_mut(&(layer, expert)).filter(|s| !s.guess) {
            s.guess = true;
            self.guess_bytes += s.bytes;
            self.guesses[layer] += 1;
            self.prefetch.issued += 1;
            self.prefetch.bytes_read += s.bytes as u64;
        }
    }

    /// Bytes of guessed experts not used yet.
    pub fn guess_bytes(&self) -> usize {
        self.guess_bytes
    }

    /// Whether `expert` of `layer` is held.
    pub fn contains(&self, layer: usize, expert: usize) -> bool {
        self.slots.contains(&(layer, expert))
    }

    /// `layer` has had its step: its guesses still unused were wrong. They are counted wasted and go to
    /// the front of the eviction order (least recent, least frequent).
    pub fn pass_over(&mut self, layer: usize) {
        self.steps[layer] += 1;
        let wrong: Vec<(usize, usize)> =
            self.slots.iter().filter(|(k, s)| k.0 == layer && s.guess).map(|(k, _)| *k).collect();
        wrong.into_iter().for_each(|k| self.waste(k));
        // Back inside the budget, the wrong guesses go first.
        self.evict(layer);
    }

    /// Steps `layer` has had (guesses asked for at an earlier count came too late).
    pub fn steps(&self, layer: usize) -> u64 {
        self.steps[layer]
    }

    /// A guess that was wrong: counted wasted, moved inside the budget, first in line for eviction.
    fn waste(&mut self, k: (usize, usize)) {
        let Some(s) = self.slots.peek_mut(&k).filter(|s| s.guess) else { return };
        (s.guess, s.freq, s.last_use) = (false, 0.0, 0);
        let bytes = s.bytes;
        self.guess_bytes -= bytes;
        self.guesses[k.0] -= 1;
        self.prefetch.wasted += 1;
        self.prefetch.wasted_bytes += bytes as u64;
        self.slots.demote(&k);
    }

    /// A guess that landed after its layer's step: wasted at once.
    pub fn late_guess(&mut self, layer: usize, expert: usize) {
        self.waste((layer, expert));
        self.evict(layer);
    }

    /// Inserts a freshly read expert, leased once, then evicts unleased experts over the budget.
    pub fn insert(
        &mut self,
        layer: usize,
        expert: usize,
        weights: Arc<ExpertWeights>,
        bytes: usize,
    ) -> Arc<ExpertWeights> {
        let key = (layer, expert);
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
    /// not resident, as many as the budget has room for (`bytes(e)` each), at most `most`.
    pub fn room_for(&self, layer: usize, count: usize, bytes: &dyn Fn(usize) -> usize, most: usize) -> Vec<usize> {
        let (mut used, mut in_layer) = (self.used, self.per_layer[layer]);
        let mut out = Vec::new();
        for e in (0..count).filter(|&e| !self.slots.contains(&(layer, e))) {
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
    pub fn release(&mut self, layer: usize, expert: usize) {
        // A release is not a use: `peek_mut` leaves the recency order alone.
        if let Some(s) = self.slots.peek_mut(&(layer, expert)) {
            s.leases = s.leases.saturating_sub(1);
        }
        self.evict(layer);
    }

    fn over(&self, layer: usize) -> bool {
        match self.budget {
            Budget::Bytes(b) => self.used - self.guess_bytes > b,
            Budget::PerLayer(n) => self.per_layer[layer] - self.guesses[layer] > n,
        }
    }

    fn evict(&mut self, layer: usize) {
        while self.over(layer) {
            let scope = |k: &(usize, usize)| matches!(self.budget, Budget::Bytes(_)) || k.0 == layer;
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
            self.per_layer[k.0] -= 1;
            self.evictions += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use osprey_models::Weight;

    use super::*;

    fn w() -> Arc<ExpertWeights> {
        let m = Weight::from_f32(1, 1, vec![0.0]);
        Arc::new(ExpertWeights { gate: m.clone(), up: m.clone(), down: m })
    }

    #[test]
    fn a_release_is_not_a_use() {
        let mut t = ResidencyTable::new(1, Budget::PerLayer(2), Policy::Lru);
        t.insert(0, 1, w(), 10);
        t.insert(0, 2, w(), 10);
        t.release(0, 2);
        t.release(0, 1); // released last, but used first
        t.insert(0, 3, w(), 10);
        assert!(t.lease(0, 1).is_none(), "1 was the least recently used");
        assert!(t.lease(0, 2).is_some());
    }

    #[test]
    fn leased_experts_are_never_evicted_and_lru_goes_first() {
        let mut t = ResidencyTable::new(1, Budget::PerLayer(2), Policy::Lru);
        assert!(t.lease(0, 1).is_none());
        t.insert(0, 1, w(), 10);
        t.insert(0, 2, w(), 10);
        t.release(0, 1);
        t.release(0, 2);
        assert!(t.lease(0, 1).is_some()); // 1 is now more recent than 2
        t.release(0, 1);
        t.insert(0, 3, w(), 10); // over budget: 2 (least recent, unleased) goes
        assert!(t.lease(0, 2).is_none());
        assert!(t.lease(0, 1).is_some());
        // 1 and 3 leased: inserting 4 exceeds the budget but nothing can be evicted.
        t.insert(0, 4, w(), 10);
        assert_eq!(t.len(), 3);
        t.release(0, 1);
        t.release(0, 3);
        t.release(0, 4);
        assert_eq!(t.len(), 2);
        assert_eq!(t.stats[0].hits, 2);
    }

    #[test]
    fn lfu_decay_keeps_the_frequent_expert() {
        let mut t = ResidencyTable::new(1, Budget::Bytes(20), Policy::LfuDecay { half_life: 100 });
        t.insert(0, 1, w(), 10);
        t.release(0, 1);
        for _ in 0..5 {
            t.lease(0, 1);
            t.release(0, 1);
        }
        t.insert(0, 2, w(), 10);
        t.release(0, 2);
        t.insert(0, 3, w(), 10); // 2 is newer but rarer than 1: LFU evicts 2
        t.release(0, 3);
        assert!(t.lease(0, 1).is_some());
        assert!(t.lease(0, 2).is_none());
    }
}
