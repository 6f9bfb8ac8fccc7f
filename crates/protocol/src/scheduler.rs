//! Messages to the scheduler actor: requests in, token events out.

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use crate::runner::TokenLogprobs;
pub use crate::sampling::SamplingParams;
use crate::tokenizer::PreparedPrompt;
use crate::{RequestError, SeqId};

/// A generation request.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    /// Unique id.
    pub id: SeqId,
    /// The prompt.
    pub prompt: Arc<PreparedPrompt>,
    /// Sampling settings.
    pub sampling: SamplingParams,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Tokens that end the generation (EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// The request's span (its id, followed across actors in the log).
    pub span: tracing::Span,
}

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// A stop token or stop string.
    Stop,
    /// `max_tokens` or the context length.
    Length,
}

/// Events of one request, in order.
#[derive(Clone, Debug)]
pub enum EngineEvent {
    /// A new token.
    Token {
        /// The token.
        token: u32,
        /// Its log-probabilities when asked for.
        logprobs: Option<TokenLogprobs>,
    },
    /// The generation ended (after its last token event).
    Finished {
        /// Why.
        reason: FinishReason,
        /// Prompt tokens.
        prompt_tokens: usize,
        /// Prompt tokens served from the prefix cache.
        cached_tokens: usize,
        /// Generated tokens.
        completion_tokens: usize,
    },
    /// The request failed.
    Failed(RequestError),
}

/// Counters and gauges of the scheduler (for /metrics).
#[derive(Clone, Debug, Default)]
pub struct SchedulerStats {
    /// Requests waiting for admission.
    pub waiting: usize,
    /// Sequences being computed.
    pub running: usize,
    /// Tokens held in KV by running sequences.
    pub kv_tokens: usize,
    /// KV capacity in tokens.
    pub kv_capacity: usize,
    /// KV pages in the pool.
    pub kv_pages_total: usize,
    /// KV pages nobody holds (as of the last step).
    pub kv_pages_free: usize,
    /// KV pages of running sequences shared with another holder (as of the last step).
    pub kv_pages_shared: usize,
    /// Distinct KV pages running sequences hold (as of the last step); the other pages in use are held by
    /// the prefix cache alone.
    pub kv_pages_running: usize,
    /// Expert slot counters (as of the last step).
    pub expert_slots: crate::runner::ExpertSlots,
    /// The compute device's memory and traffic (as of the last step; `None` on the CPU).
    pub device: Option<crate::runner::DeviceCounters>,
    /// The model family's own metrics (as of the last step).
    pub family: Vec<crate::runner::FamilyMetric>,
    /// Token-mask counters (as of the last step).
    pub grammar: crate::runner::GrammarCounters,
    /// Speculation counters (as of the last step; `None` without speculative decoding).
    pub spec: Option<crate::runner::SpecCounters>,
    /// Sequences preempted (KV pages ran out) since start.
    pub preemptions_total: u64,
    /// Prompt tokens computed since start.
    pub prompt_tokens_total: u64,
    /// Tokens generated since start.
    pub generated_tokens_total: u64,
    /// Prompt tokens served from the prefix cache since start.
    pub cached_tokens_total: u64,
    /// Sequences cancelled because their client left.
    pub cancelled_total: u64,
    /// Steps executed.
    pub steps_total: u64,
    /// Requests refused because the queue was full or they waited too long.
    pub overloaded_total: u64,
}

/// Commands of the scheduler actor.
#[derive(Debug)]
pub enum SchedulerCommand {
    /// Queue a request; its events go to `events` (dropping the receiver cancels it).
    Submit {
        /// The request (boxed: it is most of the command's size, and the other commands are small).
        request: Box<GenerateRequest>,
        /// Where its events go.
        events: mpsc::UnboundedSender<EngineEvent>,
        /// Answered at once: queued, or refused (queue full, can never fit) before any event.
        accepted: oneshot::Sender<Result<(), RequestError>>,
    },
    /// Stop a request (stop string matched, client left).
    Cancel {
        /// The request.
        id: SeqId,
    },
    /// Counters.
    Stats {
        /// Counters.
        reply: oneshot::Sender<SchedulerStats>,
    },
}
