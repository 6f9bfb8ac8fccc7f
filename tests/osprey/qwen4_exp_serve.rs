//! `osprey serve` on `qwen4_exp` (Qwen3.8-Flash-Next) fixtures over real HTTP: text, one image, two images
//! and video answer with transformers' greedy tokens and logprobs (1e-4, the parity bound, on the exact
//! path); `/v1/models` reports the capabilities; a prefix-cache hit inside an image answers as an uncached
//! server; the NVFP4 checkpoint made by `osprey quantize` streams its experts under a 2-expert budget with
//! bit-identical logprobs; PLE rows are read on demand (`/metrics` counts them) and a zero row budget
//! answers the same.

use crate::common;
use crate::harness;

use std::net::SocketAddr;
use std::path::PathBuf;

use common::{fixtures, Ref};
use harness::{case_messages, chat, get, media_part, metric, quantize_to_temp, start};
use osprey::Settings;
use serde_json::{json, Value};

const V: usize = 1024;

fn dir() -> PathBuf {
    fixtures().join("models/qwen4_exp-tiny")
}

fn exact() -> Settings {
    Settings { activations: Some("f32".into()), ..Settings::default() }
}

fn log_softmax(l: &[f32]) -> Vec<f32> {
    let m = l.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = m + l.iter().map(|x| (x - m).exp()).sum::<f32>().ln();
    l.iter().map(|x| x - lse).collect()
}

fn logprobs(v: &Value) -> Vec<f32> {
    v["choices"][0]["logprobs"]["content"]
        .as_array()
        .expect("logprobs")
        .iter()
        .map(|e| e["logprob"].as_f64().expect("logprob") as f32)
        .collect()
}

#[test]
fn text_images_and_video_answer_with_transformers_greedy_tokens() {
    let addr = start(exact(), dir());
    let tok = osprey_tokenizer::TextTokenizer::from_dir(&dir()).expect("tokenizer");
    for case in ["text", "image", "two_images", "video"] {
        let r = Ref::load("qwen4_exp-tiny", case);
        let (gen, steps) = (r.ids("generated_ids"), r.f32s("step_logits"));
        let body =
            json!({"messages": case_messages(&r.meta, case), "max_tokens": 8, "temperature": 0, "logprobs": true});
        let out = chat(addr, &body);
        let m = &out["choices"][0]["message"];
        let text = format!("{}{}", m["reasoning_content"].as_str().unwrap_or(""), m["content"].as_str().unwrap_or(""));
        assert_eq!(text, tok.decode(&gen, true).expect("decode").trim(), "{case} text");
        assert_eq!(out["usage"]["prompt_tokens"].as_u64(), r.meta["len"].as_u64(), "{case} prompt tokens");
        for (i, got) in logprobs(&out).iter().enumerate() {
            let want = log_softmax(&steps[i * V..(i + 1) * V])[gen[i] as usize];
            assert!((got - want).abs() < 1e-4, "{case} step {i}: logprob {got} vs {want}");
        }
    }
    let (status, models) = get(addr, "/v1/models");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_str(&models).expect("json");
    assert_eq!(models["data"][0]["capabilities"], json!(["text", "vision", "video"]));
    assert!(metric(addr, "osprey_ple_table_bytes") > 0.0);
    assert!(metric(addr, "osprey_ple_misses_total") > 0.0, "PLE rows were read from the table");
}

/// PLE rows come from the table on disk through a RAM cache: no cache at all answers the same.
#[test]
fn a_zero_ple_row_budget_answers_as_the_default_one() {
    let roomy = start(exact(), dir());
    let body = json!({"messages": [{"role": "user", "content": "Tell me about n-grams."}], "max_tokens": 8, "temperature": 0, "logprobs": true});
    let want = chat(roomy, &body);
    let lean = start(Settings { ple_ram_gb: Some(0.0), ..exact() }, dir());
    let got = chat(lean, &body);
    assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"]);
}

fn ask(addr: SocketAddr, messages: &Value) -> (String, Vec<f32>, u64) {
    let out = chat(addr, &json!({"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": true}));
    let m = &out["choices"][0]["message"];
    let text = format!("{}|{}", m["reasoning_content"].as_str().unwrap_or(""), m["content"].as_str().unwrap_or(""));
    let cached = out["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached tokens");
    (text, logprobs(&out), cached)
}

/// A follow-up turn after an image hits the cache (snapshots every 16 tokens, so the hit ends inside or
/// past the image) and answers as a server without the cache: PLE history, conv states, QSA keys and
/// positions come back from the snapshot.
#[test]
fn a_prefix_cache_hit_after_an_image_answers_as_an_uncached_server() {
    let small = Settings { max_prefill_tokens: Some(16), page_size: Some(16), snapshot_interval: Some(16), ..exact() };
    let cached = start(small, dir());
    let uncached = start(Settings { disable_prefix_cache: Some(true), ..exact() }, dir());
    let first = json!([{"role": "user", "content": [media_part("image", "img_224x160"), {"type": "text", "text": "What is it?"}]}]);
    let (a, _, _) = ask(cached, &first);
    let mut follow = first.as_array().expect("turns").clone();
    follow.push(json!({"role": "assistant", "content": a.split('|').nth(1).unwrap_or("")}));
    follow.push(json!({"role": "user", "content": "And what colour is it?"}));
    let follow = Value::Array(follow);
    let (got, got_lp, hit) = ask(cached, &follow);
    let (want, want_lp, _) = ask(uncached, &follow);
    assert!(hit >= 16, "the follow-up hit the cache ({hit} tokens)");
    assert_eq!(got, want);
    for (x, y) in got_lp.iter().zip(&want_lp) {
        assert!((x - y).abs() < 1e-4, "logprob {x} vs {y}");
    }
}

#[test]
fn nvfp4_experts_streamed_under_a_two_expert_budget_answer_bit_identically() {
    let q = quantize_to_temp(&dir(), "qwen4-nvfp4");
    let full = start(Settings::default(), q.clone());
    let streamed = start(Settings { expert_ram_experts: Some(2), ..Settings::default() }, q);
    for content in [
        json!("Tell me about experts."),
        json!([media_part("image", "img_224x160"), {"type": "text", "text": "What is it?"}]),
    ] {
        let body = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 10, "temperature": 0, "logprobs": true});
        let (want, got) = (chat(full, &body), chat(streamed, &body));
        assert_eq!(got["choices"][0]["message"], want["choices"][0]["message"]);
        assert_eq!(got["choices"][0]["logprobs"], want["choices"][0]["logprobs"], "logprobs must be bit-identical");
    }
    assert!(metric(streamed, "osprey_expert_residency") < 1.0);
    assert!(metric(streamed, "osprey_expert_evictions_total") > 0.0);
}
