//! The runner's KV page pool: a prefix-cache hit shares the cached pages (no KV copy) and gives the same
//! answer as computing the prompt; pages come back to the pool when the last holder lets go.

use crate::common;

use std::sync::Arc;

use osprey_protocol::prefix::PrefixMatch;
use osprey_protocol::runner::{Admission, BatchPlan, PlanItem, StepResult};
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_runner::Runner;

fn prompt(n: usize) -> Arc<PreparedPrompt> {
    Arc::new(PreparedPrompt::text((0..n as u32).map(|i| (i * 37 + 11) % 200).collect()))
}

/// Admits `seq` at `start` and feeds `[start, end)` (the scheduler ends chunks on snapshot points).
fn admit(seq: u64, p: &Arc<PreparedPrompt>, prefix: Option<PrefixMatch>, (start, end): (usize, usize)) -> PlanItem {
    let sampling = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let admission = Admission { prompt: p.clone(), sampling, prefix, generated: Vec::new() };
    PlanItem {
        seq,
        admit: Some(admission),
        start,
        end,
        sample: end == p.input_ids.len(),
        snapshot: end.is_multiple_of(16),
        budget: usize::MAX,
        span: tracing::Span::none(),
    }
}

fn feed(seq: u64, (start, end): (usize, usize)) -> PlanItem {
    let span = tracing::Span::none();
    PlanItem { seq, admit: None, start, end, sample: true, snapshot: false, budget: usize::MAX, span }
}

fn step(r: &mut Runner, items: Vec<PlanItem>, release: Vec<u64>) -> StepResult {
    let res = r.step(BatchPlan { items, release, preempt: Vec::new() });
    assert!(res.failed.is_empty(), "{:?}", res.failed);
    res
}

#[test]
fn a_prefix_hit_shares_pages_instead_of_copying_them() {
    let mut r = Runner::new(common::model("qwen3_5_moe-tiny"), None, 16, 10);
    let p = prompt(40); // 2 full pages + 8 tokens
                        // A computes the prompt and reports pages 0 and 1 with the snapshot after them (token 32).
    let a0 = step(&mut r, vec![admit(1, &p, None, (0, 32))], Vec::new());
    let a = step(&mut r, vec![feed(1, (32, 40))], Vec::new());
    assert_eq!(r.kv_pages().free, 7, "A holds 3 pages");
    let snap = &a0.snapshots[0];
    assert_eq!((snap.tokens, snap.pages.len()), (32, 2));
    let hit = PrefixMatch {
        seq: 2,
        cached_tokens: 32,
        pages: snap.pages.iter().map(|(_, h)| h.clone()).collect(),
        snapshot: Some(snap.snapshot.clone()),
        lease: None,
    };
    // B resumes from the hit: it takes one new page (tokens 32..40); pages 0 and 1 are A's own.
    let b = step(&mut r, vec![admit(2, &p, Some(hit), (32, 40))], Vec::new());
    let kv = r.kv_pages();
    assert_eq!(kv.free, 6, "one page for B's 8 new tokens; a copy would have taken 3");
    assert_eq!(kv.shared, 2, "pages 0 and 1 are held by A, B and the handles");
    assert_eq!(b.sampled[0].token, a.sampled[0].token, "the hit answers as the full prefill did");
    // Pages return when the last holder lets go: the handles here still hold pages 0 and 1.
    step(&mut r, Vec::new(), vec![1, 2]);
    assert_eq!(r.kv_pages().free, 8);
    drop(a0);
    assert_eq!(r.kv_pages().free, 10);
}
