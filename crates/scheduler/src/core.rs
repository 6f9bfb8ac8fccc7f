//! The synchronous scheduler: a token-budget function over waiting and running sequences.
//!
//! There is no prefill phase or decode phase: each sequence has `computed` and `total` tokens (prompt +
//! generated) and a step gives it `min(total − computed, per-sequence chunk, budget left)` tokens;
//! a sequence samples when its step reaches `total`. Running sequences are served first (decode tokens
//! cost 1), then waiting ones are admitted while the running count and the KV pages allow.
//!
//! KV is counted in pages of the runner's pool, as the runner last reported them. A waiting request is
//! matched against the prefix cache when admission may take it, and admitted when the pages of its whole
//! prompt, less those its hit shares, fit beside what the running sequences' next chunks need;
//! nothing is reserved for `max_tokens`. Decode takes pages as it needs them; when the pool runs dry the
//! prefix cache is asked to give pages back and, if running sequences still cannot all advance, the most
//! recently admitted ones are preempted by recomputation: their state is dropped, they go back to the
//! front of the queue, and when readmitted they prefill their prompt and the tokens they had generated
//! (through the prefix cache when it holds them), then continue exactly where they stopped.

use std::collections::VecDeque;

use std::sync::Arc;

use osprey_protocol::prefix::{InsertRequest, MatchRequest, PrefixMatch};
use osprey_protocol::runner::{Admission, BatchPlan, KvPages, PlanItem, SnapshotTaken, StepResult};
use osprey_protocol::scheduler::{EngineEvent, GenerateRequest, SchedulerStats};
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
    /// KV capacity in tokens: the runner's page pool holds `kv_capacity_tokens / page_size` pages
    /// (rounded up).
    pub kv_capacity_tokens: usize,
    /// Prefix-cache page size in tokens.
    pub page_size: usize,
    /// Recurrent-state snapshot grid in tokens (a multiple of `page_size`; prefill chunks end on it).
    pub snapshot_interval: usize,
    /// Use the prefix cache.
    pub prefix_cache: bool,
    /// Most requests waiting for admission; more are refused with `overloaded` (0: no limit).
    pub max_queued_requests: usize,
    /// Longest a request may wait for admission before it is refused with `overloaded` (None: no limit).
    pub max_queue_wait: Option<std::time::Duration>,
}

impl SchedulerConfig {
    /// Pages of the runner's KV pool.
    pub fn kv_pages(&self) -> usize {
        pages(self.kv_capacity_tokens, self.page_size)
    }
}

/// Pages of `page_size` tokens covering `tokens` KV slots.
fn pages(tokens: usize, page_size: usize) -> usize {
    tokens.div_ceil(page_size.max(1))
}

/// The scheduler's view of the prefix cache: one batched exchange per step.
pub trait PrefixPort {
    /// Inserts, then page reclaim, then matches; one answer per match. (Pins are released by dropping
    /// them.)
    fn step(
        &mut self,
        matches: Vec<MatchRequest>,
        inserts: Vec<InsertRequest>,
        reclaim_pages: usize,
    ) -> Vec<PrefixMatch>;
}

/// No cache: every lookup misses.
#[derive(Debug, Default)]
pub struct NoPrefixCache;

impl PrefixPort for NoPrefixCache {
    fn step(&mut self, matches: Vec<MatchRequest>, _: Vec<InsertRequest>, _: usize) -> Vec<PrefixMatch> {
        matches
            .into_iter()
            .map(|m| PrefixMatch { seq: m.seq, cached_tokens: 0, pages: Vec::new(), snapshot: None, lease: None })
            .collect()
    }
}

#[derive(Debug)]
struct Seq {
    req: GenerateRequest,
    events: UnboundedSender<EngineEvent>,
    prompt_len: usize,
    generated: usize,
    computed: usize,
    sent_to_runner: bool,
    /// Prompt cache ids followed by generated token ids.
    cache_ids: Vec<u64>,
    /// Prefix-cache hit (None until matched).
    hit: Option<PrefixMatch>,
    /// Tokens served by the hit.
    cached: usize,
    /// Latest snapshot off the grid (request end), inserted when the sequence finishes.
    pending_end: Option<SnapshotTaken>,
    /// It was preempted at least once (the runner may hold its sampler state while it waits).
    preempted: bool,
    /// When it was queued.
    queued_at: std::time::Instant,
}

impl Seq {
    fn total(&self) -> usize {
        self.prompt_len + self.generated
    }

    fn match_request(&self) -> MatchRequest {
        MatchRequest {
            seq: self.req.id,
            cache_ids: Arc::new(self.cache_ids.clone()),
            cap: self.total() - 1,
            resumed: self.preempted,
        }
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
    inserts: Vec<InsertRequest>,
    /// The runner's pool as of its last report.
    kv: KvPages,
    /// Pages to ask the prefix cache for at the next exchange.
    reclaim: usize,
    /// Sequences preempted since the last plan.
    preempt: Vec<SeqId>,
}

impl Scheduler {
    /// An empty scheduler.
    pub fn new(cfg: SchedulerConfig) -> Self {
        let stats = SchedulerStats { kv_capacity: cfg.kv_capacity_tokens, ..SchedulerStats::default() };
        let pages = cfg.kv_pages();
        Scheduler {
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            release: Vec::new(),
            stats,
            inserts: Vec::new(),
            kv: KvPages { total: pages, free: pages, shared: 0, running: 0 },
            reclaim: 0,
            preempt: Vec::new(),
        }
    }

    /// Pages covering `tokens` KV slots.
    fn pages_for(&self, tokens: usize) -> usize {
        pages(tokens, self.cfg.page_size)
    }

    /// Queues a request, or refuses one that can never fit (a clear error, not a hang).
    pub fn submit(&mut self, req: GenerateRequest, events: UnboundedSender<EngineEvent>) -> Result<(), RequestError> {
        let prompt_len = req.prompt.input_ids.len();
        let need = prompt_len + req.budget.max_tokens();
        if prompt_len == 0 {
            return Err(RequestError::new(ErrorCode::InvalidRequest, "the prompt is empty"));
        }
        if self.cfg.max_queued_requests > 0 && self.waiting.len() >= self.cfg.max_queued_requests {
            self.stats.overloaded_total += 1;
            return Err(RequestError::new(
                ErrorCode::Overloaded,
                format!("the server is busy: {} requests are already waiting; retry later", self.waiting.len()),
            ));
        }
        // The request's budget was bounded by the same KV capacity (`Limits::budget`); a budget made for
        // another pool would wait for pages forever.
        if self.pages_for(need) > self.cfg.kv_pages() {
            return Err(RequestError::new(
                ErrorCode::EngineError,
                format!(
                    "the request needs {need} KV tokens, more than the server's capacity of {} (a bug)",
                    self.cfg.kv_pages() * self.cfg.page_size
                ),
            ));
        }
        let cache_ids = req.prompt.cache_ids.clone();
        req.span.in_scope(|| tracing::debug!(prompt_len, max_tokens = req.budget.max_tokens(), "queued"));
        self.waiting.push_back(Seq {
            req,
            events,
            prompt_len,
            generated: 0,
            computed: 0,
            sent_to_runner: false,
            cache_ids,
            hit: None,
            cached: 0,
            pending_end: None,
            preempted: false,
            queued_at: std::time::Instant::now(),
        });
        Ok(())
    }

    /// Drops a request wherever it is.
    pub fn cancel(&mut self, id: SeqId) {
        if let Some(i) = self.waiting.iter().position(|s| s.req.id == id) {
            if let Some(s) = self.waiting.remove(i) {
                if s.preempted {
                    // The runner may hold its sampler state from before the preemption.
                    self.release.push(id);
                }
            }
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
        !self.waiting.is_empty()
            || !self.running.is_empty()
            || !self.release.is_empty()
            || !self.preempt.is_empty()
            || !self.inserts.is_empty()
    }

    /// Counters and gauges.
    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            waiting: self.waiting.len(),
            running: self.running.len(),
            kv_tokens: self.running.iter().map(Seq::total).sum(),
            kv_pages_total: self.kv.total,
            kv_pages_free: self.kv.free,
            kv_pages_shared: self.kv.shared,
            kv_pages_running: self.kv.running,
            ..self.stats.clone()
        }
    }

    fn drop_closed(&mut self) {
        let closed: Vec<SeqId> =
            self.waiting.iter().chain(self.running.iter()).filter(|s| s.events.is_closed()).map(|s| s.req.id).collect();
        for id in closed {
            self.cancel(id);
        }
    }

    /// Where a chunk starting at `from` and allowed to reach `to` should end so that snapshots land on
    /// the grid, and whether to snapshot there. Snapshot points: multiples of `snapshot_interval`; the
    /// page at or below the prompt's `turn_end` (where the conversation's next turn stops matching this
    /// prompt: the re-rendered history parts from the generation prompt there) and the last page
    /// boundary of the prompt; during decode, every page boundary (the latest becomes the end-of-request
    /// snapshot). A chunk ends on the first of the turn's two points it reaches, or on the last grid
    /// point before it: every one of them is snapshotted, and a hit resumes at the deepest that matches.
    fn chunk_end(&self, s: &Seq, from: usize, to: usize) -> (usize, bool) {
        if !self.cfg.prefix_cache {
            return (to, false);
        }
        let (page, grid) = (self.cfg.page_size, self.cfg.snapshot_interval);
        if from >= s.prompt_len {
            return (to, to.is_multiple_of(page) && to > s.cached);
        }
        let prompt_end_page = s.prompt_len / page * page;
        let turn_page = s.req.prompt.turn_end.map(|t| t.min(s.prompt_len) / page * page);
        let turn_point = [turn_page, Some(prompt_end_page)]
            .into_iter()
            .flatten()
            .filter(|&p| p > from && p <= to && p > s.cached)
            .min();
        let limit = turn_point.unwrap_or(to).min(s.prompt_len);
        let mut best = None;
        let mut k = (from / grid + 1) * grid;
        while k <= limit {
            best = Some(k);
            k += grid;
        }
        let best = best.or(turn_point);
        match best {
            // End on the snapshot point unless the chunk would be empty.
            Some(b) if b > from && b > s.cached => (b, true),
            _ => (to, false),
        }
    }

    /// Refuses requests that waited for admission longer than `max_queue_wait` (a preempted sequence,
    /// which has started answering, waits as long as it takes).
    fn expire_waiting(&mut self) {
        let Some(limit) = self.cfg.max_queue_wait else { return };
        let mut i = 0;
        while i < self.waiting.len() {
            let s = &self.waiting[i];
            if s.preempted || s.queued_at.elapsed() <= limit {
                i += 1;
                continue;
            }
            let s = self.waiting.remove(i).expect("index in range");
            self.stats.overloaded_total += 1;
            let msg = format!("the request waited {:.1} s without being admitted; retry later", limit.as_secs_f64());
            let _ = s.events.send(EngineEvent::Failed(RequestError::new(ErrorCode::Overloaded, msg)));
        }
    }

    /// New pages the next chunk of `s` needs (at most `max_prefill_tokens` tokens).
    fn next_pages(&self, s: &Seq) -> usize {
        let end = s.total().min(s.computed + self.cfg.max_prefill_tokens);
        self.pages_for(end) - self.pages_for(s.computed)
    }

    /// Sends running sequence `i` back to the front of the queue; its state is dropped by the runner and
    /// recomputed (prompt + generated tokens) when it is admitted again.
    fn preempt(&mut self, i: usize) {
        let mut s = self.running.remove(i);
        if s.sent_to_runner {
            self.preempt.push(s.req.id);
        }
        // Dropping the hit unpins its path in the cache.
        s.hit = None;
        s.computed = 0;
        s.sent_to_runner = false;
        s.pending_end = None;
        s.preempted = true;
        self.stats.preemptions_total += 1;
        s.req.span.in_scope(|| tracing::debug!(tokens = s.total(), "preempted: KV pages ran out"));
        self.waiting.push_front(s);
    }

    /// Matches the waiting sequences that admission may take this step against the prefix cache, with
    /// the step's inserts (so a conversation's next turn finds the turn that just ended). Admission then
    /// counts only the pages a prompt does not share with the cache, and its hit pins those pages, so a
    /// reclaim for the pages it lacks never evicts the ones it is about to reuse. (Admission counted the
    /// whole prompt before and matched after: a 6,500-token turn in a 12,000-token pool asked the cache
    /// for pages, and the cache gave back the conversation's newest pages, which the turn then recomputed.)
    fn match_waiting(&mut self, prefix: &mut dyn PrefixPort) {
        if !self.cfg.prefix_cache || !self.preempt.is_empty() {
            return;
        }
        let room = self.cfg.max_running_requests.saturating_sub(self.running.len());
        let matches: Vec<MatchRequest> =
            self.waiting.iter().take(room).filter(|s| s.hit.is_none()).map(Seq::match_request).collect();
        if matches.is_empty() {
            return;
        }
        let inserts = std::mem::take(&mut self.inserts);
        let out = prefix.step(matches, inserts, 0);
        self.apply_matches(out);
    }

    /// One exchange with the prefix cache: the matches of newly admitted sequences not matched while
    /// waiting (a preempted one's marked resumed), the step's inserts and the pages to reclaim.
    fn exchange(&mut self, prefix: &mut dyn PrefixPort, first_new: usize) {
        let matches: Vec<MatchRequest> = if self.cfg.prefix_cache {
            self.running[first_new..].iter().filter(|s| s.hit.is_none()).map(Seq::match_request).collect()
        } else {
            Vec::new()
        };
        let inserts = std::mem::take(&mut self.inserts);
        let reclaim = if self.cfg.prefix_cache { std::mem::take(&mut self.reclaim) } else { 0 };
        if !(matches.is_empty() && inserts.is_empty() && reclaim == 0) {
            let out = prefix.step(matches, inserts, reclaim);
            self.apply_matches(out);
        }
    }

    /// Gives each sequence (running or waiting) its hit: the cached tokens count as computed.
    fn apply_matches(&mut self, out: Vec<PrefixMatch>) {
        for m in out {
            let Some(s) = self.running.iter_mut().chain(self.waiting.iter_mut()).find(|s| s.req.id == m.seq) else {
                continue;
            };
            // A preempted sequence's hit gives back what it had computed: not reuse, not counted.
            if !s.preempted {
                s.cached = m.cached_tokens;
                self.stats.cached_tokens_total += m.cached_tokens as u64;
            }
            s.computed = m.cached_tokens;
            s.req.span.in_scope(|| tracing::debug!(cached_tokens = m.cached_tokens, "prefix matched"));
            s.hit = Some(m);
        }
    }

    /// The next step, or `None` when idle. New sequences are matched against the prefix cache (one
    /// batched call per step, together with the step's inserts and page reclaim).
    pub fn schedule(&mut self, prefix: &mut dyn PrefixPort) -> Option<BatchPlan> {
        self.drop_closed();
        self.expire_waiting();
        let free = self.kv.free;
        // 1. Every running sequence must be able to advance by one token. When the pages for that are
        //    missing, ask the cache for them and preempt from the most recently admitted (their pages
        //    come back for the next step; the first sequence is never preempted for itself).
        let ps = self.cfg.page_size;
        let one_more = move |s: &Seq| pages(s.computed + 1, ps) - pages(s.computed, ps);
        let mut need: usize = self.running.iter().map(one_more).sum();
        if need > free {
            self.reclaim = self.reclaim.max(need - free);
        }
        while need > free && self.running.len() > 1 {
            let last = self.running.len() - 1;
            need -= one_more(&self.running[last]);
            self.preempt(last);
        }
        // 2. Admission by pages: the whole prompt (and re-fed tokens) beside the running sequences' next
        //    chunks, less the pages its prefix-cache hit shares; nothing is reserved for max_tokens.
        self.match_waiting(prefix);
        let mut avail = free.saturating_sub(self.running.iter().map(|s| self.next_pages(s)).sum());
        let first_new = self.running.len();
        while self.running.len() < self.cfg.max_running_requests && self.preempt.is_empty() {
            let Some(next) = self.waiting.front() else { break };
            let want = self.pages_for(next.total()) - self.pages_for(next.computed);
            if want > avail {
                self.reclaim = self.reclaim.max(want - avail);
                break;
            }
            avail -= want;
            let seq = self.waiting.pop_front().expect("front exists");
            self.running.push(seq);
        }
        // 3. One exchange with the prefix cache.
        self.exchange(prefix, first_new);
        // 4. Chunks under the token budget and the free pages (a chunk is cut short to the pages left).
        let mut budget = self.cfg.max_batch_tokens;
        let mut pages_left = free;
        let mut items = Vec::new();
        for i in 0..self.running.len() {
            let s = &self.running[i];
            let n = (s.total() - s.computed).min(self.cfg.max_prefill_tokens).min(budget);
            if n == 0 {
                continue;
            }
            let held = self.pages_for(s.computed);
            let room = (held + pages_left) * self.cfg.page_size;
            if room <= s.computed {
                continue;
            }
            let (end, snapshot) = self.chunk_end(s, s.computed, (s.computed + n).min(room));
            pages_left -= self.pages_for(end) - held;
            let s = &mut self.running[i];
            budget -= end - s.computed;
            let admit = (!s.sent_to_runner).then(|| Admission {
                prompt: s.req.prompt.clone(),
                sampling: s.req.sampling.clone(),
                prefix: s.hit.clone().filter(|h| h.cached_tokens > 0),
                generated: s.cache_ids[s.prompt_len..].iter().map(|&t| t as u32).collect(),
            });
            s.sent_to_runner = true;
            let span = s.req.span.clone();
            let sample = end == s.total();
            let budget = s.req.budget.left(s.generated);
            items.push(PlanItem { seq: s.req.id, admit, start: s.computed, end, sample, snapshot, budget, span });
        }
        let release = std::mem::take(&mut self.release);
        let preempt = std::mem::take(&mut self.preempt);
        if items.is_empty() && release.is_empty() && preempt.is_empty() {
            // Work is waiting for pages (pages the cache was just asked to give back, or that finished
            // sequences free): an empty step brings the runner's fresh page count. Without it the count
            // would stay stale and nothing would ever be admitted again.
            let starved = !self.waiting.is_empty() || !self.running.is_empty();
            return starved.then(BatchPlan::default);
        }
        Some(BatchPlan { items, release, preempt })
    }

    fn finish(&mut self, i: usize) -> Seq {
        let s = self.running.remove(i);
        if let Some(end) = &s.pending_end {
            self.inserts.push(InsertRequest {
                cache_ids: s.cache_ids[..end.tokens].to_vec(),
                pages: end.pages.clone(),
                snapshot: end.snapshot.clone(),
            });
        }
        self.release.push(s.req.id);
        s
    }

    /// Applies a step's result: advances sequences, sends their events, finishes and releases them.
    pub fn update(&mut self, plan: &BatchPlan, result: StepResult) {
        self.stats.steps_total += 1;
        if result.kv.total > 0 {
            self.kv = result.kv;
        }
        self.stats.expert_slots = result.slots;
        self.stats.device = result.device;
        self.stats.family = result.family;
        self.stats.grammar = result.grammar;
        self.stats.spec = result.spec;
        for item in &plan.items {
            if let Some(s) = self.running.iter_mut().find(|s| s.req.id == item.seq) {
                let n = item.end - item.start;
                if item.start < s.prompt_len {
                    self.stats.prompt_tokens_total += n.min(s.prompt_len - item.start) as u64;
                }
                s.computed = item.end;
            }
        }
        for (id, err) in result.failed {
            if let Some(i) = self.running.iter().position(|s| s.req.id == id) {
                let s = self.running.remove(i);
                let _ = s.events.send(EngineEvent::Failed(err));
            }
        }
        for snap in result.snapshots {
            let grid = self.cfg.snapshot_interval;
            let Some(s) = self.running.iter_mut().find(|s| s.req.id == snap.seq) else { continue };
            // Pages of a snapshot that is not inserted now are carried to the next one of this sequence.
            let mut pages = s.pending_end.take().map(|p| p.pages).unwrap_or_default();
            pages.extend(snap.pages);
            if snap.tokens <= s.prompt_len || snap.tokens % grid == 0 {
                self.inserts.push(InsertRequest {
                    cache_ids: s.cache_ids[..snap.tokens].to_vec(),
                    pages,
                    snapshot: snap.snapshot,
                });
            } else {
                // Off-grid decode snapshot: kept as the end-of-request snapshot until a newer one.
                s.pending_end = Some(SnapshotTaken { pages, ..snap });
            }
        }
        for t in result.sampled {
            let Some(i) = self.running.iter().position(|s| s.req.id == t.seq) else { continue };
            let s = &mut self.running[i];
            s.generated += 1;
            s.cache_ids.push(t.token as u64);
            // A speculative step feeds its accepted drafts: the runner's state ends just before the last
            // token sampled, whatever the step's plan said.
            s.computed = s.total() - 1;
            self.stats.generated_tokens_total += 1;
            let reason = s.req.budget.check_stop(s.generated, t.token, &s.req.stop_token_ids);
            let sent = s.events.send(EngineEvent::Token { token: t.token, logprobs: t.logprobs }).is_ok();
            if !sent {
                let id = s.req.id;
                self.cancel(id);
            } else if let Some(reason) = reason {
                let s = self.finish(i);
                s.req.span.in_scope(|| tracing::debug!(?reason, generated = s.generated, "finished"));
                let _ = s.events.send(EngineEvent::Finished {
                    reason,
                    prompt_tokens: s.prompt_len,
                    cached_tokens: s.cached,
                    completion_tokens: s.generated,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests;
