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
    /// Most tokens to generate: the context, the KV pool and the client's `max_tokens`, applied once.
    pub budget: TokenBudget,
    /// Tokens that end the generation (EOS ids).
    pub stop_token_ids: Vec<u32>,
    /// The request's span (its id, followed across actors in the log).
    pub span: tracing::Span,
}

/// What bounds every sequence's length: the model's context and the KV pool's capacity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Limits {
    /// The model's context length in tokens.
    pub context_len: usize,
    /// Tokens of KV one sequence may hold (`--kv-capacity-tokens`).
    pub kv_tokens: usize,
}

impl Limits {
    /// The one place a request's length is bounded: the tokens it may generate after `prompt_len` prompt
    /// tokens are the smaller of the context and the KV capacity, less the prompt. A prompt that leaves
    /// nothing is refused as `context_length_exceeded`; a `max_tokens` past the room (the client's, none,
    /// or a client library's own default such as ChatAnthropic's 4,096) is clamped to it (llama.cpp's
    /// rule; docs/api.md), so the answer ends with `length` at the limit instead of a 400.
    pub fn budget(&self, prompt_len: usize, max_tokens: Option<usize>) -> Result<TokenBudget, RequestError> {
        let (ctx, kv) = (self.context_len, self.kv_tokens);
        if prompt_len >= ctx.min(kv) {
            let why = if kv < ctx {
                format!("the prompt has {prompt_len} tokens; the KV cache holds {kv} tokens (--kv-capacity-tokens)")
            } else {
                format!("the prompt has {prompt_len} tokens; this model's context length is {ctx}")
            };
            return Err(RequestError::new(crate::ErrorCode::ContextLengthExceeded, why));
        }
        let room = ctx.min(kv) - prompt_len;
        Ok(TokenBudget(max_tokens.map_or(room, |m| m.clamp(1, room))))
    }
}

/// How many tokens a sequence may generate, made only by [`Limits::budget`] when its request is submitted
/// and carried with it: the scheduler's plans and [`TokenBudget::check_stop`] read it, nothing clamps it
/// again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenBudget(usize);

impl TokenBudget {
    /// Most tokens to generate (at least 1).
    pub fn max_tokens(self) -> usize {
        self.0
    }

    /// Tokens still allowed after `generated`.
    pub fn left(self, generated: usize) -> usize {
        self.0.saturating_sub(generated)
    }

    /// The one stop check (the scheduler's and `osprey run`'s): after its `generated`-th token `token`, a
    /// sequence stops on a stop token, or with `length` once the budget is spent.
    pub fn check_stop(self, generated: usize, token: u32, stop_token_ids: &[u32]) -> Option<FinishReason> {
        if stop_token_ids.contains(&token) {
            Some(FinishReason::Stop)
        } else if generated >= self.0 {
            Some(FinishReason::Length)
        } else {
            None
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_budget_is_the_room_the_context_and_the_pool_leave_and_a_full_prompt_is_refused() {
        let l = Limits { context_len: 30, kv_tokens: 40 };
        assert_eq!(l.budget(10, None).expect("fits").max_tokens(), 20, "no max_tokens: the room");
        assert_eq!(l.budget(10, Some(5)).expect("fits").max_tokens(), 5);
        assert_eq!(l.budget(10, Some(4096)).expect("fits").max_tokens(), 20, "clamped, not refused");
        let e = l.budget(30, Some(1)).expect_err("no room");
        assert_eq!(e.code, crate::ErrorCode::ContextLengthExceeded);
        assert!(e.message.contains("context length is 30"), "{}", e.message);
        let pool = Limits { context_len: 30, kv_tokens: 12 };
        assert_eq!(pool.budget(10, None).expect("fits").max_tokens(), 2, "the pool is the smaller bound");
        assert!(pool.budget(12, None).expect_err("no room").message.contains("--kv-capacity-tokens"));
    }

    #[test]
    fn one_stop_check_stops_on_a_stop_token_or_a_spent_budget() {
        let b = Limits { context_len: 100, kv_tokens: 100 }.budget(10, Some(3)).expect("fits");
        assert_eq!(b.check_stop(1, 5, &[9]), None);
        assert_eq!(b.check_stop(2, 9, &[9]), Some(FinishReason::Stop));
        assert_eq!(b.check_stop(3, 5, &[9]), Some(FinishReason::Length));
        assert_eq!(b.check_stop(3, 9, &[9]), Some(FinishReason::Stop), "a stop token at the limit is a stop");
        assert_eq!((b.left(1), b.left(5)), (2, 0));
    }
}
