//! SIGTERM on the real binary: the server stops taking connections, lets running streams finish within
//! the grace period, ends the ones still running after it with an error event and `[DONE]`, and exits 0.

use crate::common;
use crate::harness;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::fixtures;
use serde_json::json;

struct Server {
    child: Child,
    addr: SocketAddr,
    log: Arc<Mutex<String>>,
}

fn spawn(grace_secs: u64) -> Server {
    let model = fixtures().join("models/qwen3_5_moe-tiny");
    let mut child = Command::new(env!("CARGO_BIN_EXE_osprey"))
        .args(["--threads", "2", "serve", "--port", "0", "--shutdown-grace-secs", &grace_secs.to_string()])
        .arg("--model")
        .arg(&model)
        .env("RUST_LOG", "info")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start osprey serve");
    let mut lines = BufReader::new(child.stderr.take().expect("stderr")).lines();
    let addr = loop {
        let line = lines.next().expect("the server logs its address").expect("stderr line");
        if let Some(rest) = line.split("listening on http://").nth(1) {
            let a = rest.split_whitespace().next().expect("address");
            break a.parse().expect("socket address");
        }
    };
    let log = Arc::new(Mutex::new(String::new()));
    let sink = log.clone();
    std::thread::spawn(move || {
        for l in lines.map_while(Result::ok) {
            sink.lock().expect("log").push_str(&(l + "\n"));
        }
    });
    Server { child, addr, log }
}

/// Starts a streamed chat completion and returns the connection after `events` SSE events arrived.
fn stream(addr: SocketAddr, max_tokens: usize, events: usize) -> (TcpStream, String) {
    let body = json!({"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": max_tokens,
        "stream": true, "temperature": 0, "ignore_eos": true})
    .to_string();
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(harness::raw_json_post("/v1/chat/completions", &body).as_bytes()).expect("send");
    let mut seen = String::new();
    let mut buf = [0u8; 4096];
    while seen.matches("data: ").count() < events {
        let n = s.read(&mut buf).expect("read");
        assert!(n > 0, "stream ended early: {seen}");
        seen.push_str(&String::from_utf8_lossy(&buf[..n]));
    }
    (s, seen)
}

/// The payload of the last SSE event (the body is chunked: chunk sizes sit between the lines).
fn last_event(seen: &str) -> &str {
    seen.rsplit("data: ").next().and_then(|e| e.lines().next()).unwrap_or_default().trim()
}

fn sigterm(child: &Child) {
    let ok = Command::new("kill").args(["-TERM", &child.id().to_string()]).status().expect("kill");
    assert!(ok.success());
}

fn exit_status(child: &mut Child) -> std::process::ExitStatus {
    let t0 = Instant::now();
    loop {
        if let Some(st) = child.try_wait().expect("wait") {
            return st;
        }
        assert!(t0.elapsed() < Duration::from_secs(60), "the server did not exit");
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn sigterm_lets_running_streams_finish_refuses_new_work_and_exits_0() {
    let mut srv = spawn(30);
    let (mut conn, mut seen) = stream(srv.addr, 48, 3);
    sigterm(&srv.child);
    // New work is refused from the signal on: the listener closes (or, on a connection accepted just
    // before, /health says draining).
    let t0 = Instant::now();
    loop {
        match TcpStream::connect(srv.addr) {
            Err(_) => break,
            Ok(mut c) => {
                let _ = c.write_all(harness::raw_request("GET", "/health", &[("Host", "localhost")], "").as_bytes());
                let mut r = String::new();
                let _ = c.read_to_string(&mut r);
                if r.is_empty() || r.contains(" 503 ") {
                    break;
                }
            }
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "still accepting work after SIGTERM");
        std::thread::sleep(Duration::from_millis(20));
    }
    conn.read_to_string(&mut seen).expect("the rest of the stream");
    assert!(seen.contains("\"finish_reason\":\"length\""), "the running stream finished normally: {seen}");
    assert!(last_event(&seen) == "[DONE]" && !seen.contains("\"error\""), "{seen}");
    assert!(exit_status(&mut srv.child).success(), "exit 0");
    assert!(srv.log.lock().expect("log").contains("drained"), "the drain is logged");
}

#[test]
fn past_the_grace_period_a_running_stream_ends_with_an_error_event_and_done() {
    let mut srv = spawn(0);
    let (mut conn, mut seen) = stream(srv.addr, 4000, 3);
    sigterm(&srv.child);
    conn.read_to_string(&mut seen).expect("the rest of the stream");
    assert!(seen.contains("\"code\":\"unavailable\""), "an error event: {}", &seen[seen.len().saturating_sub(400)..]);
    assert_eq!(last_event(&seen), "[DONE]", "then [DONE]");
    assert!(!seen.contains("\"finish_reason\":\"length\""), "it did not run to the end");
    assert!(exit_status(&mut srv.child).success(), "exit 0");
}

/// Reads one HTTP/1.1 response with a Content-Length body from a kept-alive connection.
fn read_response(c: &mut TcpStream) -> String {
    let mut buf = Vec::new();
    let mut byte = [0u8; 1];
    while !buf.ends_with(b"\r\n\r\n") {
        if c.read(&mut byte).expect("read") == 0 {
            return String::from_utf8_lossy(&buf).into_owned();
        }
        buf.push(byte[0]);
    }
    let head = String::from_utf8_lossy(&buf).to_ascii_lowercase();
    let len: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length:").map(|v| v.trim().parse().expect("length")))
        .unwrap_or(0);
    let mut body = vec![0u8; len];
    c.read_exact(&mut body).expect("body");
    head + &String::from_utf8_lossy(&body)
}

/// Regression (issue 26): an idle keep-alive connection opened before SIGTERM was closed without an
/// answer; it gets the documented draining response.
#[test]
fn a_request_on_an_idle_keep_alive_connection_during_the_drain_gets_503() {
    let mut srv = spawn(30);
    let mut idle = TcpStream::connect(srv.addr).expect("connect");
    let health = "GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n";
    idle.write_all(health.as_bytes()).expect("send");
    assert!(read_response(&mut idle).contains(" 200 "), "served before the signal");
    // A long generation keeps the drain going while the idle connection asks.
    let (mut conn, mut seen) = stream(srv.addr, 1000, 3);
    sigterm(&srv.child);
    std::thread::sleep(Duration::from_millis(200));
    idle.write_all(health.as_bytes()).expect("send on the kept-alive connection");
    let r = read_response(&mut idle);
    assert!(r.contains(" 503 ") && r.contains("draining"), "{r}");
    conn.read_to_string(&mut seen).expect("the rest of the stream");
    assert!(seen.contains("\"finish_reason\":\"length\""), "{seen}");
    assert!(exit_status(&mut srv.child).success(), "exit 0");
}
