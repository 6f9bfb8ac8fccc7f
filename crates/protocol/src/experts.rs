//! Messages to the expert residency manager (experts streamed from disk under a RAM budget).

use tokio::sync::oneshot;

use crate::{Handle, RequestError};

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

/// Messages between the runner-side source and the manager thread.
#[derive(Debug)]
pub enum ResidencyCommand {
    /// Lease these experts of a layer (misses are read in one batch).
    Need {
        /// Layer.
        layer: usize,
        /// Experts.
        experts: Vec<usize>,
        /// The runner's step span (it names the sequences of the step).
        span: tracing::Span,
        /// Answered before any read: per requested expert, its weights if resident (leased), or `None`
        /// if it is being read; an error for a request naming no such expert.
        resident: oneshot::Sender<Result<Vec<Option<Handle>>, RequestError>>,
        /// The experts `resident` left out, in request order, once read (leased), or the read error.
        reply: oneshot::Sender<Result<Vec<Handle>, RequestError>>,
    },
    /// Experts a step found already in the backend's slots: counted as hits and made the most recent,
    /// not leased (the slots hold their leases).
    Hits {
        /// Layer.
        layer: usize,
        /// Experts.
        experts: Vec<usize>,
    },
    /// A guess: these experts of a layer will probably be needed soon (most wanted first). The manager
    /// reads the ones it does not hold, up to its cap, when nothing else waits; nothing is leased.
    Prefetch {
        /// Layer.
        layer: usize,
        /// Experts.
        experts: Vec<usize>,
    },
    /// Which of these experts of a layer are held now: each leased if resident, `None` if not. Nothing is
    /// read, and no access is counted (an upload of guesses into device slots ahead of their layer).
    Held {
        /// Layer.
        layer: usize,
        /// Experts.
        experts: Vec<usize>,
        /// Per expert, in order.
        reply: oneshot::Sender<Vec<Option<Handle>>>,
    },
    /// A lease was dropped.
    Release {
        /// Layer.
        layer: usize,
        /// Expert.
        expert: usize,
    },
    /// Counters.
    Stats {
        /// Per-layer counters, bytes held, evictions.
        reply: oneshot::Sender<ResidencyStats>,
    },
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
