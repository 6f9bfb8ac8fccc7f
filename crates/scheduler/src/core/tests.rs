//! Scheduler core tests: exact step plans, admission by pages, preemption, and a seeded random load.

use std::sync::Arc;

use osprey_protocol::runner::Sampled;
use osprey_protocol::scheduler::{FinishReason, Limits, SamplingParams};
use osprey_protocol::tokenizer::PreparedPrompt;
use tokio::sync::mpsc;

use super::*;
use osprey_protocol::prefix::{PrefixCommand, PrefixPin};

fn req(id: SeqId, prompt: usize, max_tokens: usize) -> GenerateRequest {
    // Bounded by no context: these tests size requests against the pool themselves.
    let budget = Limits { context_len: usize::MAX, kv_tokens: usize::MAX }.budget(prompt, Some(max_tokens));
    let prompt = PreparedPrompt {
        input_ids: vec![1; prompt],
        positions: None,
        rope_delta: 0,
        media: Vec::new(),
        thinking_open: false,
        constraint: None,
        cache_ids: vec![1; prompt],
        turn_end: None,
    };
    GenerateRequest {
        id,
        prompt: Arc::new(prompt),
        sampling: SamplingParams::default(),
        budget: budget.expect("fits"),
        stop_token_ids: vec![9],
        span: tracing::Span::none(),
    }
}

fn cfg() -> SchedulerConfig {
    SchedulerConfig {
        max_batch_tokens: 10,
        max_prefill_tokens: 6,
        max_running_requests: 2,
        kv_capacity_tokens: 40,
        page_size: 2,
        snapshot_interval: 4,
        prefix_cache: false,
        max_queued_requests: 0,
        max_queue_wait: None,
    }
}

fn sample_all(plan: &BatchPlan, token: u32) -> StepResult {
    let sampled =
        plan.items.iter().filter(|i| i.sample).map(|i| Sampled { seq: i.seq, token, logprobs: None }).collect();
    StepResult { sampled, ..StepResult::default() }
}

#[test]
fn chunked_prefill_then_decode_under_the_budget() {
    let mut s = Scheduler::new(cfg());
    let (tx, mut rx) = mpsc::unbounded_channel();
    s.submit(req(1, 8, 2), tx.clone()).expect("fits");
    s.submit(req(2, 3, 1), tx.clone()).expect("fits");
    // Step 1: seq 1 gets a 6-token chunk, seq 2 the remaining budget (3 tokens, all of it → sample).
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    let spans: Vec<(SeqId, usize, usize, bool)> = p.items.iter().map(|i| (i.seq, i.start, i.end, i.sample)).collect();
    assert_eq!(spans, vec![(1, 0, 6, false), (2, 0, 3, true)]);
    assert!(p.items.iter().all(|i| i.admit.is_some()));
    s.update(&p, sample_all(&p, 5));
    // Seq 2 finished (max_tokens 1) and is released next step; seq 1 finishes its prompt.
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    let spans: Vec<(SeqId, usize, usize, bool)> = p.items.iter().map(|i| (i.seq, i.start, i.end, i.sample)).collect();
    assert_eq!(spans, vec![(1, 6, 8, true)]);
    assert_eq!(p.release, vec![2]);
    assert!(p.items[0].admit.is_none());
    s.update(&p, sample_all(&p, 5));
    // Decode: one token.
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    assert_eq!((p.items[0].start, p.items[0].end, p.items[0].sample), (8, 9, true));
    s.update(&p, sample_all(&p, 9)); // stop token
    let events: Vec<EngineEvent> = std::iter::from_fn(|| rx.try_recv().ok()).collect();
    let finishes: Vec<FinishReason> = events
        .iter()
        .filter_map(|e| if let EngineEvent::Finished { reason, .. } = e { Some(*reason) } else { None })
        .collect();
    assert_eq!(finishes, vec![FinishReason::Length, FinishReason::Stop]);
    assert_eq!(s.schedule(&mut NoPrefixCache).map(|p| p.release), Some(vec![1]));
    assert!(s.schedule(&mut NoPrefixCache).is_none());
}

/// A port that records what it is sent and hits 4 tokens for every match.
#[derive(Default)]
struct Recorder {
    inserts: Vec<InsertRequest>,
    /// Where the pins it hands out are released.
    pins: Option<mpsc::UnboundedSender<PrefixCommand>>,
}

impl PrefixPort for Recorder {
    fn step(&mut self, m: Vec<MatchRequest>, i: Vec<InsertRequest>, _: usize) -> Vec<PrefixMatch> {
        self.inserts.extend(i);
        m.into_iter()
            .map(|m| PrefixMatch {
                seq: m.seq,
                cached_tokens: 4,
                pages: Vec::new(),
                snapshot: None,
                lease: Some(PrefixPin::new(7, self.pins.clone())),
            })
            .collect()
    }
}

#[test]
fn a_hit_skips_cached_tokens_and_chunks_end_on_the_snapshot_grid() {
    let mut s =
        Scheduler::new(SchedulerConfig { prefix_cache: true, max_prefill_tokens: 20, max_batch_tokens: 20, ..cfg() });
    let (tx, mut rx) = mpsc::unbounded_channel();
    s.submit(req(1, 15, 3), tx).expect("fits");
    let (pin_tx, mut pin_rx) = mpsc::unbounded_channel();
    let mut port = Recorder { pins: Some(pin_tx), ..Recorder::default() };
    // Hit of 4; grid 4, page 2: the chunk ends on the furthest grid point it can reach, 12 (8 inside
    // it is not snapshotted), then on the prompt's last page boundary 14, then 15 samples; then the
    // first decode token ends on page boundary 16 and snapshots.
    let mut ends = Vec::new();
    for _ in 0..4 {
        let p = s.schedule(&mut port).expect("work");
        let it = &p.items[0];
        ends.push((it.start, it.end, it.snapshot, it.sample));
        s.update(&p, sample_all(&p, 5));
    }
    assert_eq!(ends, vec![(4, 12, true, false), (12, 14, true, false), (14, 15, false, true), (15, 16, true, true)]);
    let p = s.schedule(&mut port).expect("decode");
    assert!(pin_rx.try_recv().is_err(), "the path stays pinned while the request runs");
    s.update(&p, sample_all(&p, 5));
    let released: Vec<u64> = std::iter::from_fn(|| pin_rx.try_recv().ok())
        .filter_map(|c| if let PrefixCommand::Release { lease } = c { Some(lease) } else { None })
        .collect();
    assert_eq!(released, vec![7], "the pin is released when the request finishes");
    let done = std::iter::from_fn(|| rx.try_recv().ok()).find_map(|e| match e {
        EngineEvent::Finished { cached_tokens, .. } => Some(cached_tokens),
        _ => None,
    });
    assert_eq!(done, Some(4), "usage reports the cached tokens");
}

/// Issue 53: the page at or below a prompt's `turn_end` (where the conversation's next turn parts from
/// it) is a snapshot point beside the grid and the prompt's last page: with a hit of 4, grid 4, page 2
/// and the turn ending at token 11, the chunks end on grid point 8, the turn's page 10, grid point 12,
/// the prompt's last page 14, then 15 samples. Without `turn_end` the same prompt snapshots 12 and 14
/// only (the test above), and a next turn parting at 11 would resume at 8.
#[test]
fn chunks_end_on_the_page_where_the_next_turn_parts() {
    let mut s =
        Scheduler::new(SchedulerConfig { prefix_cache: true, max_prefill_tokens: 20, max_batch_tokens: 20, ..cfg() });
    let (tx, _rx) = mpsc::unbounded_channel();
    let mut r = req(1, 15, 3);
    r.prompt = Arc::new(PreparedPrompt { turn_end: Some(11), ..(*r.prompt).clone() });
    s.submit(r, tx).expect("fits");
    let mut port = Recorder::default();
    let mut ends = Vec::new();
    for _ in 0..5 {
        let p = s.schedule(&mut port).expect("work");
        let it = &p.items[0];
        ends.push((it.start, it.end, it.snapshot));
        s.update(&p, sample_all(&p, 5));
    }
    assert_eq!(ends, vec![(4, 8, true), (8, 10, true), (10, 12, true), (12, 14, true), (14, 15, false)]);
}

#[test]
fn admission_respects_capacity_and_running_limit_and_refuses_what_never_fits() {
    let mut s = Scheduler::new(cfg());
    let (tx, _rx) = mpsc::unbounded_channel();
    // A budget made for a larger pool than this one (40 KV tokens) can never run: refused, not queued.
    assert_eq!(s.submit(req(1, 35, 10), tx.clone()).expect_err("pool").code, ErrorCode::EngineError);
    for id in 1..=3 {
        s.submit(req(id, 5, 10), tx.clone()).expect("fits");
    }
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    assert_eq!(p.items.len(), 2, "max_running_requests = 2");
    assert_eq!(s.stats().waiting, 1);
}

#[test]
fn a_closed_event_channel_cancels_the_sequence() {
    let mut s = Scheduler::new(cfg());
    let (tx, rx) = mpsc::unbounded_channel();
    s.submit(req(1, 8, 5), tx).expect("fits");
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    s.update(&p, sample_all(&p, 5));
    drop(rx);
    let p = s.schedule(&mut NoPrefixCache).expect("release");
    assert!(p.items.is_empty());
    assert_eq!(p.release, vec![1]);
    assert_eq!(s.stats().running, 0);
    assert_eq!(s.stats().cancelled_total, 1);
}

/// A runner stand-in that keeps page counts like the real pool: a sequence holds the pages covering
/// the tokens it computed; release and preemption give them back.
struct Pool {
    page: usize,
    total: usize,
    held: std::collections::HashMap<SeqId, usize>,
}

impl Pool {
    fn run(&mut self, plan: &BatchPlan, token: u32) -> StepResult {
        for id in plan.release.iter().chain(&plan.preempt) {
            self.held.remove(id);
        }
        for it in &plan.items {
            self.held.insert(it.seq, it.end.div_ceil(self.page));
        }
        let used: usize = self.held.values().sum();
        assert!(used <= self.total, "the plan overcommits the pool: {used} of {} pages", self.total);
        let mut r = sample_all(plan, token);
        r.kv = KvPages { total: self.total, free: self.total - used, shared: 0, running: used };
        r
    }
}

#[test]
fn admission_counts_pages_not_prompt_plus_max_tokens() {
    // 40 KV tokens: the up-front reservation (5 + 30 each) admitted one of these at a time.
    let mut s = Scheduler::new(SchedulerConfig { max_running_requests: 4, ..cfg() });
    let (tx, _rx) = mpsc::unbounded_channel();
    s.submit(req(1, 5, 25), tx.clone()).expect("fits");
    s.submit(req(2, 5, 25), tx.clone()).expect("fits");
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    assert_eq!(p.items.iter().map(|i| i.seq).collect::<Vec<_>>(), vec![1, 2], "both admitted at once");
    assert!(p.items.iter().all(|i| i.admit.as_ref().is_some_and(|a| a.generated.is_empty())));
}

#[test]
fn when_pages_run_out_the_newest_sequence_is_preempted_and_recomputed_with_its_tokens() {
    // 12 KV tokens of 2-token pages; two requests of 3 + 8 tokens cannot both finish side by side.
    let c = SchedulerConfig { kv_capacity_tokens: 12, max_running_requests: 2, prefix_cache: true, ..cfg() };
    let mut s = Scheduler::new(c);
    let mut pool = Pool { page: 2, total: 6, held: Default::default() };
    let (tx, mut rx) = mpsc::unbounded_channel();
    s.submit(req(1, 3, 8), tx.clone()).expect("fits");
    s.submit(req(2, 3, 8), tx.clone()).expect("fits");
    let mut preempted_at = None;
    let mut readmitted = None;
    let mut port = Resumes::default();
    for step in 0..60 {
        let Some(p) = s.schedule(&mut port) else { break };
        if p.preempt.contains(&2) {
            preempted_at.get_or_insert(step);
        }
        if let Some(a) = p.items.iter().find(|i| i.seq == 2 && preempted_at.is_some()).and_then(|i| i.admit.as_ref()) {
            readmitted.get_or_insert(a.generated.clone());
        }
        let r = pool.run(&p, 5);
        s.update(&p, r);
    }
    assert!(preempted_at.is_some(), "the pool ran out: sequence 2 was preempted");
    let generated = readmitted.expect("sequence 2 was admitted again");
    assert!(!generated.is_empty() && generated.iter().all(|&t| t == 5), "with the tokens it had: {generated:?}");
    assert_eq!(s.stats().preemptions_total, 1);
    // Its match on coming back is marked resumed (the cache does not count it as reuse); the first ones not.
    assert_eq!(port.0, vec![(1, false), (2, false), (2, true)]);
    let done: Vec<usize> = std::iter::from_fn(|| rx.try_recv().ok())
        .filter_map(|e| match e {
            EngineEvent::Finished { completion_tokens, .. } => Some(completion_tokens),
            _ => None,
        })
        .collect();
    assert_eq!(done, vec![8, 8], "both requests finish with all their tokens");
}

/// A port that misses every match and records which were a preempted sequence coming back.
#[derive(Default)]
struct Resumes(Vec<(SeqId, bool)>);

impl PrefixPort for Resumes {
    fn step(&mut self, m: Vec<MatchRequest>, _: Vec<InsertRequest>, _: usize) -> Vec<PrefixMatch> {
        m.into_iter()
            .map(|m| {
                self.0.push((m.seq, m.resumed));
                PrefixMatch { seq: m.seq, cached_tokens: 0, pages: Vec::new(), snapshot: None, lease: None }
            })
            .collect()
    }
}

/// Seeded random load on a tiny pool: many requests of random sizes arriving over time. Invariants:
/// no step overcommits the pool, a readmitted sequence carries exactly the tokens it had generated,
/// and every request ends with all its tokens.
#[test]
fn random_load_on_a_tiny_pool_never_overcommits_and_finishes_everything() {
    let mut preemptions = 0;
    for seed in 1..=20u64 {
        let c = SchedulerConfig {
            max_batch_tokens: 8,
            max_prefill_tokens: 4,
            max_running_requests: 4,
            kv_capacity_tokens: 24,
            ..cfg()
        };
        let mut s = Scheduler::new(c);
        let mut pool = Pool { page: 2, total: 12, held: Default::default() };
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let mut rnd = |n: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % n) as usize
        };
        let (tx, mut rx) = mpsc::unbounded_channel();
        let mut want = std::collections::HashMap::new();
        let mut generated: std::collections::HashMap<SeqId, Vec<u32>> = Default::default();
        let mut next = 1;
        for step in 0..5000 {
            if next <= 16 && rnd(3) == 0 {
                let (prompt, max) = (1 + rnd(8), 1 + rnd(12));
                s.submit(req(next, prompt, max), tx.clone()).expect("fits");
                want.insert(next, max);
                next += 1;
            }
            let Some(p) = s.schedule(&mut NoPrefixCache) else {
                if next > 16 {
                    break;
                }
                continue;
            };
            for it in &p.items {
                if let Some(a) = &it.admit {
                    let had = generated.get(&it.seq).cloned().unwrap_or_default();
                    assert_eq!(a.generated, had, "seed {seed} step {step}: seq {} readmitted", it.seq);
                }
            }
            let token = 5 + (step % 3) as u32;
            let r = pool.run(&p, token);
            for t in &r.sampled {
                generated.entry(t.seq).or_default().push(t.token);
            }
            s.update(&p, r);
        }
        let done: std::collections::HashMap<SeqId, usize> = std::iter::from_fn(|| rx.try_recv().ok())
            .filter_map(|e| match e {
                EngineEvent::Finished { completion_tokens, .. } => Some(completion_tokens),
                _ => None,
            })
            .enumerate()
            .map(|(i, n)| (i as SeqId, n))
            .collect();
        assert_eq!(done.len(), want.len(), "seed {seed}: every request finishes");
        let mut got: Vec<usize> = done.into_values().collect();
        let mut all: Vec<usize> = want.into_values().collect();
        got.sort_unstable();
        all.sort_unstable();
        assert_eq!(got, all, "seed {seed}: with all its tokens");
        preemptions += s.stats().preemptions_total;
    }
    assert!(preemptions > 0, "the load must exercise preemption");
}

/// Eight long decodes run; a short request that arrives is scheduled at the very next step (first
/// token after its prefill), instead of waiting for KV the long ones had reserved up front.
#[test]
fn a_short_request_is_scheduled_at_once_while_long_decodes_run() {
    let c = SchedulerConfig {
        max_batch_tokens: 64,
        max_prefill_tokens: 16,
        max_running_requests: 16,
        kv_capacity_tokens: 4096,
        page_size: 16,
        snapshot_interval: 64,
        ..cfg()
    };
    let mut s = Scheduler::new(c);
    let mut pool = Pool { page: 16, total: 256, held: Default::default() };
    let (tx, _rx) = mpsc::unbounded_channel();
    for id in 1..=8 {
        s.submit(req(id, 10, 3000), tx.clone()).expect("fits the context");
    }
    for _ in 0..5 {
        let p = s.schedule(&mut NoPrefixCache).expect("work");
        let r = pool.run(&p, 5);
        s.update(&p, r);
    }
    // Reserving prompt + max_tokens (3,010 tokens each in a 4,096-token pool) ran one of them at a time.
    assert_eq!(s.stats().running, 8, "all eight long requests run");
    s.submit(req(99, 10, 16), tx).expect("fits");
    let p = s.schedule(&mut NoPrefixCache).expect("work");
    let short = p.items.iter().find(|i| i.seq == 99).expect("the short request is in the very next step");
    assert!(short.sample, "its whole prompt in one chunk: the first token comes from this step");
}

/// The prefix cache holds every page of the pool: a new request asks for pages back, the next step
/// brings the runner's fresh count, and the request runs (a stale count admitted nothing, forever).
#[test]
fn pages_held_by_the_cache_are_reclaimed_and_the_waiting_request_runs() {
    struct Cache {
        held: usize,
    }
    impl PrefixPort for Cache {
        fn step(&mut self, m: Vec<MatchRequest>, _: Vec<InsertRequest>, reclaim: usize) -> Vec<PrefixMatch> {
            self.held -= reclaim.min(self.held);
            NoPrefixCache.step(m, Vec::new(), 0)
        }
    }
    let c = SchedulerConfig { prefix_cache: true, kv_capacity_tokens: 20, ..cfg() };
    let mut s = Scheduler::new(c);
    let mut cache = Cache { held: 10 };
    let mut pool = Pool { page: 2, total: 10, held: Default::default() };
    // The runner's last report: every page is held (by the cache).
    s.update(
        &BatchPlan::default(),
        StepResult { kv: KvPages { total: 10, free: 0, shared: 0, running: 10 }, ..StepResult::default() },
    );
    let (tx, mut rx) = mpsc::unbounded_channel();
    s.submit(req(1, 5, 3), tx).expect("fits");
    for _ in 0..20 {
        let Some(p) = s.schedule(&mut cache) else { break };
        let mut r = pool.run(&p, 5);
        r.kv.free -= cache.held.min(r.kv.free);
        s.update(&p, r);
    }
    let finished = std::iter::from_fn(|| rx.try_recv().ok()).any(|e| matches!(e, EngineEvent::Finished { .. }));
    assert!(finished, "the request ran once the cache gave pages back");
    assert!(cache.held < 10, "pages were reclaimed");
}

/// Issue 53: a conversation's next turn, most of it in the cache, in a pool the cache fills. The turn is
/// matched while it waits, so admission asks for the pages of its new tokens only (1 of 8) and takes
/// none from the cache; counting the whole prompt, it asked the cache for 6 pages, which gave back the
/// conversation's newest pages (the turn then recomputed them).
#[test]
fn a_waiting_prompt_needs_only_the_pages_its_cache_hit_does_not_share() {
    struct Cache {
        reclaimed: usize,
        matched_before_admission: bool,
    }
    impl PrefixPort for Cache {
        fn step(&mut self, m: Vec<MatchRequest>, _: Vec<InsertRequest>, reclaim: usize) -> Vec<PrefixMatch> {
            self.reclaimed += reclaim;
            m.into_iter()
                .map(|m| {
                    self.matched_before_admission = true;
                    PrefixMatch {
                        seq: m.seq,
                        cached_tokens: 14,
                        pages: Vec::new(),
                        snapshot: None,
                        lease: Some(PrefixPin::new(3, None)),
                    }
                })
                .collect()
        }
    }
    let c = SchedulerConfig { prefix_cache: true, kv_capacity_tokens: 20, max_prefill_tokens: 8, ..cfg() };
    let mut s = Scheduler::new(c);
    // The runner's last report: 10 pages, 8 of them the cache's (the conversation so far), 2 free.
    s.update(
        &BatchPlan::default(),
        StepResult { kv: KvPages { total: 10, free: 2, shared: 8, running: 0 }, ..StepResult::default() },
    );
    let (tx, _rx) = mpsc::unbounded_channel();
    s.submit(req(1, 16, 2), tx).expect("fits");
    let mut cache = Cache { reclaimed: 0, matched_before_admission: false };
    let p = s.schedule(&mut cache).expect("admitted at once");
    assert!(cache.matched_before_admission);
    assert_eq!(cache.reclaimed, 0, "no page asked back from the cache");
    assert_eq!((p.items.len(), p.items[0].start, p.items[0].end), (1, 14, 16), "the new tokens only");
}
