//! The synchronous scheduler: a token-budget function over waiting and running sequences.
//!
//! There is no prefill phase or decode phase: each sequence has `computed` and `total` tokens (prompt +
//! generated) and a step gives it `min(total − computed, per-sequence chunk, budget left)` tokens;
//! a sequence samples when its step reaches `total`. Running sequences are served first (decode tokens
//! cost 1), then waiting ones are admitted while the running count and the KV capacity allow. KV is
//! reserved for `prompt + max_tokens` at admission, so a running sequence never has to be preempted.

use std::collections::VecDeque;

use osprey_protocol::runner::{Admission, BatchPlan, PlanItem, StepResult};
use osprey_protocol::scheduler::{EngineEvent, FinishReason, GenerateRequest, SchedulerStats};
use osprey_protocol::{ErrorCode, RequestError, SeqId};
use tokio::sync::mpsc::UnboundedSender;

/// Budgets and capacities.
#[derive(Clone, Copy, Debug)]
pub struct SchedulerConfig {
    /// Tokens computed per step over all sequences.
    pub max_batch_tokens: usize,
    /// Prompt tokens one sequence may compute per step (the prefill chunk).
    pub max_prefill_tokens: usize,
    /// Sequences computed concurrently.
    pub max_running_requests: usize,
    /// KV capacity in tokens (sum over running sequences of prompt + max_tokens).
    pub kv_capacity_tokens: usize,
    /// Model context length (prompt + generated).
    pub context_len: usize,
}

#[derive(Debug)]
struct Seq {
    req: GenerateRequest,
    events: UnboundedSender<EngineEvent>,
    prompt_len: usize,
    generated: usize,
    computed: usize,
    sent_to_runner: bool,
}

impl Seq {
    fn total(&self) -> usize {
        self.prompt_len + self.generated
    }
    fn reserve(&self) -> usize {
        self.prompt_len + self.req.max_tokens
    }
}

/// Waiting and running sequences plus counters.
#[derive(Debug)]
pub struct Scheduler {
    cfg: SchedulerConfig,
    waiting: VecDeque<Seq>,
    running: Vec<Seq>,
    release: Vec<SeqId>,
    stats: SchedulerStats,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(cfg: SchedulerConfig) -> Self {
        let stats = SchedulerStats { kv_capacity: cfg.kv_capacity_tokens, ..SchedulerStats::default() };
        Scheduler { cfg, waiting: VecDeque::new(), running: Vec::new(), release: Vec::new(), stats }
    }

    /// Queues a request, or refuses one that can never fit (a clear error, not a hang).
    pub fn submit(&mut self, req: GenerateRequest, events: UnboundedSender<EngineEvent>) -> Result<(), RequestError> {
        let prompt_len = req.prompt.input_ids.len();
        let need = prompt_len + req.max_tokens;
        if prompt_len == 0 {
            return Err(RequestError::new(ErrorCode::InvalidRequest, "the prompt is empty"));
        }
        if need > self.cfg.context_len {
            return Err(RequestError::new(
                ErrorCode::ContextLengthExceeded,
                format!(
                    "this model's context length is {} tokens, but the request needs {need} ({prompt_len} prompt + {} max_tokens)",
                    self.cfg.context_len, req.max_tokens
                ),
            ));
        }
        if need > self.cfg.kv_capacity_tokens {
            return Err(RequestError::new(
                ErrorCode::ContextLengthExceeded,
                format!(
                    "the request needs {need} KV tokens, more than the server's capacity of {}",
                    self.cfg.kv_capacity_tokens
                ),
            ));
        }
        self.waiting.push_back(Seq { req, events, prompt_len, generated: 0, computed: 0, sent_to_runner: false });
        Ok(())
    }

    /// Drops a request wherever it is.
    pub fn cancel(&mut self, id: SeqId) {
        if let Some(i) = self.waiting.iter().position(|s| s.req.id == id) {
            self.waiting.remove(i);
            self.stats.cancelled_total += 1;
        }
        if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
            let s = self.running.remove(i);
            if s.sent_to_runner {
                self.release.push(id);
            }
            self.stats.cancelled_total += 1;
        }
    }

    /// Whether there is anything to do.
    pub fn has_work(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty() || !self.release.is_empty()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_tokens: self.running.iter().map(Seq::total).sum(),
            ..self.stats
        }
    }

    fn drop_closed(&mut self) {
        let closed: Vec<SeqId> =
            self.waiting.iter().chain(self.running.iter()).filter(|s| s.events.is_closed()).map(|s| s.req.id).collect();
        for id in closed {
            self.cancel(id);
        }
    }

    /// The next step, or `None` when idle.
    pub fn schedule(&mut self) -> Option<BatchPlan> {
        self.drop_closed();
        let mut budget = self.cfg.max_batch_tokens;
        let mut reserved: usize = self.running.iter().map(Seq::reserve).sum();
        while self.running.len() < self.cfg.max_running_requests {
            let Some(next) = self.waiting.front() else { break };
            if reserved + next.reserve() > self.cfg.kv_capacity_tokens {
                break;
            }
            reserved += next.reserve();
            let seq = self.waiting.pop_front().expect("front exists");
            self.running.push(seq);
        }
        let mut items = Vec::new();
        for s in &mut self.running {
            let n = (s.total() - s.computed).min(self.cfg.max_prefill_tokens).min(budget);
            if n == 0 {
                continue;
            }
            budget -= n;
            let admit = (!s.sent_to_runner)
                .then(|| Admission { prompt: s.req.prompt.clone(), sampling: s.req.sampling.clone() });
            s.sent_to_runner = true;
            items.push(PlanItem {
                seq: s.req.id,
                admit,
                start: s.computed,
                end: s.computed + n,
                sample: s.computed + n == s.total(),
            });
        }
        let release = std::mem::take(&mut self.release);
        if items.is_empty() && release.is_empty() {
            return None;
        }
        Some(BatchPlan { items, release })
    }

    /// Applies a step's result: advances sequences, sends their events, finishes and releases them.
    pub fn update(&mut self, plan: &BatchPlan, result: StepResult) {
        self.stats.steps_total += 1;
        for item in &plan.items {
            if let Some(s) = self.running.iter_mut().find(|s| s.req.id == item.seq) {
                let n = item.end - item.start;
                if item.start < s.prompt_len {
                    self.stats.prompt_tokens_total += n.min(s.prompt_len - item.start) as u64;
                }
                s.computed = item.end;
            }
        }
        for (id, why) in result.failed {
            if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
                let s = self.running.remove(i);
                let _ = s.events.send(EngineEvent::Failed(RequestError::new(ErrorCode::EngineError, why)));
            }
        }
        for t in result.sampled {
            let Some(i) = self.running.iter().position(|s| s.req.id == t.seq) else { continue };
            let s = &mut self.running[i];
            s.generated += 1;
            self.stats.generated_tokens_total += 1;
            let stop = s.req.stop_token_ids.contains(&t.token);
            let sent = s.events.send(EngineEvent::Token { token: t.token, logprobs: t.logprobs }).is_ok();
            let reason = if stop {
                Some(FinishReason::Stop)
            } else if s.generated >= s.req.max_tokens || s.total() >= self.cfg.context_len {
                Some(FinishReason::Length)
            } else {
                None
            };
            if !sent {
                let id = s.req.id;
                self.cancel(id);
            } else if let Some(reason) = reason {
                let s = self.running.remove(i);
                let _ = s.events.send(EngineEvent::Finished {
                    reason,
                    prompt_tokens: s.prompt_len,
                    cached_tokens: 0,
                    completion_tokens: s.generated,
                });
                self.release.push(s.req.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use osprey_protocol::runner::Sampled;
    use osprey_protocol::scheduler::SamplingParams;
    use osprey_protocol::tokenizer::PreparedPrompt;
    use tokio::sync::mpsc;

    use super::*;

    fn req(id: SeqId, prompt: usize, max_tokens: usize) -> GenerateRequest {
        let prompt = PreparedPrompt {
            input_ids: vec![1; prompt],
            positions: None,
            rope_delta: 0,
            media: Vec::new(),
            thinking_open: false,
        };
        GenerateRequest {
            id,
            prompt: Arc::new(prompt),
            sampling: SamplingParams::default(),
            max_tokens,
            stop_token_ids: vec![9],
        }
    }

    fn cfg() -> SchedulerConfig {
        SchedulerConfig {
            max_batch_tokens: 10,
            max_prefill_tokens: 6,
            max_running_requests: 2,
            kv_capacity_tokens: 40,
            context_len: 30,
        }
    }

    fn sample_all(plan: &BatchPlan, token: u32) -> StepResult {
        let sampled =
            plan.items.iter().filter(|i| i.sample).map(|i| Sampled { seq: i.seq, token, logprobs: None }).collect();
        StepResult { sampled, failed: Vec::new() }
    }

    #[test]
    fn chunked_prefill_then_decode_under_the_budget() {
        let mut s = Scheduler::new(cfg());
        let (tx, mut rx) = mpsc::unbounded_channel();
        s.submit(req(1, 8, 2), tx.clone()).expect("fits");
        s.submit(req(2, 3, 1), tx.clone()).expect("fits");
        // Step 1: seq 1 gets a 6-token chunk, seq 2 the remaining budget (3 tokens, all of it → sample).
        let p = s.schedule().expect("work");
        let spans: Vec<(SeqId, usize, usize, bool)> =
            p.items.iter().map(|i| (i.seq, i.start, i.end, i.sample)).collect();
        assert_eq!(spans, vec![(1, 0, 6, false), (2, 0, 3, true)]);
        assert!(p.items.iter().all(|i| i.admit.is_some()));
        s.update(&p, sample_all(&p, 5));
        // Seq 2 finished (max_tokens 1) and is released next step; seq 1 finishes its prompt.
        let p = s.schedule().expect("work");
        let spans: Vec<(SeqId, usize, usize, bool)> =
            p.items.iter().map(|i| (i.seq, i.start, i.end, i.sample)).collect();
        assert_eq!(spans, vec![(1, 6, 8, true)]);
        assert_eq!(p.release, vec![2]);
        assert!(p.items[0].admit.is_none());
        s.update(&p, sample_all(&p, 5));
        // Decode: one token.
        let p = s.schedule().expect("work");
        assert_eq!((p.items[0].start, p.items[0].end, p.items[0].sample), (8, 9, true));
        s.update(&p, sample_all(&p, 9)); // stop token
        let events: Vec<EngineEvent> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
        let finishes: Vec<FinishReason> = events
            .iter()
            .filter_map(|e| if let EngineEvent::Finished { reason, .. } = e { Some(*reason) } else { None })
            .collect();
        assert_eq!(finishes, vec![FinishReason::Length, FinishReason::Stop]);
        assert_eq!(s.schedule().map(|p| p.release), Some(vec![1]));
        assert!(s.schedule().is_none());
    }

    #[test]
    fn admission_respects_capacity_and_running_limit_and_refuses_what_never_fits() {
        let mut s = Scheduler::new(cfg());
        let (tx, _rx) = mpsc::unbounded_channel();
        assert_eq!(s.submit(req(1, 25, 10), tx.clone()).expect_err("context").code, ErrorCode::ContextLengthExceeded);
        for id in 1..=3 {
            s.submit(req(id, 5, 10), tx.clone()).expect("fits");
        }
        let p = s.schedule().expect("work");
        assert_eq!(p.items.len(), 2, "max_running_requests = 2");
        assert_eq!(s.stats().waiting, 1);
    }

    #[test]
    fn a_closed_event_channel_cancels_the_sequence() {
        let mut s = Scheduler::new(cfg());
        let (tx, rx) = mpsc::unbounded_channel();
        s.submit(req(1, 8, 5), tx).expect("fits");
        let p = s.schedule().expect("work");
        s.update(&p, sample_all(&p, 5));
        drop(rx);
        let p = s.schedule().expect("release");
        assert!(p.items.is_empty());
        assert_eq!(p.release, vec![1]);
        assert_eq!(s.stats().running, 0);
        assert_eq!(s.stats().cancelled_total, 1);
    }
}
