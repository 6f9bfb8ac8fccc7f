//! Issue 27: a backend out of memory fails the step's requests with 503 `out_of_memory` and the engine
//! goes on. The CPU backend's memory cap (`--device-memory-mb`) stands in for a device's memory.

use crate::common;
use crate::harness;

use std::net::SocketAddr;

use common::fixtures;
use osprey::Settings;
use serde_json::{json, Value};

fn start(mb: f64) -> SocketAddr {
    let settings = Settings { device_memory_mb: Some(mb), disable_prefix_cache: Some(true), ..Settings::default() };
    harness::start(settings, fixtures().join("models/qwen3_5_moe-tiny"))
}

fn ask(addr: SocketAddr, words: usize) -> (u16, Value) {
    let text = vec!["apple"; words].join(" ");
    let body = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0});
    harness::post(addr, "/v1/chat/completions", &body.to_string(), None)
}

fn code(v: &Value) -> &str {
    v["error"]["code"].as_str().unwrap_or("")
}

/// 2 MiB holds the tiny model's activations and states for a short prompt, not the KV pages and prefill
/// chunks of a 3,200-token one (measured: its step asks for a 512 KiB chunk with ~420 KiB left).
#[test]
fn a_step_past_the_backend_memory_fails_with_503_and_the_engine_goes_on() {
    let addr = start(2.0);
    let (status, short) = ask(addr, 4);
    assert_eq!(status, 200, "{short}");
    let answer = short["choices"][0]["message"]["content"].clone();

    let (status, long) = ask(addr, 800);
    assert_eq!((status, code(&long)), (503, "out_of_memory"), "{long}");
    assert_eq!(long["error"]["type"], "server_error");
    assert!(long["error"]["message"].as_str().unwrap_or("").contains("bytes asked"), "{long}");

    // Nothing leaked: the same request fails the same way (the same bytes left), a short one is served
    // with the same answer, and health stays up.
    let (status, again) = ask(addr, 800);
    assert_eq!((status, &again["error"]), (503, &long["error"]), "a failed step must free what it took");
    let (status, short) = ask(addr, 4);
    assert_eq!(status, 200, "{short}");
    assert_eq!(short["choices"][0]["message"]["content"], answer);
    assert_eq!(harness::get(addr, "/health").0, 200);

    // A stream that runs out of memory ends with an error event and [DONE].
    let body = json!({"messages": [{"role": "user", "content": vec!["apple"; 800].join(" ")}],
        "max_tokens": 4, "stream": true});
    let events = harness::sse(addr, "/v1/chat/completions", &body);
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"), "{events:?}");
    assert!(events.iter().any(|e| e.contains("out_of_memory")), "{events:?}");
}

/// Issue 40: an image whose vision encoding runs out of the backend's memory fails with 503
/// `out_of_memory` as a decoder step does (it was 500 `engine_error`), and the engine goes on.
#[test]
fn an_image_past_the_backend_memory_fails_with_503_too() {
    let addr = start(2.0);
    let content = json!([harness::media_part("image", "img_640x480"), {"type": "text", "text": "What is it?"}]);
    let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 1});
    let (status, v) = harness::post(addr, "/v1/chat/completions", &body.to_string(), None);
    assert_eq!((status, code(&v)), (503, "out_of_memory"), "{v}");
    assert_eq!(ask(addr, 4).0, 200);
    assert_eq!(harness::get(addr, "/health").0, 200);
}
