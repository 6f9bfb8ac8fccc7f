//! One request can be followed through the log: its id is in the `request{id=…}` span that the tokenizer,
//! scheduler, runner and vision encoder log under, and in the `step{seqs=[…]}` span the expert residency
//! manager logs its reads under. Real server, real HTTP, experts streamed from disk.

#[path = "../crates/models/tests/common/mod.rs"]
mod common;
mod harness;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::fixtures;
use harness::{chat, data_url, quantize_to_temp, start};
use osprey::Settings;
use serde_json::json;

/// Everything the subscriber writes, shared with the test.
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().expect("log lock").extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_request_id_is_followed_from_tokenizer_to_experts_in_the_log() {
    let log = Log::default();
    let writer = log.clone();
    tracing_subscriber::fmt()
        .with_env_filter("osprey=debug,osprey_tokenizer=debug,osprey_scheduler=debug,osprey_runner=debug,osprey_vision=debug,osprey_experts=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let dir = quantize_to_temp(&fixtures().join("models/qwen3_5_moe-tiny"), "tracing-nvfp4");
    let addr = start(Settings { expert_ram_experts: Some(2), ..Settings::default() }, dir);
    let image = json!({"type": "image_url", "image_url": {"url": data_url(&fixtures().join("media/img_224x160.png"))}});
    let body = json!({"messages": [{"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}],
        "max_tokens": 3, "temperature": 0});
    let v = chat(addr, &body);
    let id: u64 = v["id"].as_str().and_then(|s| s.strip_prefix("chatcmpl-")).and_then(|n| n.parse().ok()).expect("id");
    let text = String::from_utf8(log.0.lock().expect("log lock").clone()).expect("utf-8 log");
    let mine = format!("request{{id={id}}}");
    let lines = |what: &str| text.lines().filter(|l| l.contains(&mine) && l.contains(what)).count();
    assert!(lines("prompt prepared") == 1, "tokenizer line for {mine}:\n{text}");
    assert!(lines("queued") == 1 && lines("finished") == 1, "scheduler lines for {mine}:\n{text}");
    assert!(lines("chunk") >= 3, "runner lines (prefill + 2 decode steps) for {mine}:\n{text}");
    assert!(lines("vision rows") == 1, "vision line for {mine}:\n{text}");
    let step = format!("step{{seqs=[{id}]}}");
    let experts = text.lines().filter(|l| l.contains(&step) && l.contains("experts needed")).count();
    assert!(experts >= 3, "expert reads under {step}:\n{text}");
}
