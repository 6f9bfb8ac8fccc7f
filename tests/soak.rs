//! A short soak (the long one is `tools/soak.py`): concurrent clients over a real socket for a few
//! seconds, a mix of text, image and video requests, streamed and not, some leaving mid-stream. Nothing
//! may fail, and the server is idle and healthy afterwards.

#[path = "../crates/models/tests/common/mod.rs"]
mod common;
mod harness;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::fixtures;
use harness::{data_url, metric};
use osprey::Settings;
use serde_json::{json, Value};

fn body(kind: u64, stream: bool) -> Value {
    let media = fixtures().join("media/default");
    let q = json!({"type": "text", "text": "What is in it?"});
    let content = match kind % 4 {
        0 => json!([{"type": "image_url", "image_url": {"url": data_url(&media.join("red_circle_img0.png"))}}, q]),
        1 => {
            let frames: Vec<String> =
                (0..4).map(|i| data_url(&media.join(format!("moving_left_vid0_{i}.png")))).collect();
            json!([{"type": "video", "video": frames, "fps": 2}, q])
        }
        _ => json!("Tell me about the sea."),
    };
    json!({"messages": [{"role": "user", "content": content}], "max_tokens": 8 + kind % 24, "stream": stream,
        "temperature": if kind.is_multiple_of(2) { 0.0 } else { 0.8 }})
}

/// One request; `leave` closes the connection after the first events of a stream. Returns the status.
fn one(addr: SocketAddr, kind: u64, stream: bool, leave: bool) -> u16 {
    let b = body(kind, stream).to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    s.write_all(harness::raw_json_post("/v1/chat/completions", &b).as_bytes()).expect("send");
    let mut out = Vec::new();
    let mut buf = [0u8; 4096];
    loop {
        let n = s.read(&mut buf).expect("read");
        if n == 0 {
            break;
        }
        out.extend_from_slice(&buf[..n]);
        if leave && String::from_utf8_lossy(&out).matches("data: ").count() >= 2 {
            return 200;
        }
    }
    let text = String::from_utf8_lossy(&out);
    assert!(!text.contains("\"error\""), "an error under load: {text}");
    text.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0)
}

#[test]
fn concurrent_mixed_clients_for_a_few_seconds_get_no_errors() {
    let addr = harness::start(
        Settings { max_running_requests: Some(6), ..Settings::default() },
        fixtures().join("models/osprey-default"),
    );
    let until = Instant::now() + Duration::from_secs(4);
    let clients: Vec<_> = (0..8u64)
        .map(|c| {
            std::thread::spawn(move || {
                let mut n = 0;
                while Instant::now() < until {
                    let k = c * 1000 + n;
                    let status = one(addr, k, k.is_multiple_of(2), k.is_multiple_of(5));
                    assert_eq!(status, 200, "client {c} request {n}");
                    n += 1;
                }
                n
            })
        })
        .collect();
    let done: u64 = clients.into_iter().map(|h| h.join().expect("client")).sum();
    assert!(done >= 8, "{done} requests");
    let t0 = Instant::now();
    while metric(addr, "osprey_running_sequences") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "sequences left running");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(metric(addr, "osprey_requests_failed_total"), 0.0);
    let (s, _) = harness::get(addr, "/health");
    assert_eq!(s, 200);
}
