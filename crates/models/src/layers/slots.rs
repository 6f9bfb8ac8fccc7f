//! The expert slot table of one MoE layer (a synchronous core, like the residency manager's
//! `ResidencyTable`, owned by the layer and so by the runner thread): which expert each of the backend
//! pool's slots holds, in recency order, and the fence of each slot's last reader.
//!
//! A step looks its touched experts up ([`SlotTable::lookup`]): hits run from their slots with no
//! transfer; misses are uploaded into slots in waves of at most the pool's size ([`SlotTable::assign`]),
//! each slot a free one or the least recently used one the wave does not read. The caller waits for a
//! victim's last reader before uploading into it, and records the wave's fence on the slots it read.
//!
//! Guesses (issue 36): while the layer before computes, experts guessed for this layer may be uploaded
//! ahead ([`SlotTable::assign_guesses`]) into free or least recently used slots, never over another
//! guess still waiting for its step. The step's lookup counts a guess it finds `used`; the guesses it
//! passes over count `wasted` and become the least recent, so they are the first evicted.

use std::collections::{BTreeSet, HashMap};

use lru::LruCache;
use osprey_backend::{ExpertKey, Fence};
use osprey_protocol::runner::ExpertSlots;

/// Slots of one layer.
#[derive(Debug)]
pub struct SlotTable {
    /// Expert → slot, most recent first (unbounded: the slot count bounds it).
    by_expert: LruCache<ExpertKey, usize>,
    /// Slot → expert.
    holder: Vec<Option<ExpertKey>>,
    /// Slot → its last reader.
    reader: Vec<Fence>,
    /// Experts uploaded on a guess and not yet looked up by a step.
    guessed: BTreeSet<ExpertKey>,
    /// Counters.
    pub stats: ExpertSlots,
}

impl SlotTable {
    /// `slots` empty slots (at least one).
    pub fn new(slots: usize) -> Self {
        let slots = slots.max(1);
        SlotTable {
            by_expert: LruCache::unbounded(),
            holder: vec![None; slots],
            reader: vec![Fence::DONE; slots],
            guessed: BTreeSet::new(),
            stats: ExpertSlots::default(),
        }
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.holder.len()
    }

    /// The counters, with the pool's size and how many slots hold an expert.
    pub fn counters(&self) -> ExpertSlots {
        let filled = self.holder.iter().filter(|h| h.is_some()).count() as u64;
        ExpertSlots { slots: self.slots() as u64, filled, ..self.stats }
    }

    /// The expert a slot holds.
    pub fn holder(&self, slot: usize) -> Option<ExpertKey> {
        self.holder[slot]
    }

    /// Whether `expert` is in a slot (its recency unchanged).
    pub fn contains(&self, expert: ExpertKey) -> bool {
        self.by_expert.contains(&expert)
    }

    /// Splits the step's touched experts (ascending, distinct) into hits `(expert, slot)` (now the most
    /// recent) and misses (ascending). Guesses found count used; the others count wasted and become the
    /// least recent (the first evicted).
    pub fn lookup(&mut self, touched: &[ExpertKey]) -> (Vec<(ExpertKey, usize)>, Vec<ExpertKey>) {
        let (mut hits, mut misses) = (Vec::new(), Vec::new());
        for &e in touched {
            match self.by_expert.get(&e) {
                Some(&s) => {
                    if self.guessed.remove(&e) {
                        self.stats.guesses_used += 1;
                    }
                    hits.push((e, s))
                }
                None => misses.push(e),
            }
        }
        for e in std::mem::take(&mut self.guessed) {
            self.stats.guesses_wasted += 1;
            self.by_expert.demote(&e);
        }
        self.stats.hits += hits.len() as u64;
        self.stats.misses += misses.len() as u64;
        (hits, misses)
    }

    /// Slots for guessed experts to upload (distinct, none resident), in order: each takes a free slot,
    /// else the least recently used slot that holds neither a guess still waiting for its step nor an
    /// expert of `keep` (the whole guess: the guessed experts already resident stay); a guess that finds
    /// none gets none (the result is a prefix of `upload`). The table records them as holding the
    /// guesses (most recent). The caller waits for each slot's [`Self::reader`] before uploading.
    pub fn assign_guesses(&mut self, upload: &[ExpertKey], keep: &[ExpertKey]) -> Vec<usize> {
        let mut taken: Vec<usize> = Vec::with_capacity(upload.len());
        for &e in upload {
            debug_assert!(!self.by_expert.contains(&e), "guess {e:?} is already resident: this is a bug");
            let free = (0..self.slots()).find(|&s| self.holder[s].is_none());
            let slot = match free {
                Some(s) => s,
                None => {
                    let victim =
                        self.by_expert.iter().rev().find(|(e, _)| !self.guessed.contains(e) && !keep.contains(e));
                    let Some((&old, &s)) = victim else { break };
                    self.by_expert.pop(&old);
                    s
                }
            };
            self.holder[slot] = Some(e);
            self.by_expert.put(e, slot);
            self.guessed.insert(e);
            self.stats.guesses += 1;
            taken.push(slot);
        }
        taken
    }

    /// Slots for one wave of misses (at most [`Self::slots`], distinct, none resident): each takes a free
    /// slot, else the least recently used slot not already taken by this wave; the table then records
    /// them as holding the wave's experts (most recent). The caller waits for each slot's
    /// [`Self::reader`] before uploading into it.
    pub fn assign(&mut self, wave: &[ExpertKey]) -> Vec<usize> {
        assert!(wave.len() <= self.slots(), "a wave larger than the pool: this is a bug");
        let mut taken: Vec<usize> = Vec::with_capacity(wave.len());
        for &e in wave {
            debug_assert!(!self.by_expert.contains(&e), "expert {e:?} is already resident: this is a bug");
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
    pub fn resident(&self) -> HashMap<ExpertKey, usize> {
        self.by_expert.iter().map(|(&e, &s)| (e, s)).collect()
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    /// Expert `e` of layer 0 (the tests name experts by number).
    fn k(e: u32) -> ExpertKey {
        ExpertKey { layer: 0, expert: e }
    }

    fn keys(es: &[u32]) -> Vec<ExpertKey> {
        es.iter().map(|&e| k(e)).collect()
    }

    /// The waves of one step, as the MoE block runs them: the hits, then the misses in chunks of at most
    /// the pool's size. Returns per wave `(expert, slot, uploaded)`.
    fn step(table: &mut SlotTable, touched: &[u32]) -> Vec<Vec<(u32, usize, bool)>> {
        let (hits, misses) = table.lookup(&keys(touched));
        let mut waves = vec![hits.into_iter().map(|(e, s)| (e.expert, s, false)).collect::<Vec<_>>()];
        for chunk in misses.chunks(table.slots()) {
            let slots = table.assign(chunk);
            waves.push(chunk.iter().zip(slots).map(|(&e, s)| (e.expert, s, true)).collect());
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
                    prop_assert_eq!(table.holder(s), h.map(k));
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

    /// A step's guess (experts 0..12, possibly wrong) and what it then routed to.
    type Guessed = (Vec<u32>, Vec<u32>);

    /// Steps each preceded by a guess.
    fn guessed_steps() -> impl Strategy<Value = (usize, Vec<Guessed>)> {
        let set = || prop::collection::btree_set(0u32..12, 0..8).prop_map(|s| s.into_iter().collect::<Vec<_>>());
        (1usize..6, prop::collection::vec((set(), set().prop_filter("a step routes", |s| !s.is_empty())), 1..20))
    }

    proptest! {
        /// Guesses uploaded ahead (as the block before does) never break a step: its waves still read
        /// the experts they name from distinct slots, a guess never lands on a slot whose guess still
        /// waits, and every guess is counted used or wasted by the step that follows it.
        #[test]
        fn guesses_uploaded_ahead_keep_every_wave_right((slots, steps) in guessed_steps()) {
            let mut table = SlotTable::new(slots);
            let mut pool: Vec<Option<u32>> = vec![None; slots];
            for (guess, touched) in steps {
                let guess: Vec<u32> = guess.into_iter().filter(|&e| !table.contains(k(e))).collect();
                let taken = table.assign_guesses(&keys(&guess), &keys(&guess));
                prop_assert!(taken.len() <= guess.len().min(slots));
                let mut distinct = taken.clone();
                distinct.sort_unstable();
                distinct.dedup();
                prop_assert_eq!(distinct.len(), taken.len(), "two guesses in one slot");
                for (&e, &s) in guess.iter().zip(&taken) {
                    pool[s] = Some(e);
                }
                let before = table.counters();
                let mut seen = Vec::new();
                for wave in step(&mut table, &touched) {
                    for &(e, s, upload) in &wave {
                        if upload {
                            pool[s] = Some(e);
                        }
                    }
                    for &(e, s, _) in &wave {
                        prop_assert_eq!(pool[s], Some(e), "slot {} read while it holds {:?}", s, pool[s]);
                        seen.push(e);
                    }
                }
                seen.sort_unstable();
                prop_assert_eq!(&seen, &touched, "every touched expert runs exactly once");
                let after = table.counters();
                let used = guess[..taken.len()].iter().filter(|e| touched.contains(e)).count() as u64;
                prop_assert_eq!(after.guesses_used - before.guesses_used, used);
                prop_assert_eq!(after.guesses_wasted - before.guesses_wasted, taken.len() as u64 - used);
            }
        }
    }

    #[test]
    fn a_wasted_guess_is_evicted_first_and_a_waiting_guess_is_never_a_victim() {
        let mut t = SlotTable::new(3);
        step(&mut t, &[1, 2]);
        assert_eq!(t.assign_guesses(&keys(&[5]), &keys(&[5])).len(), 1, "a free slot");
        // The step routes to 1 only: the guess 5 is wasted and goes behind 2, though uploaded after it.
        step(&mut t, &[1]);
        let c = t.counters();
        assert_eq!((c.guesses, c.guesses_used, c.guesses_wasted), (1, 0, 1));
        step(&mut t, &[9]);
        assert!(!t.contains(k(5)) && t.contains(k(2)), "the wasted guess was the victim");
        // Full (1, 2, 9): 6 evicts the least recent (2), never 1, which the guess names too, nor a waiting
        // guess; 7 evicts 9; then only 1 and waiting guesses are left, so 8 gets no slot.
        let slots = t.assign_guesses(&keys(&[6, 7, 8]), &keys(&[1, 6, 7, 8]));
        assert_eq!(slots.len(), 2, "neither a waiting guess nor a guessed resident expert is a victim");
        assert!(t.contains(k(1)) && t.contains(k(6)) && t.contains(k(7)) && !t.contains(k(8)) && !t.contains(k(9)));
        step(&mut t, &[1, 7]);
        let c = t.counters();
        assert_eq!((c.guesses, c.guesses_used, c.guesses_wasted), (3, 1, 2));
    }

    #[test]
    fn the_least_recent_slot_is_the_victim() {
        let mut t = SlotTable::new(2);
        step(&mut t, &[1, 2]);
        step(&mut t, &[1]); // 2 is now the least recent
        let waves = step(&mut t, &[3]);
        assert_eq!(waves[1], vec![(3, t.resident()[&k(3)], true)]);
        assert_eq!(t.holder(t.resident()[&k(1)]), Some(k(1)), "1 stays: it was used last");
        assert!(!t.resident().contains_key(&k(2)));
    }
}
