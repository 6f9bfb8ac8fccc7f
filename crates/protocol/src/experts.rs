//! The expert residency manager's counters (experts streamed from disk under a RAM budget), as the server
//! reads them.

use tokio::sync::oneshot;

/// Counters of one layer.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LayerStats {
    /// Expert accesses served from RAM.
    pub hits: u64,
    /// Expert accesses read from disk.
    pub misses: u64,
    /// Bytes read.
    pub bytes_read: u64,
    /// Seconds spent in read batches.
    pub read_secs: f64,
    /// Read batches.
    pub batches: u64,
}

/// Where the expert residency manager's counters are asked for: the one thing about experts that crosses
/// crates (the manager's own messages are private to `osprey-experts`, where both their ends are).
pub trait ExpertStats: std::fmt::Debug + Send + Sync {
    /// A snapshot of the counters, answered on the receiver; `None` once the manager is gone.
    fn query(&self) -> Option<oneshot::Receiver<ResidencyStats>>;

    /// Whether the manager is gone (it panicked or stopped: its inbox closed).
    fn is_closed(&self) -> bool;

    /// Resolves once the manager is gone.
    fn closed(&self) -> std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send + '_>>;
}

/// A snapshot of the counters.
#[derive(Clone, Debug, Default)]
pub struct ResidencyStats {
    /// Per layer.
    pub layers: Vec<LayerStats>,
    /// Bytes of experts in RAM.
    pub resident_bytes: u64,
    /// The most bytes of experts held in RAM at once since start, guesses being read included (bounded by
    /// the budget plus the guesses' cap, as long as no step leases more than the budget).
    pub peak_bytes: u64,
    /// Experts in RAM.
    pub resident_experts: u64,
    /// Evictions.
    pub evictions: u64,
    /// Seconds the runner waited for experts after computing the shared expert.
    pub stall_secs: f64,
    /// Reader in use.
    pub reader: String,
    /// Per layer, per expert: which are in RAM and their hit and miss counts (the engine view's heat map).
    pub experts: Vec<ExpertMap>,
    /// Slots of the host arena experts are read into (0: none could be allocated).
    pub arena_slots: u64,
    /// Arena slots holding an expert.
    pub arena_used: u64,
    /// Whether the reader registered the arena (io_uring fixed buffers).
    pub arena_registered: bool,
    /// Read-ahead of guessed experts.
    pub prefetch: PrefetchStats,
}

/// What reading guessed experts ahead did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefetchStats {
    /// Experts read because they were guessed.
    pub issued: u64,
    /// Of those, asked for (or found in a slot) by their layer before they were evicted.
    pub used: u64,
    /// Of those, passed over by their layer's next step (their bytes were read for nothing).
    pub wasted: u64,
    /// Bytes read for guesses.
    pub bytes_read: u64,
    /// Bytes of the guesses that were wasted.
    pub wasted_bytes: u64,
    /// Guesses dropped: already held, over the cap, or given up because a request was waiting.
    pub skipped: u64,
    /// Guesses not read because their measured precision was below the break-even of this disk (what a
    /// wrong read costs the steps against what a right one saves).
    pub gated: u64,
    /// Guesses dropped before their read was submitted, because their layer's step came first (it reads
    /// what it needs itself).
    pub cancelled: u64,
    /// Microseconds demand reads waited behind a guess being read when they came (a read at the device
    /// cannot be recalled; nothing more is submitted while a demand read is under way).
    pub demand_delay_us: u64,
}

/// The experts of one layer as the residency manager sees them.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ExpertMap {
    /// Experts in the layer.
    pub count: usize,
    /// Ids of the experts held in RAM, ascending.
    pub resident: Vec<u32>,
    /// Accesses served from RAM, per expert id.
    pub hits: Vec<u64>,
    /// Accesses read from disk, per expert id.
    pub misses: Vec<u64>,
}
