//! `osprey serve` on an NVFP4 checkpoint made by `osprey quantize`, streaming experts from disk under a RAM
//! budget far below the expert bytes, answers exactly as with every expert resident.

#[path = "../crates/models/tests/common/mod.rs"]
mod common;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use common::fixtures;
use osprey::Settings;
use serde_json::{json, Value};

fn start(settings: Settings, dir: PathBuf) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let settings = Settings { port: Some(0), ..settings };
            let (server, addr) = osprey::start(&settings, &dir).expect("start");
            tx.send(addr).expect("addr");
            server.await.expect("server");
        })
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("started")
}

fn ask(addr: SocketAddr, body: &Value) -> Value {
    let r = ureq::post(&format!("http://{addr}/v1/chat/completions")).send_string(&body.to_string()).expect("request");
    serde_json::from_str(&r.into_string().expect("body")).expect("json")
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = ureq::get(&format!("http://{addr}/metrics")).call().expect("metrics").into_string().expect("body");
    text.lines().find_map(|l| l.strip_prefix(&format!("{name} ")).and_then(|v| v.parse().ok())).unwrap_or(f64::NAN)
}

#[test]
fn a_budget_of_top_k_experts_per_layer_answers_exactly_as_fully_resident() {
    let dir = std::env::temp_dir().join(format!("osprey-serve-nvfp4-{}", std::process::id()));
    osprey_models::quantize_dir(&fixtures().join("models/qwen3_5_moe-tiny"), &dir, Default::default(), &mut |_, _| {})
        .expect("quantize");
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
