//! The paged KV pool through the real server: a pool too small for the concurrent requests preempts and
//! recomputes sequences, and every answer equals the answer of a server with room for all of them.
//!
//! Tolerance: a recomputed sequence prefills its prompt and generated tokens in other chunks than the
//! original, which moves logits by at most the parity bound (1e-4, crates/models/tests/models/parity.rs) on the
//! exact path; greedy text and seeded draws are compared exactly, as the prefix-cache tests do for the
//! same reason. Both servers therefore run with f32 activations: at the fast default, attention and the
//! delta rule still sum in a chunk-dependent order, and rounding the next matmul's activations to bf16
//! can turn that 1e-6 difference into a 1-ulp bf16 step, enough to flip a seeded draw on this
//! random-weight model (docs/reliability.md).

use crate::common;
use crate::harness;

use std::net::SocketAddr;

use common::fixtures;
use harness::metric;
use osprey::Settings;
use serde_json::json;

fn start(settings: Settings) -> SocketAddr {
    let settings = Settings { activations: Some("f32".into()), ..settings };
    harness::start(settings, fixtures().join("models/qwen3_5_moe-tiny"))
}

fn ask(addr: SocketAddr, i: usize) -> (String, u64) {
    let q = format!("Question {i}: tell me about the number {}.", i * 7);
    // Half greedy, half seeded sampling (the sampler state survives a preemption).
    let sampling = if i.is_multiple_of(2) { json!({"temperature": 0}) } else { json!({"temperature": 1.0, "seed": i}) };
    let mut body = json!({"messages": [{"role": "user", "content": q}], "max_tokens": 40, "ignore_eos": true});
    body.as_object_mut().expect("object").extend(sampling.as_object().expect("object").clone());
    let (text, v) = harness::answer(addr, &body);
    (text, v["usage"]["completion_tokens"].as_u64().expect("usage"))
}

fn ask_all(addr: SocketAddr, n: usize) -> Vec<(String, u64)> {
    let handles: Vec<_> = (0..n).map(|i| std::thread::spawn(move || ask(addr, i))).collect();
    handles.into_iter().map(|h| h.join().expect("client thread")).collect()
}

#[test]
fn preemption_under_a_tiny_page_pool_returns_the_same_answers_as_an_unconstrained_server() {
    // Each request is ~30 prompt tokens + 40 generated = 5 pages of 16; six of them need ~30 pages side
    // by side, the tiny pool has 10.
    let tiny = start(Settings {
        kv_capacity_tokens: Some(160),
        page_size: Some(16),
        max_running_requests: Some(6),
        ..Settings::default()
    });
    let roomy = start(Settings { max_running_requests: Some(6), ..Settings::default() });
    let want = ask_all(roomy, 6);
    let got = ask_all(tiny, 6);
    assert!(metric(tiny, "osprey_preemptions_total") > 0.0, "the tiny pool must have preempted");
    assert_eq!(metric(roomy, "osprey_preemptions_total"), 0.0);
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g.1, 40, "request {i}: all tokens generated");
        assert_eq!(g, w, "request {i}: same answer with and without preemption");
    }
    assert_eq!(metric(tiny, "osprey_kv_pages_total"), 10.0);
}

#[test]
fn a_pool_full_of_cached_pages_gives_them_back_to_new_requests() {
    // 4 pages of 16 tokens; every answered prompt leaves its pages in the prefix cache. Each new prompt
    // differs, so it needs pages the cache holds.
    let addr = start(Settings { kv_capacity_tokens: Some(64), page_size: Some(16), ..Settings::default() });
    let agent = ureq::AgentBuilder::new().timeout(std::time::Duration::from_secs(60)).build();
    for i in 0..6 {
        let body = json!({"messages": [{"role": "user", "content": format!("Distinct question number {i}, about {}.", i * 31)}],
            "max_tokens": 4, "temperature": 0});
        let r = agent
            .post(&format!("http://{addr}/v1/chat/completions"))
            .set("content-type", "application/json")
            .send_string(&body.to_string());
        assert!(r.is_ok_and(|r| r.status() == 200), "request {i} was not served");
    }
    assert!(metric(addr, "osprey_prefix_cache_evictions_total") > 0.0, "the cache gave pages back");
}

/// One request of the media stress mix: an image, a video or a long text, greedy or seeded.
fn media_mix_request(i: usize) -> serde_json::Value {
    let dir = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/media/default");
    let url = |f: String| harness::data_url(&dir.join(f));
    let content = match i % 4 {
        0 => json!([{"type": "image_url", "image_url": {"url": url("red_circle_img0.png".into())}},
                    {"type": "text", "text": "What is in the image?"}]),
        1 => {
            json!([{"type": "video", "video": (0..4).map(|f| url(format!("moving_left_vid0_{f}.png"))).collect::<Vec<_>>(), "fps": 2.0},
                    {"type": "text", "text": "Which way does it move?"}])
        }
        2 => json!([{"type": "text", "text": "Two pictures."},
                    {"type": "image_url", "image_url": {"url": url("green_square_img0.png".into())}},
                    {"type": "image_url", "image_url": {"url": url("blue_triangle_img0.png".into())}}]),
        _ => json!(format!("Tell me a long story about the number {}. ", i * 13).repeat(6)),
    };
    let sampling = if i.is_multiple_of(2) { json!({"temperature": 0}) } else { json!({"temperature": 1.0, "seed": i}) };
    let mut body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 96, "ignore_eos": true});
    body.as_object_mut().expect("object").extend(sampling.as_object().expect("object").clone());
    body
}

fn media_mix(addr: SocketAddr, n: usize) -> Vec<(String, u64)> {
    let handles: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let (text, v) = harness::answer(addr, &media_mix_request(i));
                (text, v["usage"]["completion_tokens"].as_u64().expect("usage"))
            })
        })
        .collect();
    handles.into_iter().map(|h| h.join().expect("client thread")).collect()
}

/// Regression (issue 26): a preempted image or video sequence is recomputed from its prompt and the
/// tokens it generated, in chunks that cross the prompt's end; the runner used to slice the prompt's
/// mRoPE positions past their end there and panic, taking the engine down. Images, two images in one
/// prompt, a video and long text run eight at a time on a pool of a third of what they need, with
/// prefill chunks of 13 tokens so chunk edges fall inside images and at odd places of the recompute.
#[test]
fn preempted_image_and_video_sequences_are_recomputed_to_the_same_answers() {
    let dir = osprey::model_dir(&Settings::default()).expect("embedded default model");
    let base = Settings { max_running_requests: Some(8), max_prefill_tokens: Some(13), ..Settings::default() };
    let roomy = start_dir(base.clone(), dir.clone());
    let want = media_mix(roomy, 8);
    assert_eq!(metric(roomy, "osprey_preemptions_total"), 0.0);
    // The longest request (prompt + 96 generated) fits alone; eight side by side need ~3× the pool.
    let tiny = start_dir(Settings { kv_capacity_tokens: Some(480), page_size: Some(16), ..base }, dir);
    for round in 0..2 {
        let got = media_mix(tiny, 8);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(g.1, 96, "round {round}, request {i}: all tokens generated");
            assert_eq!(g, w, "round {round}, request {i}: same answer with and without preemption");
        }
    }
    let preempted = metric(tiny, "osprey_preemptions_total");
    assert!(preempted >= 8.0, "the small pool must preempt many times, saw {preempted}");
    assert_eq!(harness::get(tiny, "/health").0, 200, "the engine still serves");
}

fn start_dir(settings: Settings, dir: std::path::PathBuf) -> SocketAddr {
    harness::start(Settings { activations: Some("f32".into()), ..settings }, dir)
}

/// `--kv-cache-dtype bf16`: a pool too small for the requests side by side still preempts, recomputes
/// and answers every request in full with half the KV bytes (the drift against f32 KV is bounded in
/// crates/models/tests/models/kv_dtype.rs); an unknown element type is refused at start, before the model loads.
#[test]
fn a_bf16_kv_pool_serves_and_preempts_and_an_unknown_kv_dtype_is_refused() {
    let bf16 = Settings { kv_cache_dtype: Some("bf16".into()), ..Settings::default() };
    let tiny =
        start(Settings { kv_capacity_tokens: Some(160), page_size: Some(16), max_running_requests: Some(6), ..bf16 });
    for (i, (_, tokens)) in ask_all(tiny, 6).iter().enumerate() {
        assert_eq!(*tokens, 40, "request {i}: all tokens generated");
    }
    assert!(metric(tiny, "osprey_preemptions_total") > 0.0, "the tiny pool must have preempted");
    let bad = Settings { kv_cache_dtype: Some("f8".into()), port: Some(0), ..Settings::default() };
    let Err(err) = osprey::start(&bad, &fixtures().join("models/qwen3_5_moe-tiny")) else { panic!("refused") };
    assert!(err.to_string().contains("--kv-cache-dtype"), "{err}");
}
