//! Shared helpers of the HTTP integration tests: a real server on an ephemeral port (its own thread and
//! actix System) and a blocking client (ureq) for JSON, SSE and metrics.
#![allow(dead_code)] // each test binary uses a different subset

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine;
use osprey::{ReaderLayer, Settings};
use serde_json::Value;

/// Starts `osprey serve` on `dir` with `settings` (port forced to 0) and returns its address.
pub fn start(settings: Settings, dir: PathBuf) -> SocketAddr {
    start_with(settings, dir, None)
}

/// As [`start`], with the expert reader wrapped by `layer` (fault injection).
pub fn start_with(settings: Settings, dir: PathBuf, layer: Option<ReaderLayer>) -> SocketAddr {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        actix_web::rt::System::new().block_on(async move {
            let settings = Settings { port: Some(0), ..settings };
            let bound = osprey::start_with(&settings, &dir, layer).expect("start server");
            tx.send(bound.addr).expect("report address");
            bound.server.await.expect("server");
        })
    });
    rx.recv_timeout(Duration::from_secs(60)).expect("server started")
}

/// POSTs `body`; returns the status and the JSON body (success or OpenAI error).
pub fn post(addr: SocketAddr, path: &str, body: &str, key: Option<&str>) -> (u16, Value) {
    let mut req = ureq::post(&format!("http://{addr}{path}")).set("content-type", "application/json");
    if let Some(k) = key {
        req = req.set("authorization", &format!("Bearer {k}"));
    }
    match req.send_string(body) {
        Ok(r) => (r.status(), serde_json::from_str(&r.into_string().expect("body")).expect("json body")),
        Err(ureq::Error::Status(code, r)) => {
            (code, serde_json::from_str(&r.into_string().expect("body")).expect("json error body"))
        }
        Err(e) => panic!("transport error: {e}"),
    }
}

/// A chat completion that must succeed.
pub fn chat(addr: SocketAddr, body: &Value) -> Value {
    let (status, v) = post(addr, "/v1/chat/completions", &body.to_string(), None);
    assert_eq!(status, 200, "{v}");
    v
}

/// A chat completion that must succeed: `"{reasoning_content}|{content}"` of its message, and the whole
/// response.
pub fn answer(addr: SocketAddr, body: &Value) -> (String, Value) {
    let v = chat(addr, body);
    let m = &v["choices"][0]["message"];
    let text = format!("{}|{}", m["reasoning_content"].as_str().unwrap_or(""), m["content"].as_str().unwrap_or(""));
    (text, v)
}

pub fn get(addr: SocketAddr, path: &str) -> (u16, String) {
    match ureq::get(&format!("http://{addr}{path}")).call() {
        Ok(r) => (r.status(), r.into_string().expect("body")),
        Err(ureq::Error::Status(code, r)) => (code, r.into_string().expect("body")),
        Err(e) => panic!("transport error: {e}"),
    }
}

/// Reads an SSE response into its `data:` payloads.
pub fn sse(addr: SocketAddr, path: &str, body: &Value) -> Vec<String> {
    let r = ureq::post(&format!("http://{addr}{path}"))
        .set("content-type", "application/json")
        .send_string(&body.to_string())
        .expect("stream");
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    BufReader::new(r.into_reader())
        .lines()
        .map_while(Result::ok)
        .filter_map(|l| l.strip_prefix("data: ").map(str::to_string))
        .collect()
}

/// A raw HTTP/1.1 request (`Connection: close`, `Content-Length` of `body`) with extra `headers`, for
/// tests that speak to the socket themselves (streams they read in part, stalled or odd requests).
pub fn raw_request(method: &str, path: &str, headers: &[(&str, &str)], body: &str) -> String {
    let mut r = format!("{method} {path} HTTP/1.1\r\nConnection: close\r\nContent-Length: {}\r\n", body.len());
    for (k, v) in headers {
        r.push_str(&format!("{k}: {v}\r\n"));
    }
    r + "\r\n" + body
}

/// A JSON POST to localhost as [`raw_request`] writes it.
pub fn raw_json_post(path: &str, body: &str) -> String {
    raw_request("POST", path, &[("Host", "localhost"), ("Content-Type", "application/json")], body)
}

/// One Prometheus sample from `/metrics` (NaN when absent).
pub fn metric(addr: SocketAddr, name: &str) -> f64 {
    metrics(addr, &[name])[0]
}

/// Several metrics from one scrape (values that must agree with each other).
pub fn metrics(addr: SocketAddr, names: &[&str]) -> Vec<f64> {
    let (_, text) = get(addr, "/metrics");
    names
        .iter()
        .map(|name| {
            text.lines()
                .find_map(|l| l.strip_prefix(&format!("{name} ")).and_then(|v| v.parse().ok()))
                .unwrap_or(f64::NAN)
        })
        .collect()
}

/// A PNG file as a `data:` URL.
pub fn data_url(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(bytes))
}

/// `osprey quantize` (NVFP4 experts) of `src` into a fresh temporary directory named after `tag` and
/// this process. Callers keep the result in a `OnceLock`: tests run in parallel threads.
pub fn quantize_to_temp(src: &Path, tag: &str) -> PathBuf {
    let dir = scratch_dir(tag);
    osprey_models::quantize_dir(src, &dir, Default::default(), &mut |_, _| {}).expect("quantize");
    dir
}

/// A scratch directory for this test binary, emptied first: under cargo's per-target tmp dir and
/// named after the test crate and `tag`, so reruns reuse one directory instead of leaving one per
/// process in /tmp (cargo runs test binaries one at a time).
pub fn scratch_dir(tag: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{}-{tag}", env!("CARGO_CRATE_NAME")));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("create the scratch directory");
    dir
}

/// A fixture medium as an OpenAI content part: an image as a `data:` URL, a video as its frames.
pub fn media_part(kind: &str, name: &str) -> Value {
    let dir = fixtures_dir().join("media");
    if kind == "image" {
        serde_json::json!({"type": "image_url", "image_url": {"url": data_url(&dir.join(format!("{name}.png")))}})
    } else {
        let n = if name.starts_with("vid4") { 4 } else { 5 };
        let frames: Vec<String> = (0..n).map(|i| data_url(&dir.join(format!("{name}_{i}.png")))).collect();
        serde_json::json!({"type": "video", "video": frames, "fps": 2.0})
    }
}

/// The messages a transformers fixture case was rendered from (`meta`: its summary entry).
pub fn case_messages(meta: &Value, case: &str) -> Value {
    if case == "text" {
        return serde_json::json!([{"role": "system", "content": "You are a helpful assistant."},
                                  {"role": "user", "content": "Describe the weather in Paris in one sentence."}]);
    }
    let mut content: Vec<Value> = meta["media"]
        .as_array()
        .expect("media")
        .iter()
        .map(|m| media_part(m[0].as_str().expect("kind"), m[1].as_str().expect("name")))
        .collect();
    content.push(serde_json::json!({"type": "text", "text": meta["question"]}));
    serde_json::json!([{"role": "user", "content": content}])
}

fn fixtures_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}
