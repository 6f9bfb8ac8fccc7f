//! The real server on an ephemeral port, driven over real HTTP (ureq), compared with the transformers
//! fixtures where a reference exists. Tolerance for logprobs: 1e-4 (crates/models/tests/models/parity.rs), on the
//! exact path (`--activations f32`) that the servers compared with references run; the fast default's
//! drift from it is bounded in crates/models/tests/models/nvfp4.rs.

use crate::common;
use crate::harness;

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use base64::Engine;
use common::{fixtures, Ref};
use harness::{case_messages, data_url, get, media_part, metric, post, sse, start};
use osprey::Settings;
use serde_json::{json, Value};

const V: usize = 1024;

fn moe_dir() -> PathBuf {
    fixtures().join("models/qwen3_5_moe-tiny")
}

/// Default settings on the exact path (parity is measured there).
fn exact() -> Settings {
    Settings { activations: Some("f32".into()), ..Settings::default() }
}

/// The shared server (embedded-model settings, exact activations, the fixture MoE model).
fn server() -> SocketAddr {
    static S: OnceLock<SocketAddr> = OnceLock::new();
    *S.get_or_init(|| start(exact(), moe_dir()))
}

/// The request transformers' fixture case was rendered from.
fn case_request(r: &Ref, case: &str) -> Value {
    let messages = case_messages(&r.meta, case);
    json!({"model": "qwen3_5_moe-tiny", "messages": messages, "max_tokens": 8, "temperature": 0, "logprobs": true, "top_logprobs": 2})
}

fn log_softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    l.iter().map(|x| x - lse).collect()
}

#[test]
fn chat_greedy_text_and_logprobs_equal_the_references_streaming_or_not() {
    let addr = server();
    let tok = osprey_tokenizer::TextTokenizer::from_dir(&moe_dir()).expect("tokenizer");
    for case in ["text", "image", "two_images", "video"] {
        let r = Ref::load("qwen3_5_moe-tiny", case);
        let gen = r.ids("generated_ids");
        let steps = r.f32s("step_logits");
        let req = case_request(&r, case);
        let (status, body) = post(addr, "/v1/chat/completions", &req.to_string(), None);
        assert_eq!(status, 200, "{case}: {body}");
        let choice = &body["choices"][0];
        // The prompt ends inside <think>: the 8 random tokens are all reasoning.
        let want = tok.decode(&gen, true).expect("decode");
        assert_eq!(choice["message"]["reasoning_content"].as_str().unwrap_or(""), want.trim(), "{case} text");
        assert_eq!(choice["finish_reason"], "length");
        assert_eq!(body["usage"]["prompt_tokens"].as_u64(), r.meta["len"].as_u64(), "{case} prompt tokens");
        assert_eq!(body["usage"]["completion_tokens"], 8);
        let lps = choice["logprobs"]["content"].as_array().expect("logprobs");
        assert_eq!(lps.len(), 8);
        for (i, e) in lps.iter().enumerate() {
            let want = log_softmax(&steps[i * V..(i + 1) * V])[gen[i] as usize];
            let got = e["logprob"].as_f64().expect("logprob") as f32;
            assert!((got - want).abs() < 1e-4, "{case} step {i}: logprob {got} vs {want}");
            assert_eq!(e["top_logprobs"].as_array().expect("top").len(), 2);
        }
        // Streaming gives the same text, then a usage chunk and [DONE].
        let mut sreq = req.clone();
        sreq["stream"] = json!(true);
        sreq["stream_options"] = json!({"include_usage": true});
        let events = sse(addr, "/v1/chat/completions", &sreq);
        assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
        let chunks: Vec<Value> =
            events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("chunk json")).collect();
        let text: String = chunks
            .iter()
            .filter_map(|c| {
                c["choices"].get(0).and_then(|ch| ch["delta"]["reasoning_content"].as_str()).map(str::to_string)
            })
            .collect();
        // Streamed reasoning is trimmed like the non-streaming message (leading and trailing whitespace).
        assert_eq!(text, want.trim(), "{case} streamed text");
        assert_eq!(text, choice["message"]["reasoning_content"].as_str().unwrap_or(""), "{case} stream = whole");
        assert_eq!(chunks.last().expect("usage chunk")["usage"]["completion_tokens"], 8);
    }
}

#[test]
fn completions_with_token_ids_and_logprobs_equal_the_reference() {
    let addr = server();
    let r = Ref::load("qwen3_5_moe-tiny", "long");
    let (ids, gen, steps) = (r.ids("input_ids"), r.ids("generated_ids"), r.f32s("step_logits"));
    let body = json!({"prompt": ids, "max_tokens": 8, "temperature": 0, "logprobs": 1});
    let (status, out) = post(addr, "/v1/completions", &body.to_string(), None);
    assert_eq!(status, 200, "{out}");
    let lps = &out["choices"][0]["logprobs"];
    let got: Vec<f32> =
        lps["token_logprobs"].as_array().expect("lps").iter().map(|v| v.as_f64().expect("f") as f32).collect();
    for (i, g) in got.iter().enumerate() {
        let want = log_softmax(&steps[i * V..(i + 1) * V])[gen[i] as usize];
        assert!((g - want).abs() < 1e-4, "step {i}: {g} vs {want}");
    }
    let tok = osprey_tokenizer::TextTokenizer::from_dir(&moe_dir()).expect("tokenizer");
    assert_eq!(out["choices"][0]["text"], tok.decode(&gen, true).expect("decode"));
    // A text prompt works too.
    let (status, out) =
        post(addr, "/v1/completions", &json!({"prompt": "def f(x):", "max_tokens": 3}).to_string(), None);
    assert_eq!((status, out["usage"]["completion_tokens"].as_u64()), (200, Some(3)));
}

fn greedy_logprobs(addr: SocketAddr, req: &Value) -> (String, Vec<f32>) {
    let (status, body) = post(addr, "/v1/chat/completions", &req.to_string(), None);
    assert_eq!(status, 200, "{body}");
    let c = &body["choices"][0];
    let text = format!(
        "{}{}",
        c["message"]["reasoning_content"].as_str().unwrap_or(""),
        c["message"]["content"].as_str().unwrap_or("")
    );
    let lps = c["logprobs"]["content"]
        .as_array()
        .expect("lps")
        .iter()
        .map(|e| e["logprob"].as_f64().expect("lp") as f32)
        .collect();
    (text, lps)
}

#[test]
fn a_long_prompt_with_a_late_image_in_small_chunks_equals_one_shot() {
    let chunked = start(Settings { max_prefill_tokens: Some(16), max_batch_tokens: Some(24), ..exact() }, moe_dir());
    let preamble =
        "The following is a long description of many unrelated things, written to push the image far into the prompt. "
            .repeat(6);
    let req = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": preamble},
        media_part("image", "img_256x256"),
        {"type": "text", "text": "What is in the image?"}]}],
        "max_tokens": 6, "temperature": 0, "logprobs": true});
    let (t1, l1) = greedy_logprobs(server(), &req);
    let (t2, l2) = greedy_logprobs(chunked, &req);
    assert_eq!(t1, t2);
    for (a, b) in l1.iter().zip(&l2) {
        // Same math in other chunkings: the parity tolerance.
        assert!((a - b).abs() < 1e-4, "{a} vs {b}");
    }
}

#[test]
fn eight_concurrent_clients_get_the_same_greedy_outputs_as_alone() {
    let addr = server();
    let reqs: Vec<Value> = (0..8)
        .map(|i| {
            let mut content = vec![json!({"type": "text", "text": format!("Question number {i}: what comes next after {}?", i * 7)})];
            if i % 3 == 0 {
                content.insert(0, media_part("image", "img_224x160"));
            }
            json!({"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0, "logprobs": true})
        })
        .collect();
    let alone: Vec<(String, Vec<f32>)> = reqs.iter().map(|r| greedy_logprobs(addr, r)).collect();
    let together: Vec<(String, Vec<f32>)> = std::thread::scope(|s| {
        let hs: Vec<_> = reqs.iter().map(|r| s.spawn(move || greedy_logprobs(addr, r))).collect();
        hs.into_iter().map(|h| h.join().expect("client")).collect()
    });
    for (i, (a, b)) in alone.iter().zip(&together).enumerate() {
        assert_eq!(a.0, b.0, "client {i} text");
        for (x, y) in a.1.iter().zip(&b.1) {
            // Batched rows take other matmul paths (summation order only).
            assert!((x - y).abs() < 1e-4, "client {i}: {x} vs {y}");
        }
    }
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_sequence() {
    let addr = start(Settings::default(), moe_dir());
    let body = json!({"messages": [{"role": "user", "content": "Tell me a very long story."}], "max_tokens": 3000, "stream": true, "temperature": 0, "ignore_eos": true}).to_string();
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    write!(s, "POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}", body.len()).expect("send");
    let mut buf = [0u8; 4096];
    let mut seen = 0;
    while seen < 3 {
        let n = s.read(&mut buf).expect("read");
        seen += String::from_utf8_lossy(&buf[..n]).matches("data: ").count();
    }
    assert_eq!(metric(addr, "osprey_running_sequences"), 1.0);
    drop(s);
    let t0 = Instant::now();
    while metric(addr, "osprey_running_sequences") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the sequence was not freed");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(metric(addr, "osprey_cancelled_total") >= 1.0);
    assert!(metric(addr, "osprey_generated_tokens_total") < 3000.0);
}

/// A PNG header that declares 100000 × 100000 pixels (no pixel data): must be refused before decoding.
fn bomb_png() -> Vec<u8> {
    let mut v = b"\x89PNG\r\n\x1a\n".to_vec();
    let mut ihdr = b"IHDR".to_vec();
    ihdr.extend(100_000u32.to_be_bytes());
    ihdr.extend(100_000u32.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    v.extend(13u32.to_be_bytes());
    v.extend(&ihdr);
    let crc = crc32(&ihdr);
    v.extend(crc.to_be_bytes());
    // The start of a compressed stream, as a real bomb would have (a few KB inflate to gigabytes).
    let idat = b"IDAT\x78\x9c\xed\xc1\x01\x0d\x00\x00\x00".to_vec();
    v.extend(((idat.len() - 4) as u32).to_be_bytes());
    v.extend(&idat);
    v.extend(crc32(&idat).to_be_bytes());
    v
}

fn crc32(data: &[u8]) -> u32 {
    let mut c = 0xFFFF_FFFFu32;
    for &b in data {
        c ^= b as u32;
        for _ in 0..8 {
            c = if c & 1 != 0 { 0xEDB8_8320 ^ (c >> 1) } else { c >> 1 };
        }
    }
    !c
}

fn text_only_model() -> PathBuf {
    let dir = harness::scratch_dir("text-only");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let src = fixtures().join("models/qwen3_5-tiny");
    for f in ["model.safetensors", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] {
        std::fs::copy(src.join(f), dir.join(f)).expect("copy");
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).expect("config")).expect("json");
    cfg.as_object_mut().expect("object").remove("vision_config");
    std::fs::write(dir.join("config.json"), cfg.to_string()).expect("write config");
    dir
}

#[test]
fn bad_input_gets_an_openai_error_and_the_server_keeps_serving() {
    let limits = Settings {
        max_media_per_request: Some(2),
        max_media_bytes: Some(200_000),
        max_video_frames: Some(4),
        max_image_pixels: Some(1 << 20),
        context_len: Some(256),
        ..Settings::default()
    };
    let addr = start(limits, moe_dir());
    let text_only = start(Settings::default(), text_only_model());
    let img = |url: String| json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]}]});
    let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
    let small = data_url(&fixtures().join("media/img_256x256.png"));
    let big = format!("data:image/png;base64,{}", b64(&vec![0u8; 300_000]));
    let frames: Vec<String> = (0..5).map(|_| small.clone()).collect();
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "invalid_json"),
        (json!({"messages": [{"role": "wizard", "content": "x"}]}).to_string(), 400, "invalid_role"),
        (json!({"messages": []}).to_string(), 400, "invalid_request"),
        (img("http://example.com/cat.png".into()).to_string(), 403, "media_url_not_allowed"),
        (img("file:///etc/passwd".into()).to_string(), 403, "media_url_not_allowed"),
        (img("data:image/png;base64,@@@notbase64".into()).to_string(), 400, "invalid_media"),
        (img("data:image/png,rawbytes".into()).to_string(), 400, "invalid_media"),
        (img(format!("data:image/png;base64,{}", b64(b"this is not an image"))).to_string(), 400, "invalid_media"),
        (img(big).to_string(), 413, "media_too_large"),
        (img(format!("data:image/png;base64,{}", b64(&bomb_png()))).to_string(), 413, "media_too_large"),
        (
            json!({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": small}}, {"type": "image_url", "image_url": {"url": small}},
            {"type": "image_url", "image_url": {"url": small}}]}]})
            .to_string(),
            400,
            "too_many_media",
        ),
        (
            json!({"messages": [{"role": "user", "content": [{"type": "video", "video": frames}]}]}).to_string(),
            413,
            "media_too_large",
        ),
        (
            json!({"messages": [{"role": "user", "content": "word ".repeat(400)}]}).to_string(),
            400,
            "context_length_exceeded",
        ),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "response_format": {"type": "xml"}}).to_string(),
            400,
            "invalid_request",
        ),
        (json!({"messages": [{"role": "user", "content": "hi"}], "n": 2}).to_string(), 400, "unsupported_parameter"),
        (
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": 7}).to_string(),
            400,
            "invalid_request",
        ),
        (
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            404,
            "model_not_found",
        ),
    ];
    let good = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": small}}, {"type": "text", "text": "ok?"}]}], "max_tokens": 2});
    for (body, status, code) in &cases {
        let (s, e) = post(addr, "/v1/chat/completions", body, None);
        assert_eq!((s, e["error"]["code"].as_str()), (*status, Some(*code)), "{e}");
        assert!(e["error"]["message"].as_str().is_some_and(|m| !m.is_empty()) && e["error"]["type"].is_string());
        let (s, ok) = post(addr, "/v1/chat/completions", &good.to_string(), None);
        assert_eq!(s, 200, "the next good request after {code} failed: {ok}");
    }
    let (s, e) = post(text_only, "/v1/chat/completions", &img(small).to_string(), None);
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("vision_unsupported")));
    let (s, _) = post(
        text_only,
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string(),
        None,
    );
    assert_eq!(s, 200);
    let (s, e) = post(addr, "/v1/completions", &json!({"prompt": [5, 99999]}).to_string(), None);
    assert_eq!((s, e["error"]["code"].as_str()), (400, Some("invalid_request")));
}

#[test]
fn allow_listed_remote_media_and_local_files_are_read() {
    // A one-shot HTTP server on loopback serving a PNG.
    let png = std::fs::read(fixtures().join("media/img_256x256.png")).expect("png");
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    std::thread::spawn(move || {
        for s in listener.incoming().take(1) {
            let mut s = s.expect("conn");
            let mut req = [0u8; 2048];
            let _ = s.read(&mut req);
            let _ = write!(s, "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: {}\r\n\r\n", png.len());
            let _ = s.write_all(&png);
        }
    });
    let media_dir = fixtures().join("media");
    let addr = start(
        Settings {
            allowed_media_domains: Some(vec!["127.0.0.1".into()]),
            allowed_local_media_path: Some(media_dir.clone()),
            ..Settings::default()
        },
        moe_dir(),
    );
    for url in
        [format!("http://127.0.0.1:{port}/img.png"), format!("file://{}", media_dir.join("img_224x160.png").display())]
    {
        let body = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}], "max_tokens": 2});
        let (s, out) = post(addr, "/v1/chat/completions", &body.to_string(), None);
        assert_eq!(s, 200, "{url}: {out}");
        assert!(out["usage"]["prompt_tokens"].as_u64().expect("usage") > 60, "the image reached the prompt");
    }
    let outside = json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": format!("file://{}", moe_dir().join("config.json").display())}}]}]});
    let (s, e) = post(addr, "/v1/chat/completions", &outside.to_string(), None);
    assert_eq!((s, e["error"]["code"].as_str()), (403, Some("media_url_not_allowed")));
}

#[test]
fn api_key_models_health_and_metrics() {
    let addr = start(Settings { api_key: Some("sekret".into()), ..Settings::default() }, moe_dir());
    let body = json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}).to_string();
    let (s, e) = post(addr, "/v1/chat/completions", &body, None);
    assert_eq!((s, e["error"]["code"].as_str()), (401, Some("invalid_api_key")));
    assert_eq!(post(addr, "/v1/chat/completions", &body, Some("wrong")).0, 401);
    assert_eq!(post(addr, "/v1/chat/completions", &body, Some("sekret")).0, 200);
    let models =
        ureq::get(&format!("http://{addr}/v1/models")).set("authorization", "Bearer sekret").call().expect("models");
    let m: Value = serde_json::from_str(&models.into_string().expect("body")).expect("json");
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], "qwen3_5_moe-tiny");
    assert_eq!(m["data"][0]["context_length"], 4096);
    assert_eq!(m["data"][0]["capabilities"], json!(["text", "vision", "video"]));
    let (s, h) = get(addr, "/health");
    assert_eq!(s, 200);
    assert_eq!(serde_json::from_str::<Value>(&h).expect("json")["status"], "ok");
    let (s, text) = get(addr, "/metrics");
    assert_eq!(s, 200);
    for name in [
        "osprey_requests_total",
        "osprey_time_to_first_token_seconds_bucket",
        "osprey_inter_token_latency_seconds_count",
        "osprey_queue_length",
        "osprey_running_sequences",
        "osprey_generation_tokens_per_second",
        "osprey_prefix_cache_hit_rate",
    ] {
        assert!(text.contains(name), "metrics lack {name}");
    }
    assert!(metric(addr, "osprey_time_to_first_token_seconds_count") >= 1.0);
}
