//! Messages to the runner actor: a batch plan in, sampled tokens out.

use std::sync::Arc;

use tokio::sync::oneshot;

use crate::prefix::PrefixMatch;
use crate::sampling::SamplingParams;
use crate::tokenizer::PreparedPrompt;
use crate::{Handle, RequestError, SeqId};

/// What the runner needs to know about a sequence the first time it sees it.
#[derive(Clone, Debug)]
pub struct Admission {
    /// The prompt.
    pub prompt: Arc<PreparedPrompt>,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// A prefix-cache hit to restore before computing (pages + snapshot), if any.
    pub prefix: Option<PrefixMatch>,
    /// Tokens generated before the sequence was preempted (recomputed after the prompt; empty for a new
    /// sequence).
    pub generated: Vec<u32>,
}

/// One sequence's work in a step.
#[derive(Clone, Debug)]
pub struct PlanItem {
    /// The sequence.
    pub seq: SeqId,
    /// Present on the sequence's first step.
    pub admit: Option<Admission>,
    /// Tokens `[start, end)` of the sequence (prompt, then generated tokens) to feed.
    pub start: usize,
    /// End (exclusive).
    pub end: usize,
    /// Sample a token after this chunk (the prompt is complete).
    pub sample: bool,
    /// Snapshot the state after this chunk (its end is on the snapshot grid) and return the pages
    /// computed since the sequence's last snapshot.
    pub snapshot: bool,
    /// The most tokens this item may emit (what is left of the request's `max_tokens` and context):
    /// a speculative step drafts at most `budget - 1`.
    pub budget: usize,
    /// The request's span.
    pub span: tracing::Span,
}

/// A snapshot taken after a plan item, with the KV pages it covers that the cache may lack.
#[derive(Clone, Debug)]
pub struct SnapshotTaken {
    /// The sequence.
    pub seq: SeqId,
    /// Tokens covered (a page multiple).
    pub tokens: usize,
    /// `(page index, rows)` of pages computed by this sequence since its previous snapshot.
    pub pages: Vec<(usize, Handle)>,
    /// Recurrent state after `tokens`.
    pub snapshot: Handle,
}

/// A step: the work of every scheduled sequence, plus sequences to forget.
#[derive(Clone, Debug, Default)]
pub struct BatchPlan {
    /// Scheduled work.
    pub items: Vec<PlanItem>,
    /// Sequences that finished or were cancelled: free their state.
    pub release: Vec<SeqId>,
    /// Sequences preempted to free KV pages: free their state but keep what makes their recomputation
    /// exact (the sampler's random state); they are admitted again later with their generated tokens.
    pub preempt: Vec<SeqId>,
}

/// Log-probabilities of a sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    /// log p of the sampled token (after temperature, before top-k/top-p truncation, as OpenAI reports).
    pub logprob: f32,
    /// The most likely alternatives `(token, logprob)`, best first.
    pub top: Vec<(u32, f32)>,
}

/// A sampled token.
#[derive(Clone, Debug, PartialEq)]
pub struct Sampled {
    /// The sequence.
    pub seq: SeqId,
    /// The token.
    pub token: u32,
    /// Its log-probabilities when asked for.
    pub logprobs: Option<TokenLogprobs>,
}

/// Result of a step.
#[derive(Clone, Debug, Default)]
pub struct StepResult {
    /// One entry per item with `sample`.
    pub sampled: Vec<Sampled>,
    /// Sequences whose step failed, with why (they are released by the runner).
    pub failed: Vec<(SeqId, RequestError)>,
    /// Snapshots taken for the prefix cache.
    pub snapshots: Vec<SnapshotTaken>,
    /// The KV page pool after the step.
    pub kv: KvPages,
    /// Expert slot counters after the step.
    pub slots: ExpertSlots,
    /// The device's memory and traffic after the step (`None`: a host backend).
    pub device: Option<DeviceCounters>,
    /// The model family's own metrics after the step (none for most families).
    pub family: Vec<FamilyMetric>,
    /// Token-mask counters after the step.
    pub grammar: GrammarCounters,
    /// Speculation counters after the step (`None`: no speculative decoding).
    pub spec: Option<SpecCounters>,
}

/// The most draft tokens per speculative step (`--speculative-tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = 4;

/// Speculative decoding counters of the runner since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SpecCounters {
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafts accepted.
    pub accepted: u64,
    /// Per draft position (0 = the first draft of a step): drafts proposed there.
    pub drafted_at: [u64; MAX_SPECULATIVE_TOKENS],
    /// Per draft position: drafts accepted there.
    pub accepted_at: [u64; MAX_SPECULATIVE_TOKENS],
    /// Verifications (speculative steps of a sequence; they share the step's one main forward).
    pub forwards: u64,
    /// Tokens the verifications emitted.
    pub emitted: u64,
}

impl SpecCounters {
    /// Tokens per verification: what one pass over the main weights yields for a sequence.
    pub fn tokens_per_forward(&self) -> f64 {
        self.emitted as f64 / self.forwards.max(1) as f64
    }

    /// Accepted drafts over drafted ones.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// The cost of constrained decoding's token masks since start.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GrammarCounters {
    /// Masks computed.
    pub masks: u64,
    /// Nanoseconds spent computing them.
    pub nanos: u64,
}

/// One of the model family's own metrics (a family's caches, by name: the protocol knows none of them).
#[derive(Clone, Debug, PartialEq)]
pub struct FamilyMetric {
    /// Prometheus name.
    pub name: String,
    /// Help text.
    pub help: String,
    /// A counter (else a gauge).
    pub counter: bool,
    /// The value after the step.
    pub value: f64,
}

/// Expert slot counters on the backend, since start: one MoE layer's, or summed over the model's layers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ExpertSlots {
    /// Routed experts a step found in a backend slot (no transfer).
    pub hits: u64,
    /// Routed experts uploaded into a slot.
    pub misses: u64,
    /// Expert waves run (`moe_routed` calls).
    pub waves: u64,
    /// Slots over every MoE layer (0 before a layer's first step allocates its pool).
    pub slots: u64,
    /// Slots holding an expert.
    pub filled: u64,
    /// Experts uploaded into a slot on a guess, before their layer routed (read-ahead on a device).
    pub guesses: u64,
    /// Of those, routed to by their layer's step.
    pub guesses_used: u64,
    /// Of those, passed over by their layer's step.
    pub guesses_wasted: u64,
}

impl ExpertSlots {
    /// Share of routed experts found in a slot (0 before any step).
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / (self.hits + self.misses).max(1) as f64
    }
}

impl std::ops::Add for ExpertSlots {
    type Output = ExpertSlots;
    fn add(self, o: ExpertSlots) -> ExpertSlots {
        ExpertSlots {
            hits: self.hits + o.hits,
            misses: self.misses + o.misses,
            waves: self.waves + o.waves,
            slots: self.slots + o.slots,
            filled: self.filled + o.filled,
            guesses: self.guesses + o.guesses,
            guesses_used: self.guesses_used + o.guesses_used,
            guesses_wasted: self.guesses_wasted + o.guesses_wasted,
        }
    }
}

/// The compute device's memory, and what the engine asked of it since start (`None` on the CPU backend).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounters {
    /// Bytes of device memory.
    pub memory_total: u64,
    /// Bytes of device memory not allocated.
    pub memory_free: u64,
    /// Bytes copied host → device.
    pub bytes_to_device: u64,
    /// Bytes copied device → host.
    pub bytes_from_device: u64,
    /// Kernel launches.
    pub launches: u64,
    /// Launches per kernel name.
    pub kernels: Vec<(String, u64)>,
    /// Calls that blocked the host until the device caught up (syncs, downloads, frees).
    pub host_waits: u64,
    /// Device memory allocations.
    pub allocations: u64,
    /// Device memory frees.
    pub frees: u64,
}

/// Page counts of the runner's KV pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KvPages {
    /// Pages in the pool.
    pub total: usize,
    /// Pages nobody holds.
    pub free: usize,
    /// Pages of running sequences that another holder (the prefix cache, another sequence) also holds.
    pub shared: usize,
    /// Distinct pages running sequences hold (the rest of the pages in use are the prefix cache's alone).
    pub running: usize,
}

/// Commands of the runner actor.
#[derive(Debug)]
pub enum RunnerCommand {
    /// Execute a plan.
    Step {
        /// The plan.
        plan: BatchPlan,
        /// Its result.
        reply: oneshot::Sender<StepResult>,
    },
}
