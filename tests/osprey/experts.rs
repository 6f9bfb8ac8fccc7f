//! `osprey serve` on an NVFP4 checkpoint made by `osprey quantize`, streaming experts from disk under a RAM
//! budget far below the expert bytes, answers exactly as with every expert resident.

use crate::common;
use crate::harness;

use std::path::PathBuf;

use common::fixtures;
use harness::{chat as ask, metric, quantize_to_temp, start, start_with};
use osprey::{ReaderLayer, Settings};
use osprey_experts::{ReadDone, ReadReq, Reader, ReaderKind};
use serde_json::{json, Value};

/// Fails every read of the `fail_at`-th batch (0-based) with an injected I/O error.
struct Faulty {
    inner: Box<dyn Reader>,
    batch: usize,
    fail_at: usize,
}

impl Reader for Faulty {
    fn read_batch(&mut self, reqs: &[ReadReq]) -> Vec<std::io::Result<ReadDone>> {
        self.batch += 1;
        if self.batch - 1 == self.fail_at {
            return reqs.iter().map(|_| Err(std::io::Error::other("injected I/O error"))).collect();
        }
        self.inner.read_batch(reqs)
    }
    fn kind(&self) -> ReaderKind {
        self.inner.kind()
    }
}

/// Quantised once per process (tests run in parallel threads and map the result).
fn nvfp4_dir() -> PathBuf {
    static DIR: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    DIR.get_or_init(|| quantize_to_temp(&fixtures().join("models/qwen3_5_moe-tiny"), "serve-nvfp4")).clone()
}

#[test]
fn a_budget_of_top_k_experts_per_layer_answers_exactly_as_fully_resident() {
    let dir = nvfp4_dir();
    let full = start(Settings::default(), dir.clone());
    // Same settings but the budget (chunking, and so summation order, must match for bit equality).
    // 2 of 8 experts per layer = top_k: every step evicts and re-reads.
    let streamed = start(Settings { expert_ram_experts: Some(2), ..Settings::default() }, dir.clone());
    let lean = start(
        Settings { expert_ram_gb: Some(0.0001), expert_reader: Some("pread".into()), ..Settings::default() },
        dir,
    );
    let img = base64::Engine::encode(
        &base64::engine::general_purpose::STANDARD,
        std::fs::read(fixtures().join("media/img_224x160.png")).expect("png"),
    );
    for content in [
        json!("Tell me about experts."),
        json!([{"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{img}")}}, {"type": "text", "text": "What is it?"}]),
    ] {
        let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 12, "temperature": 0, "logprobs": true});
        let want = ask(full, &body);
        for addr in [streamed, lean] {
            let got = ask(addr, &body);
            assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
            assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"], "logprobs must be bit-identical");
        }
    }
    assert!(metric(streamed, "osprey_expert_residency") < 1.0);
    assert!(metric(streamed, "osprey_expert_evictions_total") > 0.0);
    assert!(metric(lean, "osprey_expert_resident_bytes") < 200_000.0, "the byte budget bounds what stays resident");
    // Slot counters reach /metrics through the runner: with every expert mapped, each of the 4 × 8
    // experts goes into a slot at most once; with two slots per layer they keep being replaced.
    let names = ["osprey_expert_slot_hits_total", "osprey_expert_slot_misses_total"];
    let full_slots = harness::metrics(full, &names);
    assert!(full_slots[0] > 0.0 && full_slots[1] > 0.0 && full_slots[1] <= 32.0, "{full_slots:?}");
    assert!(harness::metrics(streamed, &names)[1] > 32.0, "two slots per layer are refilled");
    // Streamed experts are read straight into the host arena: 2 per layer × 4 layers of slots, plus the
    // guesses' cap (read-ahead is on by default since issue 55: 2 layers × (top_k 2 + margin 2)), in use.
    let arena = harness::metrics(streamed, &["osprey_expert_arena_slots", "osprey_expert_arena_used"]);
    assert_eq!(arena[0], 8.0 + 8.0, "{arena:?}");
    assert!(arena[1] > 0.0 && arena[1] <= arena[0], "{arena:?}");
}

#[test]
fn a_failed_expert_read_fails_that_request_with_an_engine_error_and_the_server_keeps_serving() {
    let dir = nvfp4_dir();
    let full = start(Settings::default(), dir.clone());
    let layer: ReaderLayer = Box::new(|inner| Box::new(Faulty { inner, batch: 0, fail_at: 1 }));
    let faulty = start_with(Settings { expert_ram_experts: Some(2), ..Settings::default() }, dir, Some(layer));
    let body =
        json!({"messages": [{"role": "user", "content": "Tell me about experts."}], "max_tokens": 8, "temperature": 0});
    let r = ureq::post(&format!("http://{faulty}/v1/chat/completions"))
        .set("content-type", "application/json")
        .send_string(&body.to_string());
    let Err(ureq::Error::Status(code, resp)) = r else { panic!("the injected fault must fail the request") };
    assert_eq!(code, 500);
    let e: Value = serde_json::from_str(&resp.into_string().expect("body")).expect("json");
    assert_eq!(e["error"]["code"], "engine_error", "{e}");
    let msg = e["error"]["message"].as_str().unwrap_or_default();
    assert!(msg.contains("injected I/O error") && msg.contains("layer"), "{msg}");
    // The next request is served, and exactly as with every expert resident.
    let want = ask(full, &body);
    let got = ask(faulty, &body);
    assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
    assert_eq!(metric(faulty, "osprey_running_sequences"), 0.0);
}

/// Panics on its first read: a bug in an actor (here the expert residency manager's thread).
struct Panicking;

impl Reader for Panicking {
    fn read_batch(&mut self, _: &[ReadReq]) -> Vec<std::io::Result<ReadDone>> {
        panic!("injected panic in the expert reader");
    }
    fn kind(&self) -> ReaderKind {
        ReaderKind::Pread
    }
}

fn panicking_layer() -> Option<ReaderLayer> {
    Some(Box::new(|_inner| Box::new(Panicking)))
}

/// Regression (issue 26): an actor that panicked left a zombie, every request failing while `/health`
/// answered 200. Now `/health` turns 503 at once, naming the actor, and requests are refused as
/// unavailable.
#[test]
fn a_panicking_actor_turns_health_to_503_at_once() {
    let addr =
        start_with(Settings { expert_ram_experts: Some(2), ..Settings::default() }, nvfp4_dir(), panicking_layer());
    assert_eq!(harness::get(addr, "/health").0, 200);
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).to_string();
    let (code, _) = harness::post(addr, "/v1/chat/completions", &body, None);
    assert!(code >= 500, "the request that hit the panic fails, got {code}");
    let (code, health) = harness::get(addr, "/health");
    assert_eq!(code, 503, "{health}");
    let h: Value = serde_json::from_str(&health).expect("json");
    assert_eq!(h["status"], "engine_stopped");
    assert_eq!(h["actor"], "expert residency manager");
    let (code, e) = harness::post(addr, "/v1/chat/completions", &body, None);
    assert_eq!((code, e["error"]["code"].as_str()), (503, Some("unavailable")), "{e}");
}

/// ... and `osprey serve` exits with an error (status 1) soon after, for its service manager to restart it.
#[test]
fn serve_returns_an_error_when_an_actor_dies() {
    let (tx, rx) = std::sync::mpsc::channel();
    let (done_tx, done_rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let settings = Settings { port: Some(0), expert_ram_experts: Some(2), ..Settings::default() };
            let bound = osprey::start_with(&settings, &nvfp4_dir(), panicking_layer()).expect("start");
            tx.send(bound.addr).expect("address");
            let served = osprey::serve(bound, std::time::Duration::from_secs(1)).await;
            done_tx.send(served.map_err(|e| e.to_string())).expect("result");
        })
    });
    let addr = rx.recv_timeout(std::time::Duration::from_secs(60)).expect("started");
    let body = json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}).to_string();
    let _ = ureq::post(&format!("http://{addr}/v1/chat/completions"))
        .set("content-type", "application/json")
        .send_string(&body);
    let served = done_rx.recv_timeout(std::time::Duration::from_secs(10)).expect("serve returned");
    let err = served.expect_err("serve must fail when the engine dies");
    assert!(err.contains("expert residency manager"), "{err}");
}

/// Issue 36, item 3: `--expert-warmup` fills the budget after startup with no request (two experts in
/// each of the tiny model's four layers, nothing evicted), and the answers stay the fully resident ones.
#[test]
fn expert_warmup_fills_the_budget_in_the_background() {
    let dir = nvfp4_dir();
    let full = start(Settings::default(), dir.clone());
    let warm = start(Settings { expert_ram_experts: Some(2), expert_warmup: Some(true), ..Settings::default() }, dir);
    let t0 = std::time::Instant::now();
    while metric(warm, "osprey_expert_resident") < 8.0 {
        assert!(
            t0.elapsed() < std::time::Duration::from_secs(60),
            "{} experts warmed",
            metric(warm, "osprey_expert_resident")
        );
        std::thread::yield_now();
    }
    assert_eq!(metric(warm, "osprey_expert_resident"), 8.0, "2 per layer, no more");
    assert_eq!(metric(warm, "osprey_expert_evictions_total"), 0.0);
    let body = json!({"messages": [{"role": "user", "content": "Tell me about experts."}], "max_tokens": 12, "temperature": 0});
    assert_eq!(ask(warm, &body)["choices"][0]["message"], ask(full, &body)["choices"][0]["message"]);
}
