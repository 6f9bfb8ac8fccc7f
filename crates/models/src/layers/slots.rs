//! The expert slot table of one MoE layer (a synchronous core, like the residency manager's
//! `ResidencyTable`, owned by the layer and so by the runner thread): which expert each of the backend
//! pool's slots holds, in recency order, and the fence of each slot's last reader.
//!
//! A step looks its touched experts up ([`SlotTable::lookup`]): hits run from their slots with no
//! transfer; misses are uploaded into slots in waves of at most the pool's size ([`SlotTable::assign`]),
//! each slot a free one or the least recently used one the wave does not read. The caller waits for a
//! victim's last reader before uploading into it, and records the wave's fence on the slots it read.

use std::collections::HashMap;

use crate::family::SlotStats;
use lru::LruCache;
use osprey_backend::Fence;

/// Slots of one layer.
#[derive(Debug)]
pub struct SlotTable {
    /// Expert → slot, most recent first (unbounded: the slot count bounds it).
    by_expert: LruCache<u32, usize>,
    /// Slot → expert.
    holder: Vec<Option<u32>>,
    /// Slot → its last reader.
    reader: Vec<Fence>,
    /// Counters.
    pub stats: SlotStats,
}

impl SlotTable {
    /// `slots` empty slots (at least one).
    pub fn new(slots: usize) -> Self {
        let slots = slots.max(1);
        SlotTable {
            by_expert: LruCache::unbounded(),
            holder: vec![None; slots],
            reader: vec![Fence::DONE; slots],
            stats: SlotStats::default(),
        }
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.holder.len()
    }

    /// The counters, with the pool's size and how many slots hold an expert.
    pub fn counters(&self) -> SlotStats {
        let filled = self.holder.iter().filter(|h| h.is_some()).count() as u64;
        SlotStats { slots: self.slots() as u64, filled, ..self.stats }
    }

    /// The expert a slot holds.
    pub fn holder(&self, slot: usize) -> Option<u32> {
        self.holder[slot]
    }

    /// Splits the step's touched experts (ascending, distinct) into hits `(expert, slot)` (now the most
    /// recent) and misses (ascending).
    pub fn lookup(&mut self, touched: &[u32]) -> (Vec<(u32, usize)>, Vec<u32>) {
        let (mut hits, mut misses) = (Vec::new(), Vec::new());
        for &e in touched {
            match self.by_expert.get(&e) {
                Some(&s) => hits.push((e, s)),
                None => misses.push(e),
            }
        }
        self.stats.hits += hits.len() as u64;
        self.stats.misses += misses.len() as u64;
        (hits, misses)
    }

    /// Slots for one wave of misses (at most [`Self::slots`], distinct, none resident): each takes a free
    /// slot, else the least recently used slot not already taken by this wave; the table then records
    /// them as holding the wave's experts (most recent). The caller waits for each slot's
    /// [`Self::reader`] before uploading into it.
    pub fn assign(&mut self, wave: &[u32]) -> Vec<usize> {
        assert!(wave.len() <= self.slots(), "a wave larger than the pool: this is a bug");
        let mut taken: Vec<usize> = Vec::with_capacity(wave.len());
        for &e in wave {
            debug_assert!(!self.by_expert.contains(&e), "expert {e} is already resident: this is a bug");
            let slot = match (0..self.slots()).find(|&s| self.holder[s].is_none() && !taken.contains(&s)) {
                Some(s) => s,
                None => {
                    let (&old, &s) = self
                        .by_expert
                        .iter()
                        .rev()
                        .find(|(_, s)| !taken.contains(s))
                        .expect("a wave no larger than the pool always finds a victim");
                    self.by_expert.pop(&old);
                    s
                }
            };
            self.holder[slot] = Some(e);
            self.by_expert.put(e, slot);
            taken.push(slot);
        }
        taken
    }

    /// The fence of `slot`'s last reader.
    pub fn reader(&self, slot: usize) -> Fence {
        self.reader[slot]
    }

    /// Records that the work before `fence` reads `slot`.
    pub fn read(&mut self, slot: usize, fence: Fence) {
        self.reader[slot] = fence;
    }

    /// Experts resident, by slot.
    pub fn resident(&self) -> HashMap<u32, usize> {
        self.by_expert.iter().map(|(&e, &s)| (e, s)).collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// The waves of one step, as the MoE block runs them: the hits, then the misses in chunks of at most
    /// the pool's size. Returns per wave `(expert, slot, uploaded)`.
    fn step(table: &mut SlotTable, touched: &[u32]) -> Vec<Vec<(u32, usize, bool)>> {
        let (hits, misses) = table.lookup(touched);
        let mut waves = vec![hits.into_iter().map(|(e, s)| (e, s, false)).collect::<Vec<_>>()];
        for chunk in misses.chunks(table.slots()) {
            let slots = table.assign(chunk);
            waves.push(chunk.iter().zip(slots).map(|(&e, s)| (e, s, true)).collect());
        }
        waves
    }

    fn touched_sets() -> impl Strategy<Value = (usize, Vec<Vec<u32>>)> {
        (1usize..6, prop::collection::vec(prop::collection::btree_set(0u32..12, 1..10), 1..20))
            .prop_map(|(slots, steps)| (slots, steps.into_iter().map(|s| s.into_iter().collect()).collect()))
    }

    proptest! {
        /// Every referenced slot holds its expert when the wave runs, no slot twice in a wave, each touched
        /// expert once per step, uploads only for misses, and the table agrees with a simulated pool.
        #[test]
        fn waves_read_resident_distinct_slots((slots, steps) in touched_sets()) {
            let mut table = SlotTable::new(slots);
            let mut pool: Vec<Option<u32>> = vec![None; slots];
            for touched in steps {
                let waves = step(&mut table, &touched);
                let mut seen: Vec<u32> = Vec::new();
                for wave in &waves {
                    prop_assert!(wave.len() <= slots);
                    let mut used: Vec<usize> = wave.iter().map(|w| w.1).collect();
                    used.sort_unstable();
                    used.dedup();
                    prop_assert_eq!(used.len(), wave.len(), "a slot twice in one wave");
                    for &(e, s, upload) in wave {
                        if upload {
                            pool[s] = Some(e);
                        }
                    }
                    for &(e, s, upload) in wave {
                        prop_assert_eq!(pool[s], Some(e), "slot {} read while it holds {:?}", s, pool[s]);
                        prop_assert!(!(upload && seen.contains(&e)), "expert {} loaded twice in a step", e);
                        seen.push(e);
                    }
                }
                seen.sort_unstable();
                prop_assert_eq!(&seen, &touched, "every touched expert runs exactly once");
                for (s, h) in pool.iter().enumerate() {
                    prop_assert_eq!(table.holder(s), *h);
                }
                prop_assert!(table.resident().len() <= slots);
            }
        }

        /// A pool at least as large as the experts a run touches uploads each expert once, ever.
        #[test]
        fn a_large_enough_pool_uploads_each_expert_once((_, steps) in touched_sets()) {
            let mut table = SlotTable::new(12);
            for touched in &steps {
                step(&mut table, touched);
            }
            let distinct: std::collections::BTreeSet<u32> = steps.iter().flatten().copied().collect();
            prop_assert_eq!(table.stats.misses, distinct.len() as u64);
        }
    }

    #[test]
    fn the_least_recent_slot_is_the_victim() {
        let mut t = SlotTable::new(2);
        step(&mut t, &[1, 2]);
        step(&mut t, &[1]); // 2 is now the least recent
        let waves = step(&mut t, &[3]);
        assert_eq!(waves[1], vec![(3, t.resident()[&3], true)]);
        assert_eq!(t.holder(t.resident()[&1]), Some(1), "1 stays: it was used last");
        assert!(!t.resident().contains_key(&2));
    }
}
