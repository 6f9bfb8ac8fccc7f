//! The residency table (synchronous core) and the residency-manager actor.
//!
//! The table holds experts read from disk under a RAM budget (total bytes, or experts per layer). An
//! expert in use is leased and never evicted; eviction picks among unleased experts by policy (LRU, or
//! LFU with exponential decay). The actor thread owns the table and the reader: a `Need` for a layer
//! serves hits at once and reads all of that layer's misses in one batch. The runner's side
//! ([`ResidentSet`], an `ExpertSource`) sends `Need` and returns a ticket, so the MoE block computes the
//! shared expert while the reads are in flight; each handle carries a lease whose drop sends `Release`.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use lru::LruCache;
use osprey_models::{ExpertHandle, ExpertSource, ExpertTicket, ExpertWeights, PendingExperts};
use osprey_protocol::{ErrorCode, Handle, RequestError};
use tokio::sync::{mpsc, oneshot};

pub use osprey_protocol::experts::{ExpertMap, LayerStats, PrefetchStats, ResidencyCommand, ResidencyStats};

use osprey_models::ByteSource;

use crate::arena::{Arena, ArenaSlot};
use crate::buf::AlignedBuf;
use crate::reader::{open_reader, window, Dest, Reader};
use crate::store::ExpertIndex;

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
    budget: Budget,
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

#[derive(Debug)]
struct Lease {
    tx: mpsc::UnboundedSender<ResidencyCommand>,
    layer: usize,
    expert: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.tx.send(ResidencyCommand::Release { layer: self.layer, expert: self.expert });
    }
}

/// The runner's `ExpertSource`: asks the manager thread, returns tickets.
#[derive(Debug, Clone)]
pub struct ResidentSet {
    tx: mpsc::UnboundedSender<ResidencyCommand>,
    stall_nanos: Arc<AtomicU64>,
    /// Backend slots per layer the budget allows (slots hold leases, so they count against it).
    slots: usize,
}

impl ResidentSet {
    /// The manager's inbox (stats).
    pub fn sender(&self) -> mpsc::UnboundedSender<ResidencyCommand> {
        self.tx.clone()
    }
}

impl ExpertSource for ResidentSet {
    fn note_hits(&self, layer: usize, experts: &[usize]) {
        if !experts.is_empty() {
            let _ = self.tx.send(ResidencyCommand::Hits { layer, experts: experts.to_vec() });
        }
    }

    fn slots_per_layer(&self) -> Option<usize> {
        Some(self.slots)
    }

    fn prefetch(&self, layer: usize, experts: &[usize]) {
        let _ = self.tx.send(ResidencyCommand::Prefetch { layer, experts: experts.to_vec() });
    }

    fn request(&self, layer: usize, experts: &[usize]) -> ExpertTicket {
        let (resident_tx, resident_rx) = oneshot::channel();
        let (reply, rx) = oneshot::channel();
        let sent = self
            .tx
            .send(ResidencyCommand::Need {
                layer,
                experts: experts.to_vec(),
                span: tracing::Span::current(),
                resident: resident_tx,
                reply,
            })
            .is_ok();
        let (tx, stall) = (self.tx.clone(), self.stall_nanos.clone());
        let experts = experts.to_vec();
        let gone = || osprey_models::Error::Engine("the expert residency manager is gone".into());
        // A dropped reply: the manager panicked; `/health` must see it before this failure travels on.
        let died = {
            let tx = self.tx.clone();
            move || {
                osprey_protocol::inbox::wait_closed(&tx);
                gone()
            }
        };
        ExpertTicket::new(move || {
            if !sent {
                return Err(gone());
            }
            let lease = move |w, expert| {
                let key = osprey_models::layers::moe::key(layer, expert);
                ExpertHandle::new(key, w, Some(Box::new(Lease { tx: tx.clone(), layer, expert })))
            };
            let t0 = Instant::now();
            let have = resident_rx
                .blocking_recv()
                .map_err(|_| died())?
                .map_err(|e| osprey_models::Error::Engine(e.message))?;
            stall.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let missing: Vec<usize> = experts.iter().zip(&have).filter(|(_, w)| w.is_none()).map(|(&e, _)| e).collect();
            let have = have.into_iter().zip(&experts).map(|(w, &e)| w.map(|w| lease(from_handle(&w), e))).collect();
            let pending = PendingExperts::new(move || {
                let t0 = Instant::now();
                let got = rx.blocking_recv().map_err(|_| died())?;
                stall.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let weights = got.map_err(|e| {
                    osprey_models::Error::Engine(format!("reading experts of layer {layer} failed: {}", e.message))
                })?;
                Ok(weights.into_iter().zip(missing).map(|(w, e)| lease(from_handle(&w), e)).collect())
            });
            Ok((have, pending))
        })
    }
}

/// How the manager works beside its budget.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// Fill the budget after startup while there is nothing else to do ([`warm_step`]).
    pub warmup: bool,
    /// Most bytes of guessed experts read or being read and not used yet (0: guesses are ignored, and no
    /// read-ahead thread starts). About two layers' reads: one layer's guess, and the one before it not
    /// yet passed over.
    pub prefetch_cap: usize,
}

/// Starts the manager thread over `index` with `reader`. Resident experts live in a host arena that
/// `backend` allocates (the budget's worth of slots, registered with the reader where it can be); reads
/// past it (leased experts over the budget) land in buffers of their own, as do all of them when the
/// arena cannot be allocated.
/// With `opts.warmup`, the manager fills its budget after startup while it has nothing else to do
/// ([`warm_step`]): a command that arrives is served before the next warm-up read. Guesses
/// ([`ResidencyCommand::Prefetch`]) go to a read-ahead thread with a reader of its own
/// ([`start_guesser`]), so their reads run while the manager serves requests.
pub fn spawn(
    index: ExpertIndex,
    reader: Box<dyn Reader>,
    (budget, policy): (Budget, Policy),
    opts: Options,
    backend: &dyn osprey_models::backend::Backend,
) -> ResidentSet {
    let (tx, rx) = mpsc::unbounded_channel::<ResidencyCommand>();
    let stall_nanos = Arc::new(AtomicU64::new(0));
    let slots = slots_for(&index, budget);
    let mut reader = reader;
    let tier = host_tier(&index, (budget, opts.prefetch_cap), backend, reader.as_mut());
    let table = ResidencyTable::new(index.experts.len(), budget, policy);
    let warm = opts.warmup.then(|| Warmup { next_layer: 0, started: Instant::now() });
    let stall = stall_nanos.clone();
    let guesser = match opts.prefetch_cap {
        0 => None,
        _ => match open_reader(&index.files, Some(reader.kind())) {
            Ok(r) => Some(start_guesser(index.clone(), r, tier.as_ref().map(|t| t.arena.clone()))),
            Err(e) => {
                tracing::warn!(error = %e, "no reader for guesses; they are ignored");
                None
            }
        },
    };
    let m = Manager { index, tier, reader, table, rx, guesser, warm, passed: None, stall, opts };
    std::thread::Builder::new()
        .name("osprey-experts".into())
        .spawn(move || m.run())
        .expect("spawn expert residency thread");
    ResidentSet { tx, stall_nanos, slots }
}

/// The manager thread's state.
struct Manager {
    index: ExpertIndex,
    // Declared before the reader so it drops after it: the ring unregisters the arena first.
    tier: Option<HostTier>,
    reader: Box<dyn Reader>,
    table: ResidencyTable,
    rx: mpsc::UnboundedReceiver<ResidencyCommand>,
    /// The read-ahead thread (with `opts.prefetch_cap` > 0).
    guesser: Option<Guesser>,
    warm: Option<Warmup>,
    /// The layer whose `Hits` came last: its step is over unless its `Need` comes next.
    passed: Option<usize>,
    stall: Arc<AtomicU64>,
    opts: Options,
}

impl Manager {
    fn run(mut self) {
        while let Some(cmd) = self.next_command() {
            self.land_guesses(false);
            // A layer's step is its `Hits` (when some routed experts sat in slots) and its `Need` (when
            // some did not), sent back to back: once both are in, its unused guesses were wrong.
            if let Some(l) = self.passed.take() {
                if !matches!(&cmd, ResidencyCommand::Need { layer, .. } if *layer == l) {
                    self.table.pass_over(l);
                }
            }
            self.handle(cmd);
        }
    }

    /// The next command; while warming up, a warm-up read whenever nothing waits. `None` once every sender
    /// is gone.
    fn next_command(&mut self) -> Option<ResidencyCommand> {
        loop {
            let Some(w) = self.warm.as_mut() else { return self.rx.blocking_recv() };
            match self.rx.try_recv() {
                Ok(cmd) => return Some(cmd),
                Err(mpsc::error::TryRecvError::Disconnected) => return None,
                Err(mpsc::error::TryRecvError::Empty) => {
                    if !warm_step(&self.index, (self.reader.as_mut(), self.tier.as_ref()), &mut self.table, w) {
                        let secs = w.started.elapsed().as_secs_f64();
                        tracing::info!(
                            experts = self.table.len(),
                            bytes = self.table.used(),
                            secs,
                            "experts warmed up"
                        );
                        self.warm = None;
                    }
                }
            }
        }
    }

    fn handle(&mut self, cmd: ResidencyCommand) {
        match cmd {
            ResidencyCommand::Need { layer, experts, span, resident, reply } => {
                let _in = span.enter();
                self.await_guesses(layer, &experts);
                let (index, table) = (&self.index, &mut self.table);
                need(index, (self.reader.as_mut(), self.tier.as_ref()), table, layer, &experts, resident, reply);
                // The layer had its step: its guesses not taken were wrong.
                self.table.pass_over(layer);
            }
            ResidencyCommand::Prefetch { layer, experts } => self.ask(layer, &experts),
            ResidencyCommand::Hits { layer, experts } => {
                experts.iter().for_each(|&e| self.table.hit(layer, e));
                self.passed = Some(layer);
            }
            ResidencyCommand::Release { layer, expert } => self.table.release(layer, expert),
            ResidencyCommand::Stats { reply } => {
                let _ = reply.send(self.stats());
            }
        }
    }

    /// Hands the guessed `experts` of `layer` that are neither held nor being read to the read-ahead
    /// thread, in order, while what guesses hold or read stays within the cap; counts the rest skipped.
    fn ask(&mut self, layer: usize, experts: &[usize]) {
        let Some(g) = self.guesser.as_mut() else { return };
        let (index, table) = (&self.index, &mut self.table);
        let valid = |e: usize| layer < index.experts.len() && e < index.experts[layer].len();
        for &e in experts {
            if !valid(e) || table.contains(layer, e) || g.inflight.contains_key(&(layer, e)) {
                continue;
            }
            let fp = index.expert_footprint(layer, e);
            let reading: usize = g.inflight.values().sum();
            if table.guess_bytes() + reading + fp > self.opts.prefetch_cap
                || g.jobs.send((layer, e, table.steps(layer))).is_err()
            {
                table.prefetch.skipped += 1;
                continue;
            }
            g.inflight.insert((layer, e), fp);
        }
    }

    /// Takes in the guesses that have landed (`wait`: blocks for one first).
    fn land_guesses(&mut self, wait: bool) {
        let Some(g) = self.guesser.as_mut() else { return };
        let first = match wait.then(|| g.landed.recv()) {
            Some(Ok(l)) => Some(l),
            Some(Err(_)) => {
                // The read-ahead thread is gone: what it was reading will not come.
                self.table.prefetch.skipped += g.inflight.len() as u64;
                g.inflight.clear();
                None
            }
            None => None,
        };
        let landed: Vec<Landed> = first.into_iter().chain(g.landed.try_iter()).collect();
        for l in landed {
            g.inflight.remove(&(l.layer, l.expert));
            let (table, key) = (&mut self.table, (l.layer, l.expert));
            match l.read {
                Ok((w, need)) if !table.contains(key.0, key.1) => {
                    let st = &mut table.stats[key.0];
                    (st.bytes_read, st.read_secs, st.batches) =
                        (st.bytes_read + need as u64, st.read_secs + l.secs, st.batches + 1);
                    table.insert(key.0, key.1, Arc::new(w), need);
                    // Marked before its lease goes, so the budget cannot evict it before its layer comes.
                    table.guessed(key.0, key.1);
                    table.release(key.0, key.1);
                    if table.steps(key.0) != l.step {
                        table.late_guess(key.0, key.1);
                    }
                }
                Ok(_) => table.prefetch.skipped += 1,
                Err(e) => {
                    tracing::debug!(layer = key.0, expert = key.1, error = %e, "guessed expert not read");
                    table.prefetch.skipped += 1;
                }
            }
        }
    }

    /// Before a request of `layer` is served: waits for the guesses of its experts still being read (they
    /// are the quickest way to them), so none is read twice.
    fn await_guesses(&mut self, layer: usize, experts: &[usize]) {
        while let Some(g) = self.guesser.as_ref() {
            if !experts.iter().any(|&e| g.inflight.contains_key(&(layer, e))) {
                return;
            }
            self.land_guesses(true);
        }
    }

    fn stats(&self) -> ResidencyStats {
        let (t, tier) = (&self.table, self.tier.as_ref());
        ResidencyStats {
            layers: t.stats.clone(),
            resident_bytes: t.used() as u64,
            resident_experts: t.len() as u64,
            evictions: t.evictions,
            stall_secs: self.stall.load(Ordering::Relaxed) as f64 / 1e9,
            reader: format!("{:?}", self.reader.kind()),
            experts: t.expert_maps(&self.index.experts.iter().map(Vec::len).collect::<Vec<_>>()),
            arena_slots: tier.map_or(0, |t| t.arena.slots() as u64),
            arena_used: tier.map_or(0, |t| (t.arena.slots() - t.arena.free()) as u64),
            arena_registered: tier.is_some_and(|t| t.registered),
            prefetch: t.prefetch,
        }
    }
}

/// Where a warm-up stands.
#[derive(Debug)]
struct Warmup {
    /// The layer the next warm-up read is for (layers take turns, so a byte budget fills evenly).
    next_layer: usize,
    started: Instant,
}

/// One warm-up read: the next layer with room gets experts it does not hold (all that fit, with a
/// per-layer budget; one, with a byte budget, so every layer gets its share), read in one batch and
/// left unleased in the table. Never evicts: false once nothing more fits, or a read failed (the
/// warm-up ends; requests read what they need as before).
fn warm_step(
    index: &ExpertIndex,
    (reader, tier): (&mut dyn Reader, Option<&HostTier>),
    table: &mut ResidencyTable,
    w: &mut Warmup,
) -> bool {
    let layers = index.experts.len();
    for _ in 0..layers {
        let layer = w.next_layer;
        w.next_layer = (layer + 1) % layers;
        let most = if matches!(table.budget, Budget::Bytes(_)) { 1 } else { usize::MAX };
        let experts = table.room_for(layer, index.experts[layer].len(), &|e| index.expert_footprint(layer, e), most);
        if experts.is_empty() {
            continue;
        }
        return match read_missing(index, (reader, tier), table, layer, &experts) {
            Ok(_) => {
                experts.iter().for_each(|&e| table.release(layer, e));
                true
            }
            Err(e) => {
                tracing::warn!(layer, error = %e.message, "expert warm-up stopped");
                false
            }
        };
    }
    false
}

/// The RAM tier's arena: slots of the largest expert's read footprint, as many as the budget holds plus
/// `extra` bytes' worth (the guesses' cap: guesses land in the arena too, in memory faulted in once),
/// never more than there are experts, registered with `reader` when it can be.
fn host_tier(
    index: &ExpertIndex,
    (budget, extra): (Budget, usize),
    backend: &dyn osprey_models::backend::Backend,
    reader: &mut dyn Reader,
) -> Option<HostTier> {
    let all: Vec<(usize, usize)> =
        (0..index.experts.len()).flat_map(|l| (0..index.experts[l].len()).map(move |e| (l, e))).collect();
    let stride = all.iter().map(|&(l, e)| index.expert_footprint(l, e)).max()?;
    let layers = index.experts.iter().filter(|l| !l.is_empty()).count();
    let slots = match budget {
        Budget::PerLayer(n) => n.max(1) * layers,
        Budget::Bytes(b) => (b / stride).max(1),
    };
    let slots = (slots + extra.div_ceil(stride)).min(all.len());
    let mem = match backend.alloc_host_arena(slots * stride) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, slots, stride, "no host arena for experts; reading into buffers of their own");
            return None;
        }
    };
    let arena = Arena::new(mem, stride);
    // SAFETY: the arena outlives the reader's use of it: both move into the manager thread, where the
    // reader is dropped first (and every slot handle keeps the arena alive besides).
    let registered = unsafe { reader.register(arena.base(), stride, arena.slots()) };
    tracing::info!(slots = arena.slots(), stride, registered, "expert host arena");
    Some(HostTier { arena, registered })
}

/// The arena resident experts are read into, and whether the reader registered it.
#[derive(Debug)]
struct HostTier {
    arena: Arc<Arena>,
    registered: bool,
}

/// Backend slots per MoE layer under `budget`: the experts per layer, or the bytes shared evenly by the
/// layers with experts, at the RAM an expert takes once read (at least one: a step runs in waves of one
/// then).
pub fn slots_for(index: &ExpertIndex, budget: Budget) -> usize {
    match budget {
        Budget::PerLayer(n) => n.max(1),
        Budget::Bytes(b) => {
            let layers = index.experts.iter().filter(|l| !l.is_empty()).count().max(1);
            let largest = (0..index.experts.len())
                .flat_map(|l| (0..index.experts[l].len()).map(move |e| (l, e)))
                .map(|(l, e)| index.expert_footprint(l, e))
                .max()
                .unwrap_or(1)
                .max(1);
            (b / (layers * largest)).max(1)
        }
    }
}

type Reply<T> = oneshot::Sender<Result<T, RequestError>>;

fn engine_error(message: String) -> RequestError {
    RequestError::new(ErrorCode::EngineError, message)
}

/// Leased expert weights as they travel in [`ResidencyCommand`] (an opaque handle: the protocol crate
/// knows no model types).
#[derive(Debug)]
struct Leased(Arc<ExpertWeights>);

impl osprey_protocol::Opaque for Leased {
    fn bytes(&self) -> usize {
        self.0.gate.bytes() + self.0.up.bytes() + self.0.down.bytes()
    }
}

fn to_handle(w: Arc<ExpertWeights>) -> Handle {
    Arc::new(Leased(w))
}

fn from_handle(h: &Handle) -> Arc<ExpertWeights> {
    osprey_protocol::downcast::<Leased>(h)
        .expect("the residency manager answers with its own handles: this is a bug")
        .0
        .clone()
}

/// Serves one `Need`: leases and answers the hits at once (the runner computes them meanwhile), then
/// reads all misses of the layer in one batch and answers them.
fn need(
    index: &ExpertIndex,
    (reader, tier): (&mut dyn Reader, Option<&HostTier>),
    table: &mut ResidencyTable,
    layer: usize,
    experts: &[usize],
    resident: Reply<Vec<Option<Handle>>>,
    reply: Reply<Vec<Handle>>,
) {
    if layer >= index.experts.len() || experts.iter().any(|&e| e >= index.experts[layer].len()) {
        let _ = resident.send(Err(engine_error(format!("no such expert in layer {layer}"))));
        return;
    }
    let have: Vec<Option<Handle>> = experts.iter().map(|&e| table.lease(layer, e).map(to_handle)).collect();
    let (hits, missing): (Vec<usize>, Vec<usize>) = (0..experts.len()).partition(|&i| have[i].is_some());
    if resident.send(Ok(have)).is_err() {
        // The requester is gone: give its leases back and read nothing.
        hits.iter().for_each(|&i| table.release(layer, experts[i]));
        return;
    }
    tracing::debug!(layer, hits = hits.len(), misses = missing.len(), "experts needed");
    if missing.is_empty() {
        let _ = reply.send(Ok(Vec::new()));
        return;
    }
    let read =
        read_missing(index, (reader, tier), table, layer, &missing.iter().map(|&i| experts[i]).collect::<Vec<_>>())
            .map(|ws| ws.into_iter().map(to_handle).collect());
    if let Err(Ok(unclaimed)) = reply.send(read) {
        // Nobody took the experts just read: release their leases (they stay cached).
        drop(unclaimed);
        missing.iter().for_each(|&i| table.release(layer, experts[i]));
    }
}

/// Where one expert's reads land: an arena slot (its ranges' windows back to back, at these offsets),
/// or buffers of their own.
enum Landing {
    Slot(ArenaSlot, Vec<usize>),
    Bufs(Vec<AlignedBuf>),
}

/// Reads `experts` of `layer` in one batch straight into arena slots (buffers of their own when the arena
/// is full), inserts them leased; on any failure releases what it inserted.
fn read_missing(
    index: &ExpertIndex,
    (reader, tier): (&mut dyn Reader, Option<&HostTier>),
    table: &mut ResidencyTable,
    layer: usize,
    experts: &[usize],
) -> Result<Vec<Arc<ExpertWeights>>, RequestError> {
    let items: Vec<(usize, usize)> = experts.iter().map(|&e| (layer, e)).collect();
    let (read, secs) = read_experts(index, reader, tier, &items);
    let st = &mut table.stats[layer];
    st.read_secs += secs;
    st.batches += 1;
    let mut out = Vec::with_capacity(experts.len());
    let mut first_err = None;
    for (&e, r) in experts.iter().zip(read) {
        match r {
            Ok((w, need)) => {
                table.stats[layer].bytes_read += need as u64;
                out.push((e, table.insert(layer, e, Arc::new(w), need)));
            }
            Err(err) => first_err = first_err.or(Some(err)),
        }
    }
    if let Some(err) = first_err {
        out.iter().for_each(|&(e, _)| table.release(layer, e));
        return Err(engine_error(err));
    }
    Ok(out.into_iter().map(|(_, w)| w).collect())
}

/// Reads the experts `items` names ((layer, expert) pairs) in one batch, into arena slots where `tier`
/// has free ones, else buffers of their own: per item its weights and the bytes it takes, or why not;
/// and the batch's seconds.
#[allow(clippy::type_complexity)]
fn read_experts(
    index: &ExpertIndex,
    reader: &mut dyn Reader,
    tier: Option<&HostTier>,
    items: &[(usize, usize)],
) -> (Vec<Result<(ExpertWeights, usize), String>>, f64) {
    let (mut reqs, mut dests, mut landings, mut counts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for &(layer, e) in items {
        let r = index.reads(layer, e);
        let windows: Vec<usize> = r.iter().map(|q| window(q.offset, q.len).2).collect();
        let need: usize = windows.iter().sum();
        let slot = tier.filter(|t| need <= t.arena.stride()).and_then(|t| t.arena.take().map(|s| (s, t.registered)));
        let landing = match slot {
            Some((mut slot, registered)) => {
                let (base, fixed) = (slot.as_mut_ptr(), registered.then_some(slot.index() as u16));
                let mut offsets = Vec::with_capacity(windows.len());
                let mut off = 0;
                for &w in &windows {
                    // SAFETY: `off + w <= need <= stride`: inside the slot.
                    dests.push(Dest { ptr: unsafe { base.add(off) }, cap: w, fixed });
                    offsets.push(off);
                    off += w;
                }
                Landing::Slot(slot, offsets)
            }
            None => {
                let mut bufs: Vec<AlignedBuf> = windows.iter().map(|&w| AlignedBuf::new(w)).collect();
                dests.extend(bufs.iter_mut().map(|b| Dest { ptr: b.as_mut_ptr(), cap: b.len(), fixed: None }));
                Landing::Bufs(bufs)
            }
        };
        counts.push((r.len(), need));
        reqs.extend(r);
        landings.push(landing);
    }
    let t0 = Instant::now();
    // SAFETY: every destination is a slot or buffer owned by `landings`, each window inside its own,
    // untouched by anyone else until the reads complete.
    let results = unsafe { reader.read_into(&reqs, &dests) };
    let secs = t0.elapsed().as_secs_f64();
    let mut results = results.into_iter();
    let mut out = Vec::with_capacity(items.len());
    for ((&(layer, e), (n, need)), landing) in items.iter().zip(counts).zip(landings) {
        let ats: Result<Vec<usize>, _> = (&mut results).take(n).collect();
        out.push(match ats {
            Ok(ats) => {
                let parts: Vec<(Arc<dyn ByteSource>, usize)> = match landing {
                    Landing::Slot(slot, offsets) => {
                        let buf: Arc<dyn ByteSource> = Arc::new(slot);
                        offsets.into_iter().zip(ats).map(|(o, at)| (buf.clone(), o + at)).collect()
                    }
                    Landing::Bufs(bufs) => {
                        bufs.into_iter().zip(ats).map(|(b, at)| (Arc::new(b) as Arc<dyn ByteSource>, at)).collect()
                    }
                };
                Ok((index.assemble_parts(layer, e, parts), need))
            }
            Err(err) => Err(err.to_string()),
        });
    }
    (out, secs)
}

/// A guessed expert read by the read-ahead thread.
struct Landed {
    layer: usize,
    expert: usize,
    /// The layer's step count when the guess was asked for (a guess landing after its layer's step is
    /// wasted at once).
    step: u64,
    read: Result<(ExpertWeights, usize), String>,
    secs: f64,
}

/// The read-ahead thread's two ends, as the manager holds them.
struct Guesser {
    jobs: std::sync::mpsc::Sender<(usize, usize, u64)>,
    landed: std::sync::mpsc::Receiver<Landed>,
    /// Guesses asked for and not landed: their bytes.
    inflight: std::collections::HashMap<(usize, usize), usize>,
}

/// Starts the read-ahead thread: it reads the guesses the manager hands it with a reader of its own,
/// every guess queued so far in one batch (one io_uring submission), into free slots of the manager's
/// arena (`arena`; buffers of their own past it), and sends each back. The manager never waits for it
/// except where a request needs an expert it is reading.
fn start_guesser(index: ExpertIndex, mut reader: Box<dyn Reader>, arena: Option<Arc<Arena>>) -> Guesser {
    let (jobs, job_rx) = std::sync::mpsc::channel::<(usize, usize, u64)>();
    let (landed_tx, landed) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new().name("osprey-guesses".into()).spawn(move || {
        while let Ok(first) = job_rx.recv() {
            let mut batch = vec![first];
            batch.extend(job_rx.try_iter());
            let items: Vec<(usize, usize)> = batch.iter().map(|&(l, e, _)| (l, e)).collect();
            // Its own ring did not register the arena: plain reads into the slots.
            let tier = arena.as_ref().map(|a| HostTier { arena: a.clone(), registered: false });
            let (read, secs) = read_experts(&index, reader.as_mut(), tier.as_ref(), &items);
            let each = secs / batch.len() as f64;
            for ((layer, expert, step), read) in batch.into_iter().zip(read) {
                if landed_tx.send(Landed { layer, expert, step, read, secs: each }).is_err() {
                    return;
                }
            }
        }
    });
    if let Err(e) = spawned {
        tracing::warn!(error = %e, "no read-ahead thread; guesses are ignored");
    }
    Guesser { jobs, landed, inflight: std::collections::HashMap::new() }
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
