//! The residency table (synchronous core) and the residency-manager actor.
//!
//! The table holds experts read from disk under a RAM budget (total bytes, or experts per layer). An
//! expert in use is leased and never evicted; eviction picks among unleased experts by policy (LRU, or
//! LFU with exponential decay). The actor thread owns the table and the reader: a layer's `Step` counts
//! the experts the step found in device slots (hits, made recent, no lease), serves the resident ones it
//! needs at once and reads all of that layer's misses in one batch. The runner's side ([`ResidentSet`],
//! an `ExpertSource`) sends `Step` and returns a ticket, so the MoE block computes the shared expert while
//! the reads are in flight; each handle carries a lease whose drop sends `Release`. Every message names
//! experts by `ExpertKey`, the form the router's ids take in the MoE block and keep to the disk read and
//! the device slot; the messages are private to this crate (only [`ExpertStats`] crosses crates).
//!
//! Inside: `table.rs` (the synchronous core), `read.rs` (the arena and batch reads), `guesser.rs` (the
//! read-ahead thread); the actor and the runner's side here.

mod guesser;
mod read;
mod table;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

use osprey_models::layers::moe::{Guess, LayerStep};
use osprey_models::{ExpertHandle, ExpertKey, ExpertSource, ExpertTicket, ExpertWeights, PendingExperts};
use osprey_protocol::{ErrorCode, RequestError};
use tokio::sync::{mpsc, oneshot};

pub use osprey_protocol::experts::{ExpertMap, ExpertStats, LayerStats, PrefetchStats, ResidencyStats};
pub use table::{Budget, Policy, ResidencyTable};

use crate::reader::{open_reader, Reader};
use crate::store::ExpertIndex;
use guesser::{start_guesser, Guesser, Job, Landed};
use read::{host_tier, read_missing, HostTier};

type Weights = Arc<ExpertWeights>;

/// Messages between the runner-side source ([`ResidentSet`]) and the manager thread: private, as both
/// ends are in this crate; only the counters cross crates ([`ExpertStats`]).
#[derive(Debug)]
enum Command {
    /// One layer's step ([`LayerStep`]): the slot hits are counted, the hits among `need` leased and
    /// answered at once, its misses read in one batch.
    Step {
        need: Vec<ExpertKey>,
        in_slots: Vec<ExpertKey>,
        /// The runner's step span (it names the sequences of the step).
        span: tracing::Span,
        /// Answered before any read: per needed expert, its weights if resident (leased), or `None` if
        /// it is being read; an error for a step naming no such expert.
        resident: oneshot::Sender<Result<Vec<Option<Weights>>, RequestError>>,
        /// The experts `resident` left out, in order, once read (leased), or the read error.
        reply: oneshot::Sender<Result<Vec<Weights>, RequestError>>,
    },
    /// A guess ([`Guess`]): the manager queues the experts of `read` it does not hold whose `confidence`
    /// beats its break-even, up to its cap, for the read-ahead thread, and answers, per expert of
    /// `lease`, its weights leased if held now (no access counted).
    Guess {
        read: Vec<ExpertKey>,
        confidence: Vec<f32>,
        lease: Vec<ExpertKey>,
        reply: Option<oneshot::Sender<Vec<Option<Weights>>>>,
    },
    /// A lease was dropped.
    Release(ExpertKey),
    /// Counters.
    Stats(oneshot::Sender<ResidencyStats>),
}

#[derive(Debug)]
struct Lease {
    tx: mpsc::UnboundedSender<Command>,
    key: ExpertKey,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let _ = self.tx.send(Command::Release(self.key));
    }
}

/// The expert `key` leased to the runner: its drop sends `Release` on `tx`.
fn leased(tx: &mpsc::UnboundedSender<Command>, key: ExpertKey, w: Weights) -> ExpertHandle {
    ExpertHandle::new(key, w, Some(Box::new(Lease { tx: tx.clone(), key })))
}

/// The runner's `ExpertSource`: asks the manager thread, returns tickets.
#[derive(Debug, Clone)]
pub struct ResidentSet {
    tx: mpsc::UnboundedSender<Command>,
    stall_nanos: Arc<AtomicU64>,
    /// Backend slots per layer the budget allows (slots hold leases, so they count against it).
    slots: usize,
}

impl ExpertStats for ResidentSet {
    fn query(&self) -> Option<oneshot::Receiver<ResidencyStats>> {
        let (reply, rx) = oneshot::channel();
        self.tx.send(Command::Stats(reply)).ok().map(|_| rx)
    }

    fn is_closed(&self) -> bool {
        self.tx.is_closed()
    }

    fn closed(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>> {
        Box::pin(self.tx.closed())
    }
}

impl ResidentSet {
    /// The counters now, waited for (`None`: the manager is gone). Not from inside an async runtime.
    pub fn stats(&self) -> Option<ResidencyStats> {
        self.query()?.blocking_recv().ok()
    }
}

impl ExpertSource for ResidentSet {
    fn slots_per_layer(&self) -> Option<usize> {
        Some(self.slots)
    }

    fn guess(&self, guess: Guess<'_>) -> PendingExperts {
        let (reply, rx) = oneshot::channel();
        let lease = guess.lease.to_vec();
        let reply = (!lease.is_empty()).then_some(reply);
        let cmd = Command::Guess {
            read: guess.read.to_vec(),
            confidence: guess.confidence.to_vec(),
            lease: lease.clone(),
            reply,
        };
        if self.tx.send(cmd).is_err() || lease.is_empty() {
            return PendingExperts::none();
        }
        let tx = self.tx.clone();
        PendingExperts::new(move || {
            // A guess is optional: a manager gone answers none (the next request reports it).
            let got = rx.blocking_recv().unwrap_or_default();
            Ok(got.into_iter().zip(lease).filter_map(|(w, key)| w.map(|w| leased(&tx, key, w))).collect())
        })
    }

    fn request(&self, step: LayerStep<'_>) -> ExpertTicket {
        let (resident_tx, resident_rx) = oneshot::channel();
        let (reply, rx) = oneshot::channel();
        let need = step.need.to_vec();
        let sent = self
            .tx
            .send(Command::Step {
                need: need.clone(),
                in_slots: step.in_slots.to_vec(),
                span: tracing::Span::current(),
                resident: resident_tx,
                reply,
            })
            .is_ok();
        let (tx, stall) = (self.tx.clone(), self.stall_nanos.clone());
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
            let t0 = Instant::now();
            let have = resident_rx
                .blocking_recv()
                .map_err(|_| died())?
                .map_err(|e| osprey_models::Error::Engine(e.message))?;
            stall.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
            let missing: Vec<ExpertKey> =
                need.iter().zip(&have).filter(|(_, w)| w.is_none()).map(|(&k, _)| k).collect();
            let have = have.into_iter().zip(&need).map(|(w, &k)| w.map(|w| leased(&tx, k, w))).collect();
            let pending = PendingExperts::new(move || {
                let t0 = Instant::now();
                let got = rx.blocking_recv().map_err(|_| died())?;
                stall.fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                let weights = got.map_err(|e| {
                    let layer = missing.first().map_or(0, |k| k.layer());
                    osprey_models::Error::Engine(format!("reading experts of layer {layer} failed: {}", e.message))
                })?;
                Ok(weights.into_iter().zip(missing).map(|(w, k)| leased(&tx, k, w)).collect())
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

impl Options {
    /// The guesses' cap for a model of `top_k` experts per token guessed with `margin` more, `depth` layers
    /// ahead: `depth + 1` layers' guesses of the largest expert (those ahead, and the one before them
    /// not yet passed over; two layers at a depth of 1).
    pub fn prefetch_cap_for(index: &ExpertIndex, top_k: usize, margin: usize, depth: usize) -> usize {
        (depth.max(1) + 1) * (top_k + margin) * index.largest_footprint().unwrap_or(0)
    }
}

/// Starts the manager thread over `index` with `reader`. Resident experts live in a host arena that
/// `backend` allocates (the budget's worth of slots, registered with the reader where it can be); reads
/// past it (leased experts over the budget) land in buffers of their own, as do all of them when the
/// arena cannot be allocated.
/// With `opts.warmup`, the manager fills its budget after startup while it has nothing else to do
/// ([`warm_step`]): a command that arrives is served before the next warm-up read. Guesses
/// ([`Guess`]) go to a read-ahead thread with a reader of its own
/// ([`start_guesser`]), so their reads run while the manager serves requests.
pub fn spawn(
    index: ExpertIndex,
    reader: Box<dyn Reader>,
    (budget, policy): (Budget, Policy),
    opts: Options,
    backend: &dyn osprey_models::backend::Backend,
) -> ResidentSet {
    let (tx, rx) = mpsc::unbounded_channel::<Command>();
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
    let cost = GuessCost::default();
    let m = Manager { index, tier, reader, table, rx, guesser, warm, peak: 0, stall, opts, cost };
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
    rx: mpsc::UnboundedReceiver<Command>,
    /// The read-ahead thread (with `opts.prefetch_cap` > 0).
    guesser: Option<Guesser>,
    warm: Option<Warmup>,
    /// The most bytes held at once: the table's and the guesses' being read.
    peak: usize,
    stall: Arc<AtomicU64>,
    opts: Options,
    /// What guesses cost and save on this disk, as measured.
    cost: GuessCost,
}

/// What reading guesses costs against what it saves, measured as they are read: seconds demand reads
/// waited behind guesses being read, against the seconds of reads the used guesses took off the steps
/// (each used guess saves about the mean guess's read time). Both decay by [`GuessCost::KEEP`] a step, so
/// the break-even follows the disk and the load; a prior that does not decay is added to both, so once
/// nothing is read (every guess gated) the break-even returns to the prior's and guesses are tried again.
#[derive(Debug, Clone, Copy, Default)]
struct GuessCost {
    delay: f64,
    saved: f64,
    /// Guesses read and the seconds their reads took (for the mean).
    reads: f64,
    read_secs: f64,
    /// `prefetch.used` when last counted.
    used_seen: u64,
}

impl GuessCost {
    /// The prior: as if guesses had saved this many seconds (a few guesses' worth) and a wrong one had
    /// cost a quarter of what a right one saves (break-even 0.2 until measured).
    const PRIOR: f64 = 0.01;
    const PRIOR_COST: f64 = 0.25;
    /// Share of the sums kept at each step (a time constant of a thousand layer steps).
    const KEEP: f64 = 0.999;

    /// A step came: the guesses used since the last one are counted saved.
    fn step(&mut self, used: u64) {
        let mean = if self.reads > 0.0 { self.read_secs / self.reads } else { 0.0 };
        self.saved = self.saved * Self::KEEP + used.saturating_sub(self.used_seen) as f64 * mean;
        self.delay *= Self::KEEP;
        self.used_seen = used;
    }

    /// A guess was read in `secs` and made demand reads wait `delayed` seconds.
    fn read(&mut self, secs: f64, delayed: f64) {
        (self.reads, self.read_secs) = (self.reads * Self::KEEP + 1.0, self.read_secs * Self::KEEP + secs);
        self.delay += delayed;
    }

    /// The precision a guess must beat to be read: with `c` what a wrong read costs over what a right one
    /// saves, p·1 − (1 − p)·c > 0, so p > c / (1 + c).
    fn break_even(&self) -> f32 {
        let c = (self.delay + Self::PRIOR_COST * Self::PRIOR) / (self.saved + Self::PRIOR);
        (c / (1.0 + c)) as f32
    }
}

impl Manager {
    fn run(mut self) {
        io_priority();
        while let Some(cmd) = self.next_command() {
            self.land_guesses(false);
            self.handle(cmd);
            let reading: usize = self.guesser.as_ref().map_or(0, |g| g.inflight.values().sum());
            self.peak = self.peak.max(self.table.used() + reading);
        }
    }

    /// The next command; while warming up, a warm-up read whenever nothing waits. `None` once every sender
    /// is gone.
    fn next_command(&mut self) -> Option<Command> {
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

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Step { need, in_slots, span, resident, reply } => {
                let _in = span.enter();
                let Some(layer) = need.iter().chain(&in_slots).next().map(|k| k.layer()) else {
                    let _ = resident.send(Ok(Vec::new()));
                    return;
                };
                self.cost.step(self.table.prefetch.used);
                // Its guesses not submitted yet are dropped: the step reads what it needs itself.
                if let Some(g) = self.guesser.as_mut() {
                    self.table.prefetch.cancelled += g.cancel_layer(layer).len() as u64;
                    g.abandon_unless(layer, &need);
                }
                self.await_guesses(&need);
                in_slots.iter().for_each(|&k| self.table.hit(k));
                // While the misses are read the read-ahead thread submits nothing.
                let demand = self.guesser.as_ref().filter(|_| need.iter().any(|&k| !self.table.contains(k)));
                demand.inspect(|g| g.demand());
                let (index, table) = (&self.index, &mut self.table);
                need_experts(index, (self.reader.as_mut(), self.tier.as_ref()), table, (layer, &need), resident, reply);
                demand.inspect(|g| g.demand_done());
                // The layer had its step: its guesses not taken were wrong.
                if layer < self.index.experts.len() {
                    self.table.pass_over(layer);
                }
            }
            Command::Guess { read, confidence, lease, reply } => {
                self.ask(&read, &confidence);
                let Some(reply) = reply else { return };
                let held: Vec<Option<Weights>> =
                    lease.iter().map(|&k| self.index.has(k).then(|| self.table.lease_quiet(k)).flatten()).collect();
                if let Err(unclaimed) = reply.send(held) {
                    // Nobody took them: give the leases back.
                    for (_, &k) in unclaimed.iter().zip(&lease).filter(|(h, _)| h.is_some()) {
                        self.table.release(k);
                    }
                }
            }
            Command::Release(key) => self.table.release(key),
            Command::Stats(reply) => {
                let _ = reply.send(self.stats());
            }
        }
    }

    /// Hands the guessed experts that are neither held nor being read to the read-ahead thread, in order,
    /// while what guesses hold or read stays within the cap; counts the rest skipped.
    fn ask(&mut self, experts: &[ExpertKey], confidence: &[f32]) {
        let Some(g) = self.guesser.as_mut() else { return };
        let (index, table) = (&self.index, &mut self.table);
        let mut reading: usize = g.inflight.values().sum();
        let mut jobs: Vec<(Job, usize)> = Vec::new();
        let break_even = self.cost.break_even();
        for (i, &k) in experts.iter().enumerate() {
            if !index.has(k) || table.contains(k) || g.inflight.contains_key(&k) || jobs.iter().any(|(j, _)| j.key == k)
            {
                continue;
            }
            let sure = confidence.get(i).copied().unwrap_or(1.0);
            if sure <= break_even {
                table.prefetch.gated += 1;
                continue;
            }
            let fp = index.expert_footprint(k);
            if table.guess_bytes() + reading + fp > self.opts.prefetch_cap {
                table.prefetch.skipped += 1;
                continue;
            }
            reading += fp;
            jobs.push((Job { key: k, step: table.steps(k.layer()), sure }, fp));
        }
        g.push(jobs);
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
            g.inflight.remove(&l.key);
            let (table, key) = (&mut self.table, l.key);
            table.prefetch.demand_delay_us += (l.delayed * 1e6) as u64;
            self.cost.read(l.secs, l.delayed);
            match l.read {
                Ok((w, need)) if !table.contains(key) => {
                    let st = &mut table.stats[key.layer()];
                    (st.bytes_read, st.read_secs, st.batches) =
                        (st.bytes_read + need as u64, st.read_secs + l.secs, st.batches + 1);
                    table.insert(key, Arc::new(w), need);
                    // Marked before its lease goes, so the budget cannot evict it before its layer comes.
                    table.guessed(key);
                    table.release(key);
                    if table.steps(key.layer()) != l.step {
                        table.late_guess(key);
                    }
                }
                Ok(_) => table.prefetch.skipped += 1,
                Err(_) if l.abandoned => table.prefetch.cancelled += 1,
                Err(e) => {
                    tracing::debug!(?key, error = %e, "guessed expert not read");
                    table.prefetch.skipped += 1;
                }
            }
        }
    }

    /// Before a step is served: waits for the guesses of its experts still being read (they are the
    /// quickest way to them), so none is read twice.
    fn await_guesses(&mut self, experts: &[ExpertKey]) {
        while let Some(g) = self.guesser.as_ref() {
            if !experts.iter().any(|k| g.inflight.contains_key(k)) {
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
            peak_bytes: self.peak.max(t.used()) as u64,
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

/// The nice value the expert I/O threads (the manager and the read-ahead thread) ask for.
const IO_NICE: i32 = -10;

/// Raises this thread's CPU priority to [`IO_NICE`]: an expert I/O thread must get a core as soon as a
/// read completes or a step asks, while the kernels' pool keeps every core busy (it spins between
/// operations). A read-ahead thread that waits for the scheduler leaves the disk idle between its pieces:
/// on 2 cores decoding with 2 threads, the oracle's read-ahead ran 19.8 tok/s at nice 0 and 24.3 at -10
/// (docs/benchmarks.md, issue 55). A process without the right (`CAP_SYS_NICE` or `RLIMIT_NICE`) keeps
/// nice 0, logged; `--threads` one below the cores then leaves the I/O threads a core.
fn io_priority() {
    // SAFETY: plain syscalls about this thread.
    let raised = unsafe { libc::setpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t, IO_NICE) } == 0;
    if !raised {
        let e = std::io::Error::last_os_error();
        tracing::info!(error = %e, nice = IO_NICE, "expert I/O thread keeps its priority");
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
        let experts = table.room_for(layer, index.experts[layer].len(), &|k| index.expert_footprint(k), most);
        if experts.is_empty() {
            continue;
        }
        return match read_missing(index, (reader, tier), table, layer, &experts) {
            Ok(_) => {
                experts.iter().for_each(|&k| table.release(k));
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

/// Backend slots per MoE layer under `budget`: the experts per layer, or the bytes shared evenly by the
/// layers with experts, at the RAM an expert takes once read (at least one: a step runs in waves of one
/// then).
pub fn slots_for(index: &ExpertIndex, budget: Budget) -> usize {
    match budget {
        Budget::PerLayer(n) => n.max(1),
        Budget::Bytes(b) => {
            let layers = index.experts.iter().filter(|l| !l.is_empty()).count().max(1);
            let largest = index.largest_footprint().unwrap_or(1).max(1);
            (b / (layers * largest)).max(1)
        }
    }
}

type Reply<T> = oneshot::Sender<Result<T, RequestError>>;

fn engine_error(message: String) -> RequestError {
    RequestError::new(ErrorCode::EngineError, message)
}

/// Serves one step's needed experts (all of `layer`): leases and answers the hits at once (the runner
/// computes them meanwhile), then reads all misses in one batch and answers them.
fn need_experts(
    index: &ExpertIndex,
    (reader, tier): (&mut dyn Reader, Option<&HostTier>),
    table: &mut ResidencyTable,
    (layer, need): (usize, &[ExpertKey]),
    resident: Reply<Vec<Option<Weights>>>,
    reply: Reply<Vec<Weights>>,
) {
    if !need.iter().all(|&k| k.layer() == layer && index.has(k)) {
        let _ = resident.send(Err(engine_error(format!("no such expert in layer {layer}"))));
        return;
    }
    let have: Vec<Option<Weights>> = need.iter().map(|&k| table.lease(k)).collect();
    let hits: Vec<ExpertKey> = need.iter().zip(&have).filter(|(_, w)| w.is_some()).map(|(&k, _)| k).collect();
    let missing: Vec<ExpertKey> = need.iter().zip(&have).filter(|(_, w)| w.is_none()).map(|(&k, _)| k).collect();
    if resident.send(Ok(have)).is_err() {
        // The requester is gone: give its leases back and read nothing.
        hits.iter().for_each(|&k| table.release(k));
        return;
    }
    tracing::debug!(layer, hits = hits.len(), misses = missing.len(), "experts needed");
    if missing.is_empty() {
        let _ = reply.send(Ok(Vec::new()));
        return;
    }
    let read = read_missing(index, (reader, tier), table, layer, &missing);
    if let Err(Ok(unclaimed)) = reply.send(read) {
        // Nobody took the experts just read: release their leases (they stay cached).
        drop(unclaimed);
        missing.iter().for_each(|&k| table.release(k));
    }
}

#[cfg(test)]
mod tests {
    use super::GuessCost;

    /// Issue 55: the break-even starts at 0.2 (a wrong read assumed to cost a quarter of what a right one
    /// saves), falls as used guesses save read time without delaying demand reads, and rises towards 1
    /// when guesses delay demand reads more than they save: such guesses are switched off by themselves,
    /// and tried again once that evidence has faded.
    #[test]
    fn the_break_even_follows_what_guesses_cost_and_save() {
        let start = GuessCost::default();
        assert!((start.break_even() - 0.2).abs() < 1e-6, "{}", start.break_even());
        let mut paying = start;
        for used in 1..=50 {
            paying.read(0.002, 0.0);
            paying.step(used);
        }
        assert!(paying.break_even() < 0.05, "guesses that save and cost nothing: {}", paying.break_even());
        let mut costly = start;
        for used in 1..=50 {
            costly.read(0.002, 0.004);
            costly.step(used);
        }
        assert!(costly.break_even() > 0.6, "guesses that delay demand twice what they save: {}", costly.break_even());
        // Gated, nothing is read: the evidence fades and the break-even returns to the prior's.
        for _ in 0..20_000 {
            costly.step(50);
        }
        assert!((costly.break_even() - 0.2).abs() < 0.01, "tried again: {}", costly.break_even());
    }
}
