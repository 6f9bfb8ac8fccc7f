//! `osprey serve` on an NVFP4 checkpoint made by `osprey quantize`, streaming experts from disk under a RAM
//! budget far below the expert bytes, answers exactly as with every expert resident.

#[path = "../crates/models/tests/common/mod.rs"]
mod common;
mod harness;

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
