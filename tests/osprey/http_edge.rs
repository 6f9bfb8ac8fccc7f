//! The HTTP edge as a browser on the home network (or an attacker's page in it) meets it, over a real
//! socket: wrong paths and methods, bodies that are not JSON or too large, DNS rebinding, CORS, and a
//! user message without content. Each case reproduces a failure reported against the server.

use crate::common;
use crate::harness;

use std::io::{Read, Write};
use std::net::SocketAddr;

use common::fixtures;
use harness::raw_request as request;
use osprey::Settings;
use serde_json::{json, Value};

fn start(settings: Settings) -> SocketAddr {
    harness::start(settings, fixtures().join("models/qwen3_5_moe-tiny"))
}

/// One raw HTTP/1.1 exchange: status, headers (lower-cased names) and body.
fn raw(addr: SocketAddr, request: &str) -> (u16, String, String) {
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.write_all(request.as_bytes()).expect("send");
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split_whitespace().nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    (status, head.to_ascii_lowercase(), body.to_string())
}

fn code(body: &str) -> String {
    serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| v["error"]["code"].as_str().map(String::from))
        .unwrap_or_default()
}

const JSON: (&str, &str) = ("Content-Type", "application/json");
const LOCAL: (&str, &str) = ("Host", "127.0.0.1:8080");

#[test]
fn paths_methods_content_types_and_sizes_get_their_own_codes() {
    let addr = start(Settings::default());
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let (s, _, b) = raw(addr, &request("GET", "/v1/nope", &[LOCAL], ""));
    assert_eq!((s, code(&b)), (404, "not_found".into()), "unknown path");
    let (s, h, b) = raw(addr, &request("GET", "/v1/chat/completions", &[LOCAL], ""));
    assert_eq!((s, code(&b)), (405, "method_not_allowed".into()), "wrong method");
    assert!(h.contains("allow: post"), "{h}");
    let (s, h, _) = raw(addr, &request("POST", "/metrics", &[LOCAL], ""));
    assert!(s == 405 && h.contains("allow: get"), "{h}");
    // A web page can send text/plain or a form without a preflight: refused.
    for ct in ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"] {
        let (s, _, b) = raw(addr, &request("POST", "/v1/chat/completions", &[LOCAL, ("Content-Type", ct)], &chat));
        assert_eq!((s, code(&b)), (415, "unsupported_media_type".into()), "{ct}");
    }
    let (s, _, b) = raw(addr, &request("POST", "/v1/chat/completions", &[LOCAL], &chat));
    assert_eq!((s, code(&b)), (415, "unsupported_media_type".into()), "no content type");
    let (s, _, _) = raw(
        addr,
        &request("POST", "/v1/chat/completions", &[LOCAL, ("Content-Type", "application/json; charset=utf-8")], &chat),
    );
    assert_eq!(s, 200, "JSON with a charset is JSON");
    // A body over the limit, announced by its length: refused before it is read.
    let big = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: 100000000\r\n\r\n{";
    let (s, _, b) = raw(addr, big);
    assert_eq!((s, code(&b)), (413, "request_too_large".into()));
    // A user message without content.
    let null = json!({"messages": [{"role": "user", "content": null}], "max_tokens": 2}).to_string();
    let (s, _, b) = raw(addr, &request("POST", "/v1/chat/completions", &[LOCAL, JSON], &null));
    assert_eq!((s, code(&b)), (400, "invalid_request".into()), "content: null");
    let (s, _, _) = raw(addr, &request("POST", "/v1/chat/completions", &[LOCAL, JSON], &chat));
    assert_eq!(s, 200, "and the server keeps serving");
}

#[test]
fn without_a_key_a_foreign_host_is_refused_and_only_allowed_origins_pass_cors() {
    let addr = start(Settings {
        allowed_hosts: Some(vec!["osprey.lan".into()]),
        allowed_origins: Some(vec!["https://chat.example".into()]),
        ..Settings::default()
    });
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    // DNS rebinding: attacker.example resolved to 127.0.0.1, the browser sends its own name.
    let (s, _, b) =
        raw(addr, &request("POST", "/v1/chat/completions", &[("Host", "attacker.example:8080"), JSON], &chat));
    assert_eq!((s, code(&b)), (403, "host_not_allowed".into()));
    for host in ["localhost:8080", "127.0.0.1", "osprey.lan", "192.168.1.20:8080"] {
        let (s, _, _) = raw(addr, &request("POST", "/v1/chat/completions", &[("Host", host), JSON], &chat));
        assert_eq!(s, 200, "{host}");
    }
    // CORS: a preflight from the allowed origin is answered, from another one refused.
    let pre = |origin: &str| {
        request(
            "OPTIONS",
            "/v1/chat/completions",
            &[LOCAL, ("Origin", origin), ("Access-Control-Request-Method", "POST")],
            "",
        )
    };
    let (s, h, _) = raw(addr, &pre("https://chat.example"));
    assert_eq!(s, 204);
    assert!(h.contains("access-control-allow-origin: https://chat.example"), "{h}");
    assert!(h.contains("access-control-allow-headers: authorization, content-type"), "{h}");
    let (s, h, b) = raw(addr, &pre("https://evil.example"));
    assert_eq!((s, code(&b)), (403, "origin_not_allowed".into()));
    assert!(!h.contains("access-control-allow-origin"), "{h}");
    let (s, h, _) = raw(addr, &request("OPTIONS", "/v1/models", &[LOCAL], ""));
    assert!(s == 204 && h.contains("allow: get, post, delete, options"), "plain OPTIONS: {h}");
    // The actual request from the allowed origin carries the header; from another origin it does not.
    let (s, h, _) =
        raw(addr, &request("POST", "/v1/chat/completions", &[LOCAL, JSON, ("Origin", "https://chat.example")], &chat));
    assert!(s == 200 && h.contains("access-control-allow-origin: https://chat.example"), "{h}");
    let (_, h, _) = raw(addr, &request("GET", "/v1/models", &[LOCAL, ("Origin", "https://evil.example")], ""));
    assert!(!h.contains("access-control-allow-origin"), "{h}");
}

#[test]
fn with_an_api_key_any_host_is_served_and_the_key_is_the_gate() {
    let addr = start(Settings { api_key: Some("sekret".into()), ..Settings::default() });
    let chat = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let host = ("Host", "osprey.example.org");
    let (s, _, b) = raw(addr, &request("POST", "/v1/chat/completions", &[host, JSON], &chat));
    assert_eq!((s, code(&b)), (401, "invalid_api_key".into()));
    let (s, _, _) =
        raw(addr, &request("POST", "/v1/chat/completions", &[host, JSON, ("Authorization", "Bearer sekret")], &chat));
    assert_eq!(s, 200);
}

#[test]
fn media_errors_say_what_is_wrong_with_the_media() {
    let addr = start(Settings::default());
    let frame = harness::data_url(&fixtures().join("media/default/moving_left_vid0_0.png"));
    let mp4 = format!(
        "data:video/mp4;base64,{}",
        base64::Engine::encode(&base64::engine::general_purpose::STANDARD, b"\0\0\0\x18ftypisom0000000000000000")
    );
    for (part, want) in [
        (json!({"type": "video", "video": [frame]}), "needs at least 2 frames"),
        (json!({"type": "video_url", "video_url": {"url": mp4}}), "MP4/MOV video is not supported"),
    ] {
        let body =
            json!({"messages": [{"role": "user", "content": [part, {"type": "text", "text": "?"}]}], "max_tokens": 2});
        let (s, e) = harness::post(addr, "/v1/chat/completions", &body.to_string(), None);
        let msg = e["error"]["message"].as_str().unwrap_or_default();
        assert_eq!((s, e["error"]["code"].as_str()), (400, Some("invalid_media")), "{e}");
        assert!(msg.contains(want), "{msg}");
        assert!(
            !msg.contains("model configuration")
                && !msg.contains("temporal_factor")
                && !msg.starts_with("invalid input"),
            "{msg}"
        );
    }
}

#[test]
fn a_prompt_too_long_in_bytes_is_refused_before_it_is_tokenized() {
    let addr = start(Settings::default());
    // 20 MB of text (under the 64 MiB body limit): no tokenization can bring it under 4,096 tokens.
    let text = "word ".repeat(4 << 20);
    let chat = json!({"messages": [{"role": "user", "content": text}], "max_tokens": 2}).to_string();
    let (s, e) = harness::post(addr, "/v1/chat/completions", &chat, None);
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{e}");
    assert!(e["error"]["message"].as_str().is_some_and(|m| m.contains("bytes of text")), "{e}");
    // A completion body is its prompt: past twice what the context holds as text (+1 MiB) it is refused
    // as a body (2 MiB for this model), under that by the same byte rule.
    let completion = json!({"prompt": "word ".repeat(4 << 20), "max_tokens": 2}).to_string();
    let (s, e) = harness::post(addr, "/v1/completions", &completion, None);
    assert_eq!((s, e["error"]["code"].as_str()), (413, Some("request_too_large")), "{e}");
    let completion = json!({"prompt": "word ".repeat(200_000), "max_tokens": 2}).to_string();
    let (s, e) = harness::post(addr, "/v1/completions", &completion, None);
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("context_length_exceeded")), "{e}");
    assert_eq!(harness::metric(addr, "osprey_prompt_tokens_total"), 0.0, "nothing reached the engine");
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    assert_eq!(harness::post(addr, "/v1/chat/completions", &ok, None).0, 200);
}

/// A long stream keeps the only running slot busy; returns the connection (drop it to cancel).
fn busy(addr: SocketAddr) -> std::net::TcpStream {
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 4000,
        "stream": true, "temperature": 0, "ignore_eos": true})
    .to_string();
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    let req = request("POST", "/v1/chat/completions", &[LOCAL, JSON], &body);
    s.write_all(req.as_bytes()).expect("send");
    let mut buf = [0u8; 4096];
    let mut seen = String::new();
    while seen.matches("data: ").count() < 3 {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0);
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    s
}

#[test]
fn a_full_queue_answers_503_with_retry_after_and_so_does_a_long_wait() {
    let full = start(Settings { max_running_requests: Some(1), max_queued_requests: Some(1), ..Settings::default() });
    let running = busy(full);
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    // One request may wait; it is sent on its own thread and stays queued behind the long stream.
    let waiting = std::thread::spawn(move || harness::post(full, "/v1/chat/completions", &short, None));
    let t0 = std::time::Instant::now();
    while harness::metric(full, "osprey_queue_length") < 1.0 {
        assert!(t0.elapsed() < std::time::Duration::from_secs(20), "the second request never queued");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    let third = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": true}).to_string();
    let (s, h, b) = raw(full, &request("POST", "/v1/chat/completions", &[LOCAL, JSON], &third));
    assert_eq!((s, code(&b)), (503, "overloaded".into()), "a streamed request is refused before streaming: {b}");
    assert!(h.contains("retry-after: 2"), "{h}");
    drop(running);
    assert_eq!(waiting.join().expect("client").0, 200, "the queued request is served once the slot frees");
    assert_eq!(harness::metric(full, "osprey_overloaded_total"), 1.0);

    let slow = start(Settings { max_running_requests: Some(1), max_queue_wait_secs: Some(0.5), ..Settings::default() });
    let running = busy(slow);
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let (s, e) = harness::post(slow, "/v1/chat/completions", &short, None);
    assert_eq!((s, e["error"]["code"].as_str()), (503, Some("overloaded")), "{e}");
    drop(running);
}

#[test]
fn stalled_bodies_get_408_and_their_connections_are_closed() {
    let addr = start(Settings { body_timeout_secs: Some(0.5), ..Settings::default() });
    let head = "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"messages\"";
    let conns: Vec<std::net::TcpStream> = (0..20)
        .map(|_| {
            let mut s = std::net::TcpStream::connect(addr).expect("connect");
            s.write_all(head.as_bytes()).expect("send");
            s.set_read_timeout(Some(std::time::Duration::from_secs(30))).expect("timeout");
            s
        })
        .collect();
    for mut s in conns {
        let mut out = String::new();
        // read_to_string returns only when the server closes the connection.
        s.read_to_string(&mut out).expect("the server answers and closes");
        let (head, body) = out.split_once("\r\n\r\n").unwrap_or((&out, ""));
        assert!(head.starts_with("HTTP/1.1 408"), "{out}");
        assert!(body.contains("request_timeout"), "{out}");
    }
    let ok = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    assert_eq!(harness::post(addr, "/v1/chat/completions", &ok, None).0, 200, "and the server keeps serving");
}

#[test]
fn a_short_request_finishes_while_eight_long_streams_are_still_running() {
    // The default KV capacity (4 × 4,096 tokens) reserved prompt + max_tokens up front and let only five
    // of these long streams in; the short request then waited for them to finish.
    let addr = start(Settings::default());
    let longs: Vec<std::net::TcpStream> = (0..8).map(|_| busy(addr)).collect();
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).to_string();
    let (s, v) = harness::post(addr, "/v1/chat/completions", &short, None);
    assert_eq!(s, 200, "{v}");
    assert_eq!(harness::metric(addr, "osprey_running_sequences"), 8.0, "the eight long streams are all still running");
    drop(longs);
}

#[test]
fn the_pixels_of_a_whole_request_are_bounded_before_decoding() {
    // One 105 × 83 image (8,715 pixels) fits a 12,000-pixel request budget; two do not.
    let addr = start(Settings { max_request_pixels: Some(12_000), ..Settings::default() });
    let img = json!({"type": "image_url", "image_url": {"url": harness::data_url(&fixtures().join("media/default/red_circle_img0.png"))}});
    let one = json!({"messages": [{"role": "user", "content": [img.clone(), {"type": "text", "text": "?"}]}], "max_tokens": 2});
    assert_eq!(harness::post(addr, "/v1/chat/completions", &one.to_string(), None).0, 200);
    let two = json!({"messages": [{"role": "user", "content": [img.clone(), img, {"type": "text", "text": "?"}]}], "max_tokens": 2});
    let (s, e) = harness::post(addr, "/v1/chat/completions", &two.to_string(), None);
    assert_eq!((s, e["error"]["code"].as_str()), (413, Some("media_too_large")), "{e}");
    assert!(e["error"]["message"].as_str().is_some_and(|m| m.contains("in total")), "{e}");
}

#[test]
fn a_deadline_ends_a_generation_with_timeout_and_a_queued_request_with_504() {
    let addr = start(Settings { max_running_requests: Some(1), ..Settings::default() });
    let long = |extra: Value| {
        let mut body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
            "max_tokens": 4000, "temperature": 0, "ignore_eos": true});
        body.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
        body
    };
    // Its own deadline ends a long generation with the text so far and finish_reason "timeout".
    let t0 = std::time::Instant::now();
    let v = harness::chat(addr, &long(json!({"deadline_secs": 0.5})));
    let took = t0.elapsed().as_secs_f64();
    let done = v["usage"]["completion_tokens"].as_u64().expect("usage");
    assert_eq!(v["choices"][0]["finish_reason"], "timeout", "{v}");
    assert!(done > 0 && done < 4000, "stopped part-way: {done} tokens");
    assert!((0.5..5.0).contains(&took), "ended at its deadline, not at max_tokens: {took:.2} s");
    // Streamed: the last chunk says "timeout", then [DONE].
    let events = harness::sse(addr, "/v1/chat/completions", &long(json!({"deadline_secs": 0.4, "stream": true})));
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let last: Value = serde_json::from_str(&events[events.len() - 2]).expect("json chunk");
    assert_eq!(last["choices"][0]["finish_reason"], "timeout", "{last}");
    // Still queued behind a long stream when the deadline passes: 504 deadline_exceeded.
    let running = busy(addr);
    let short = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "deadline_secs": 0.3});
    let (s, e) = harness::post(addr, "/v1/chat/completions", &short.to_string(), None);
    assert_eq!((s, e["error"]["code"].as_str()), (504, Some("deadline_exceeded")), "{e}");
    drop(running);
    let bad = json!({"messages": [{"role": "user", "content": "hi"}], "deadline_secs": -1});
    let (s, e) = harness::post(addr, "/v1/chat/completions", &bad.to_string(), None);
    assert_eq!((s, e["error"]["param"].as_str()), (400, Some("deadline_secs")), "{e}");
    assert_eq!(harness::metric(addr, "osprey_deadline_exceeded_total"), 3.0);

    // The server-wide deadline applies to requests that set none, and caps those that ask for more.
    let capped = start(Settings { request_deadline_secs: Some(0.5), ..Settings::default() });
    for extra in [json!({}), json!({"deadline_secs": 1000})] {
        let t0 = std::time::Instant::now();
        let v = harness::chat(capped, &long(extra));
        assert_eq!(v["choices"][0]["finish_reason"], "timeout", "{v}");
        assert!(t0.elapsed().as_secs_f64() < 5.0);
    }
}

#[test]
fn idle_connections_and_unfinished_request_heads_are_closed() {
    let addr = start(Settings { idle_timeout_secs: Some(0.5), ..Settings::default() });
    let t0 = std::time::Instant::now();
    let mut silent = std::net::TcpStream::connect(addr).expect("connect");
    let mut half = std::net::TcpStream::connect(addr).expect("connect");
    half.write_all(b"POST /v1/chat/completions HTTP/1.1\r\nHost: local").expect("send");
    for s in [&mut silent, &mut half] {
        s.set_read_timeout(Some(std::time::Duration::from_secs(30))).expect("timeout");
        let mut out = Vec::new();
        s.read_to_end(&mut out).expect("the server closes the connection");
    }
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(3),
        "closed after the 0.5 s idle timeout (actix defaults to 5 s)"
    );
}
