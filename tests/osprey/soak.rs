//! A short soak (the long one is `tools/soak.py`): concurrent clients over a real socket for a few
//! seconds, a mix of text, image and video requests through chat completions, Responses and Messages,
//! streamed and not, some leaving mid-stream. Nothing may fail, and the server is idle and healthy
//! afterwards.

use crate::common;
use crate::harness;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

use common::fixtures;
use harness::{data_url, metric};
use osprey::Settings;
use serde_json::{json, Value};

/// A request of `kind`: the medium (`kind % 4`: image, video, text, text) and the front end
/// (`kind / 4 % 3`: chat completions, Responses, Messages; a video always goes to chat, the only API with
/// video parts). Returns the path and the body.
fn body(kind: u64, stream: bool) -> (&'static str, Value) {
    let media = fixtures().join("media/default");
    let image = data_url(&media.join("red_circle_img0.png"));
    let (max, temperature) = (8 + kind % 24, if kind.is_multiple_of(2) { 0.0 } else { 0.8 });
    let api = if kind % 4 == 1 { 0 } else { kind / 4 % 3 };
    let text = "What is in it?";
    match (api, kind % 4) {
        (1, m) => {
            let input = if m == 0 {
                json!([{"role": "user", "content": [{"type": "input_image", "image_url": image}, {"type": "input_text", "text": text}]}])
            } else {
                json!("Tell me about the sea.")
            };
            (
                "/v1/responses",
                json!({"input": input, "max_output_tokens": max, "stream": stream, "temperature": temperature}),
            )
        }
        (2, m) => {
            let content = if m == 0 {
                let data = image.split_once(',').map(|x| x.1.to_string()).unwrap_or_default();
                json!([{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}, {"type": "text", "text": text}])
            } else {
                json!("Tell me about the sea.")
            };
            (
                "/v1/messages",
                json!({"messages": [{"role": "user", "content": content}], "max_tokens": max, "stream": stream, "temperature": temperature}),
            )
        }
        (_, m) => {
            let q = json!({"type": "text", "text": text});
            let content = match m {
                0 => json!([{"type": "image_url", "image_url": {"url": image}}, q]),
                1 => {
                    let frames: Vec<String> =
                        (0..4).map(|i| data_url(&media.join(format!("moving_left_vid0_{i}.png")))).collect();
                    json!([{"type": "video", "video": frames, "fps": 2}, q])
                }
                _ => json!("Tell me about the sea."),
            };
            (
                "/v1/chat/completions",
                json!({"messages": [{"role": "user", "content": content}], "max_tokens": max, "stream": stream, "temperature": temperature}),
            )
        }
    }
}

/// One request; `leave` closes the connection after the first events of a stream. Returns the status.
fn one(addr: SocketAddr, kind: u64, stream: bool, leave: bool) -> u16 {
    let (path, b) = body(kind, stream);
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).expect("timeout");
    s.write_all(harness::raw_json_post(path, &b.to_string()).as_bytes()).expect("send");
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
    // An error object (OpenAI or Anthropic envelope, or an error event); a Responses object's own
    // `"error": null` is not one.
    let failed = text.contains("\"error\":{") || text.contains("event: error");
    assert!(!failed, "an error under load on {path}: {text}");
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
