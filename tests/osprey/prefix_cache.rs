//! The prefix cache through the real server: a hit never changes an answer, never serves the wrong image,
//! ends only at recurrent snapshots, and survives eviction. Each request is compared with the same request
//! on a server started with `--disable-prefix-cache`.
//!
//! Tolerance: a hit changes only how the prompt is chunked (cached pages + the rest), so logprobs agree to
//! the parity bound 1e-4 (crates/models/tests/models/parity.rs) and greedy text is equal — on the exact path,
//! which every server here runs (`--activations f32`): at the fast default, attention and the delta
//! rule sum in a chunk-dependent order and the next matmul's bf16 rounding can turn that into a flipped
//! near-tie on this random-weight model (docs/reliability.md). The cache's own logic is what is tested.

use crate::common;
use crate::harness;

use std::net::SocketAddr;

use common::fixtures;
use harness::{data_url, metric};
use osprey::Settings;
use serde_json::{json, Value};

fn start(settings: Settings) -> SocketAddr {
    let settings = Settings { activations: Some("f32".into()), ..settings };
    harness::start(settings, fixtures().join("models/qwen3_5_moe-tiny"))
}

/// Small chunks on a 16-token grid, so snapshots exist inside images too.
fn cached(extra: Settings) -> SocketAddr {
    start(Settings { max_prefill_tokens: Some(16), page_size: Some(16), snapshot_interval: Some(16), ..extra })
}

fn uncached() -> SocketAddr {
    start(Settings { disable_prefix_cache: Some(true), ..Settings::default() })
}

fn image(name: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": data_url(&fixtures().join("media").join(format!("{name}.png")))}})
}

struct Answer {
    text: String,
    logprobs: Vec<f32>,
    prompt: u64,
    cached: u64,
}

fn ask(addr: SocketAddr, messages: &Value) -> Answer {
    let body = json!({"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": true});
    let (text, v) = harness::answer(addr, &body);
    Answer {
        text,
        logprobs: v["choices"][0]["logprobs"]["content"]
            .as_array()
            .expect("lps")
            .iter()
            .map(|e| e["logprob"].as_f64().expect("lp") as f32)
            .collect(),
        prompt: v["usage"]["prompt_tokens"].as_u64().expect("usage"),
        cached: v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached"),
    }
}

fn assert_same(what: &str, a: &Answer, b: &Answer) {
    assert_eq!(a.text, b.text, "{what}: text");
    assert_eq!(a.logprobs.len(), b.logprobs.len());
    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
        assert!((x - y).abs() < 1e-4, "{what}: logprob {x} vs {y}");
    }
}

fn user(parts: Vec<Value>) -> Value {
    json!([{"role": "user", "content": parts}])
}

#[test]
fn image_a_then_b_then_a_answers_a_twice_and_b_differently() {
    let (c, u) = (cached(Settings::default()), uncached());
    let q = json!({"type": "text", "text": "What is in the image?"});
    let a = user(vec![image("img_224x160"), q.clone()]);
    let b = user(vec![image("img_256x256"), q]);
    let first = ask(c, &a);
    let second = ask(c, &b);
    let third = ask(c, &a);
    assert_eq!(first.cached, 0);
    assert!(third.cached > 0, "the third request hits the first one's pages");
    assert_eq!(
        (third.text.clone(), third.logprobs.clone()),
        (first.text.clone(), first.logprobs.clone()),
        "A, B, A: the third answer is the first"
    );
    assert_ne!(second.text, first.text, "B is answered about B");
    assert_same("B vs uncached", &second, &ask(u, &b));
    // Same text, different image: nothing past the text before the image matches.
    let image_start = 5;
    assert!(second.cached <= image_start, "B reused {} tokens, past its first placeholder", second.cached);
}

#[test]
fn hits_ending_before_inside_and_past_an_image_give_the_uncached_answer() {
    let (c, u) = (cached(Settings::default()), uncached());
    let intro = json!({"type": "text", "text": "Here is a picture for you to study closely please."});
    let tail = |t: &str| json!({"type": "text", "text": t});
    // Seed the cache: intro, image (70 placeholders), a long question.
    let seed = user(vec![
        intro.clone(),
        image("img_224x160"),
        tail("Describe the colours, then the shapes, then the background in detail."),
    ]);
    let s = ask(c, &seed);
    assert_same("seed", &s, &ask(u, &seed));
    // Before: same intro, another image → the hit stops before the image.
    let before = user(vec![intro.clone(), image("img_256x256"), tail("Describe the colours.")]);
    // Inside: same intro and image, another question → the hit ends at a snapshot inside the image.
    let inside = user(vec![intro.clone(), image("img_224x160"), tail("Why?")]);
    // Past: same intro, image and the start of the question → the hit ends after the image.
    let past =
        user(vec![intro, image("img_224x160"), tail("Describe the colours, then the shapes, then something else.")]);
    let placeholder_span = |m: &Value| -> (u64, u64) {
        // Template: "<|im_start|>user\n" + intro + "<|vision_start|>" then the placeholders.
        let tok = osprey_tokenizer::TextTokenizer::from_dir(&fixtures().join("models/qwen3_5_moe-tiny")).expect("tok");
        let t = osprey_tokenizer::ChatTemplate::from_dir(&fixtures().join("models/qwen3_5_moe-tiny")).expect("tmpl");
        let text = t.render(m, true, &serde_json::Map::new()).expect("render");
        let head = &text[..text.find("<|image_pad|>").expect("pad")];
        let start = tok.encode(head).expect("encode").len() as u64;
        (start, start + 70)
    };
    for (name, m) in [("before", &before), ("inside", &inside), ("past", &past)] {
        let got = ask(c, m);
        assert_same(name, &got, &ask(u, m));
        let (s0, s1) = placeholder_span(m);
        let ok = match name {
            "before" => got.cached > 0 && got.cached <= s0,
            "inside" => got.cached > s0 && got.cached < s1,
            _ => got.cached >= s1,
        };
        assert!(ok, "{name}: cached {} with the image at [{s0}, {s1})", got.cached);
    }
}

#[test]
fn a_multi_turn_image_conversation_hits_its_history_on_turn_two() {
    let (c, u) = (
        cached(Settings { snapshot_interval: Some(64), max_prefill_tokens: Some(512), ..Settings::default() }),
        uncached(),
    );
    let turn1 = user(vec![image("img_256x256"), json!({"type": "text", "text": "What is in the image?"})]);
    let a1 = ask(c, &turn1);
    let reply = a1.text.split('|').nth(1).unwrap_or("").to_string();
    let turn2 = json!([
        {"role": "user", "content": [image("img_256x256"), {"type": "text", "text": "What is in the image?"}]},
        {"role": "assistant", "content": reply},
        {"role": "user", "content": "And what colour dominates?"}
    ]);
    let a2 = ask(c, &turn2);
    assert!(
        a2.cached >= a1.prompt / 16 * 16 - 16,
        "turn 2 reused {} of turn 1's {} prompt tokens",
        a2.cached,
        a1.prompt
    );
    assert!(a2.cached < a2.prompt);
    assert_same("turn 2", &a2, &ask(u, &turn2));
}

#[test]
fn eviction_under_a_tiny_budget_keeps_answers_exact() {
    // ~0.1 MB holds a few pages and snapshots of the tiny model; eight different images churn it.
    let c = cached(Settings { prefix_cache_mb: Some(0.1), ..Settings::default() });
    let u = uncached();
    let names = ["img_224x160", "img_256x256", "img_rgba_64x64", "img_640x480"];
    for round in 0..2 {
        for n in names {
            let m = user(vec![image(n), json!({"type": "text", "text": format!("Round {round}: what is this?")})]);
            assert_same(n, &ask(c, &m), &ask(u, &m));
        }
    }
    assert!(metric(c, "osprey_prefix_cache_evictions_total") > 0.0, "the budget forced evictions");
    assert!(metric(c, "osprey_prefix_cache_bytes") <= 0.1 * 1048576.0);
    // Snapshots are host memory, pages device memory, counted apart (the hybrid model snapshots).
    let m = harness::metrics(
        c,
        &["osprey_prefix_cache_host_bytes", "osprey_prefix_cache_device_bytes", "osprey_prefix_cache_bytes"],
    );
    assert!(m[0] > 0.0 && m[1] > 0.0, "host {} device {}", m[0], m[1]);
    assert_eq!(m[0] + m[1], m[2]);
}

#[test]
fn disable_prefix_cache_flag_turns_it_off() {
    let u = uncached();
    let m = user(vec![json!({"type": "text", "text": "Repeat after me: the same prompt twice."})]);
    ask(u, &m);
    assert_eq!(ask(u, &m).cached, 0);
    let c = start(Settings::default());
    let long = user(vec![
        json!({"type": "text", "text": "A prompt long enough to fill a few pages of sixteen tokens. ".repeat(4)}),
    ]);
    ask(c, &long);
    assert!(ask(c, &long).cached > 0, "on by default");
    assert!(metric(c, "osprey_prefix_cache_hit_rate") > 0.0);
}

/// Issue 53, item 3: every earlier token reused. A conversation of four turns, images in the first and
/// third, each resending the history with the answers so far: every turn's cached tokens are at least
/// the longest common prefix of its prompt's cache keys with the previous turn's (the tokenizer's own
/// prompts, compared here) less one page, and every answer is the cold server's. Before the tokenizer
/// reported where the next turn parts (`turn_end`), a turn resumed at the previous snapshot on the grid
/// whenever the generation prompt crossed a page.
#[test]
fn every_turn_reuses_the_previous_turn_to_within_a_page() {
    // Pages of 2 tokens, so a page boundary falls between where the next turn parts and the prompt's
    // end (the two tokens of the generation prompt's `<think>\n`), on every turn.
    let settings = Settings {
        page_size: Some(2),
        snapshot_interval: Some(64),
        max_prefill_tokens: Some(512),
        ..Settings::default()
    };
    let turns = [
        (Some("img_256x256"), "What is in the image?"),
        (None, "And what colour dominates?"),
        (Some("img_224x160"), "How does this one compare?"),
        (None, "Which of the two is brighter?"),
    ];
    reuses_every_turn(&fixtures().join("models/qwen3_5_moe-tiny"), settings, &turns);
}

/// Issue 53 on a `qwen3_5_moe` checkpoint with a long context (`bench synth`: the tiny widths, a vision
/// tower, 65,536 positions, Qwen3.5's preprocessing, so a 640×480 image is 300 tokens): 18 turns to
/// ~2,300 tokens, snapshots every page, and a prefix cache of 3 MiB that holds every page but few of the
/// ~150 snapshots. Every turn still reuses all of the previous one to within a page
/// and answers as the cold server: the shallow snapshots are evicted, not the conversation's newest
/// pages (which went at every turn before eviction knew snapshots from pages).
#[test]
fn a_long_image_conversation_reuses_every_turn_when_its_snapshots_outgrow_the_cache() {
    let dir = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("synth-long-context");
    let _ = std::fs::remove_dir_all(&dir);
    let o = osprey_bench::synth::Options { vision_layers: 2, context: 65536 };
    osprey_bench::synth::synth_with(&dir, osprey_bench::synth::TINY, 4, 11, o).expect("synth");
    osprey::default_model::write_tokenizer_files(&dir).expect("tokenizer files");
    let settings = Settings {
        page_size: Some(16),
        snapshot_interval: Some(16),
        max_prefill_tokens: Some(64),
        prefix_cache_mb: Some(3.0),
        ..Settings::default()
    };
    let pictures = [Some("img_640x480"), None, Some("img_256x256"), Some("img_224x160"), None, Some("img_640x480")];
    let turns: Vec<(Option<&str>, &str)> = (0..18)
        .map(|i| (pictures[i % pictures.len()], ["What is this?", "And now?", "Compare them."][i % 3]))
        .collect();
    let c = reuses_every_turn(&dir, settings, &turns);
    let m = harness::metrics(
        c,
        &["osprey_prefix_cache_evictions_total", "osprey_prefix_cache_snapshots", "osprey_prefix_cache_nodes"],
    );
    eprintln!("evictions, snapshots, pages: {m:?}");
    assert!(m[0] > 0.0 && m[1] < m[2] / 4.0, "snapshots were evicted, most pages kept: {m:?}");
}

/// Runs `turns` (an optional image and a question each, the history and answers resent) on a cached
/// server with `settings` and on a cold one, both serving `dir`: the same answers, and each turn's
/// cached tokens at least its common prefix with the previous turn's prompt less one page.
/// Returns the cached server.
fn reuses_every_turn(dir: &std::path::Path, settings: Settings, turns: &[(Option<&str>, &str)]) -> SocketAddr {
    let core = osprey_tokenizer::TokenizerCore::from_dir(dir, true).expect("tokenizer");
    let page = settings.page_size.expect("page size") as u64;
    let serve = |s: Settings| harness::start(Settings { activations: Some("f32".into()), ..s }, dir.to_path_buf());
    let c = serve(settings);
    let u = serve(Settings { disable_prefix_cache: Some(true), ..Settings::default() });
    let png = |name: &str| std::fs::read(fixtures().join("media").join(format!("{name}.png"))).expect("png");
    let (mut history, mut previous): (Vec<Value>, Option<Vec<u64>>) = (Vec::new(), None);
    let mut media: Vec<osprey_protocol::tokenizer::MediaInput> = Vec::new();
    for (turn, (img, q)) in turns.iter().enumerate() {
        let mut parts = Vec::new();
        if let Some(name) = img {
            parts.push(image(name));
            media.push(osprey_protocol::tokenizer::MediaInput::Image { bytes: png(name) });
        }
        parts.push(json!({"type": "text", "text": q}));
        history.push(json!({"role": "user", "content": parts}));
        let messages = Value::Array(history.clone());
        let a = ask(c, &messages);
        assert_same(&format!("turn {}", turn + 1), &a, &ask(u, &messages));
        // The tokenizer's prompt of the same turn: image parts as the server passes them.
        let for_tokenizer: Vec<Value> = history
            .iter()
            .map(|m| match m["content"].as_array() {
                Some(parts) => {
                    let parts: Vec<Value> = parts
                        .iter()
                        .map(|p| if p["type"] == "image_url" { json!({"type": "image"}) } else { p.clone() })
                        .collect();
                    json!({"role": m["role"], "content": parts})
                }
                None => m.clone(),
            })
            .collect();
        let prompt = core.prepare_chat(chat_prompt(Value::Array(for_tokenizer), media.clone())).expect("prepare");
        assert_eq!(prompt.cache_ids.len() as u64, a.prompt, "turn {}: the server's prompt", turn + 1);
        if let Some(prev) = &previous {
            let lcp = prev.iter().zip(&prompt.cache_ids).take_while(|(x, y)| x == y).count() as u64;
            let names = ["osprey_prefix_cache_host_bytes", "osprey_prefix_cache_device_bytes"];
            let m = harness::metrics(
                c,
                &[names[0], names[1], "osprey_prefix_cache_snapshots", "osprey_prefix_cache_nodes"],
            );
            eprintln!("turn {}: cached {} of {lcp}; host, device, snapshots, pages {m:?}", turn + 1, a.cached);
            assert!(
                a.cached + page >= lcp,
                "turn {}: reused {} of a common prefix of {lcp} ({} tokens)",
                turn + 1,
                a.cached,
                a.prompt
            );
        }
        previous = Some(prompt.cache_ids.clone());
        let reply = a.text.split('|').nth(1).unwrap_or("").to_string();
        history.push(json!({"role": "assistant", "content": reply}));
    }
    c
}

/// A chat prompt as the server hands it to the tokenizer: `messages` with image parts as
/// `{"type": "image"}`, the images' bytes in order.
fn chat_prompt(
    messages: Value,
    media: Vec<osprey_protocol::tokenizer::MediaInput>,
) -> osprey_protocol::tokenizer::ChatPrompt {
    osprey_protocol::tokenizer::ChatPrompt {
        messages,
        media,
        template_kwargs: serde_json::Map::new(),
        limits: osprey_protocol::tokenizer::MediaLimits {
            max_pixels: 1 << 26,
            max_frames: 64,
            max_total_pixels: 1 << 28,
            max_media_tokens: usize::MAX,
        },
        grammar: None,
        parse_special_tokens: false,
        add_generation_prompt: true,
        continue_final_message: false,
        deadline: None,
    }
}

/// Issue 53: an image sent again (a conversation resends its history every turn) is not decoded and
/// preprocessed again: the tokenizer's second prompt shares the first one's pixel rows and is the same
/// prompt; another image gets its own.
#[test]
fn a_resent_image_shares_its_preprocessed_rows() {
    let core = osprey_tokenizer::TokenizerCore::from_dir(&fixtures().join("models/qwen3_5_moe-tiny"), true)
        .expect("tokenizer");
    let prompt = |name: &str| {
        let bytes = std::fs::read(fixtures().join("media").join(format!("{name}.png"))).expect("png");
        let messages = json!([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]);
        let media = vec![osprey_protocol::tokenizer::MediaInput::Image { bytes }];
        core.prepare_chat(chat_prompt(messages, media)).expect("prepare")
    };
    let (a, b, other) = (prompt("img_256x256"), prompt("img_256x256"), prompt("img_224x160"));
    assert!(std::sync::Arc::ptr_eq(&a.media[0].patches, &b.media[0].patches), "the same rows, not preprocessed again");
    assert_eq!((&a.input_ids, &a.cache_ids, &a.positions), (&b.input_ids, &b.cache_ids, &b.positions));
    assert_eq!(a.media[0].spans, b.media[0].spans);
    assert!(!std::sync::Arc::ptr_eq(&a.media[0].patches, &other.media[0].patches));
}

/// Issue 53: past the tokenizer's budget for pixel rows, a resent image is laid out from its shape and
/// not decoded; its rows are made from its bytes only when asked for (the vision encoder, on a miss of
/// its own cache and the prefix cache's), and are the rows the first prompt made.
#[test]
fn a_resent_image_past_the_row_budget_is_decoded_only_when_its_rows_are_asked_for() {
    let core = osprey_tokenizer::TokenizerCore::from_dir(&fixtures().join("models/qwen3_5_moe-tiny"), true)
        .expect("tokenizer")
        .with_preprocessed_bytes(0);
    let prompt = |name: &str| {
        let bytes = std::fs::read(fixtures().join("media").join(format!("{name}.png"))).expect("png");
        let messages = json!([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "?"}]}]);
        let media = vec![osprey_protocol::tokenizer::MediaInput::Image { bytes }];
        core.prepare_chat(chat_prompt(messages, media)).expect("prepare")
    };
    let (a, b) = (prompt("img_224x160"), prompt("img_224x160"));
    let first = a.media[0].patches.made().expect("a new image is decoded as its request is prepared").clone();
    assert!(b.media[0].patches.made().is_none(), "a known image is not decoded again to lay out its prompt");
    assert_eq!((&a.input_ids, &a.cache_ids, &a.positions), (&b.input_ids, &b.cache_ids, &b.positions));
    assert_eq!((&a.media[0].spans, a.media[0].hash), (&b.media[0].spans, b.media[0].hash));
    let made = b.media[0].patches.get().expect("made from the bytes");
    assert_eq!(*made, *first, "the same rows as the first decode");
    assert!(std::sync::Arc::ptr_eq(b.media[0].patches.made().expect("kept once made"), &made));
}
