//! Speculative decoding through the real server (`--speculative-tokens`): greedy answers, with a JSON
//! schema too, equal those of a server without it, under concurrency, through a preempting page pool
//! and from the prefix cache; `/metrics` reports the drafts.
//!
//! Both servers run with f32 activations, as tests/osprey/kv_pages.rs does and for the same reason: at the fast
//! default the blocked matmuls of a wider verification sum in another order than a decode step's, and
//! rounding activations to bf16 can turn that 1e-6 into a flipped token on this random-weight model.

use crate::common;
use crate::harness;

use std::net::SocketAddr;

use harness::metric;
use osprey::Settings;
use serde_json::{json, Value};

fn start(settings: Settings) -> SocketAddr {
    let settings = Settings { activations: Some("f32".into()), max_running_requests: Some(6), ..settings };
    harness::start(settings, common::fixtures().join("models/qwen3_5_moe-tiny-mtp"))
}

fn body(i: usize) -> Value {
    let q = format!("Question {i}: tell me about the number {}.", i * 7);
    let mut b =
        json!({"messages": [{"role": "user", "content": q}], "max_tokens": 40, "temperature": 0, "ignore_eos": true});
    if i % 3 == 2 {
        let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}, "word": {"type": "string"}},
            "required": ["n", "word"]});
        b["response_format"] = json!({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}});
        b["ignore_eos"] = json!(false);
    }
    b
}

fn ask_all(addr: SocketAddr, n: usize) -> Vec<String> {
    let handles: Vec<_> = (0..n).map(|i| std::thread::spawn(move || harness::answer(addr, &body(i)).0)).collect();
    handles.into_iter().map(|h| h.join().expect("client thread")).collect()
}

#[test]
fn speculative_serving_answers_like_plain_serving_and_reports_its_drafts() {
    let plain = start(Settings::default());
    let spec = start(Settings { speculative_tokens: Some(3), ..Settings::default() });
    // Each request is ~30 prompt tokens + 40 generated (and up to 3 drafts) = 5 pages of 16; six side
    // by side need ~30, this pool has 10.
    let tiny = start(Settings {
        speculative_tokens: Some(3),
        kv_capacity_tokens: Some(160),
        page_size: Some(16),
        ..Settings::default()
    });
    let want = ask_all(plain, 6);
    assert_eq!(ask_all(spec, 6), want, "concurrent speculative answers");
    assert_eq!(ask_all(tiny, 6), want, "speculative answers through preemption");
    assert!(metric(tiny, "osprey_preemptions_total") > 0.0, "the tiny pool must have preempted");
    // Again: now from the prefix cache.
    let hits = metric(spec, "osprey_prefix_cache_hits_total");
    assert_eq!(harness::answer(spec, &body(0)).0, want[0], "from the prefix cache");
    assert!(metric(spec, "osprey_prefix_cache_hits_total") > hits);
    let drafted = metric(spec, "osprey_spec_drafted_total");
    let steps = metric(spec, "osprey_spec_verifications_total");
    assert!(drafted > 0.0 && steps > 0.0 && drafted <= 3.0 * steps, "{drafted} drafts in {steps} steps");
    assert!(metric(spec, "osprey_spec_emitted_tokens_total") >= steps);
    assert!(metric(plain, "osprey_spec_drafted_total").is_nan(), "no speculation, no counters");
    let (_, text) = harness::get(spec, "/metrics");
    assert!(text.contains("osprey_spec_acceptance_rate{position=\"2\"}"), "per-position acceptance");
}

#[test]
fn a_server_asked_to_speculate_without_a_head_refuses_to_start() {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let settings = Settings { speculative_tokens: Some(2), ..Settings::default() };
    let Err(err) = osprey::start(&settings, &dir) else { panic!("a server without a draft head must refuse") };
    assert!(err.to_string().contains("draft head"), "{err}");
}
