//! End to end, as a user's request goes: media files + chat messages → chat template → placeholder
//! expansion → tokenizer → preprocessing → mRoPE positions → vision tower → decoder with rows injected per
//! chunk. Compared with transformers 5.23.0 (fixtures from tools/gen_vision_fixtures.py).
//!
//! The inputs transformers builds are reproduced exactly (rendered prompt, token ids, positions, delta,
//! placeholder spans, pixel rows); the numeric chain (tower → decoder) is compared with the tolerance of
//! the layer-by-layer tests (1e-4), see crates/models/tests/models/vision.rs for why those teacher-force.

use crate::common;

use std::sync::Arc;

use common::{assert_close, assert_rows_close, fixtures, model, Ref};
use osprey_models::vision::{
    decode_image, rows_in_chunk, DecodeLimits, MediaSpan, ProcessorConfig, RgbImage, VisionTower,
};
use osprey_models::{LogitsWanted, Positions, SeqInput, SeqStep};
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::{PreparedMedia, PreparedPrompt};
use osprey_protocol::RequestError;
use osprey_runner::{Driver, GenerateOptions, RowSource};
use osprey_tokenizer::{prepare_prompt, ChatTemplate, Media, TextTokenizer};

const CASES: [&str; 4] = ["image", "two_images", "video", "image_video"];

fn png(name: &str) -> RgbImage {
    let bytes = std::fs::read(fixtures().join("media").join(name)).expect("media");
    decode_image(&bytes, DecodeLimits::default()).expect("decode")
}

fn frames(name: &str) -> usize {
    if name.starts_with("vid4") {
        4
    } else {
        5
    }
}

/// The case's media and rendered prompt, as a chat request would build them.
fn case_prompt(dir: &std::path::Path, r: &Ref) -> (Vec<Media>, String) {
    let tmpl = ChatTemplate::from_dir(dir).expect("template");
    let mut content = Vec::new();
    let mut media = Vec::new();
    for item in r.meta["media"].as_array().expect("media") {
        let (kind, file) = (item[0].as_str().expect("kind"), item[1].as_str().expect("file"));
        content.push(serde_json::json!({"type": kind}));
        media.push(if kind == "image" {
            Media::Image(png(&format!("{file}.png")))
        } else {
            Media::Video { frames: (0..frames(file)).map(|i| png(&format!("{file}_{i}.png"))).collect(), fps: 2.0 }
        });
    }
    content.push(serde_json::json!({"type": "text", "text": r.meta["question"]}));
    let messages = serde_json::json!([{"role": "user", "content": content}]);
    (media, tmpl.render(&messages, true, &serde_json::Map::new()).expect("render"))
}

/// Our tower's rows for every media span of a prepared prompt: (offset, rows).
fn tower_rows(tower: &VisionTower, p: &osprey_tokenizer::Prepared, h: usize) -> Vec<(usize, Vec<f32>)> {
    let mut rows = Vec::new();
    for item in &p.media {
        let p = item.patches.get().expect("rows");
        let emb = tower.encode(&p.rows, p.grid).expect("encode");
        let mut at = 0;
        for &(o, l) in &item.spans {
            rows.push((o, emb[at * h..(at + l) * h].to_vec()));
            at += l;
        }
    }
    rows
}

#[test]
fn multimodal_requests_build_exactly_the_inputs_transformers_builds_and_match_its_logits() {
    for name in ["qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen4_exp-tiny", "qwen4_exp-tiny-sigmoid"] {
        let dir = fixtures().join("models").join(name);
        let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
        let proc = ProcessorConfig::from_dir(&dir).expect("processor");
        let m = model(name);
        let tower = common::tower(name);
        for case in CASES {
            let r = Ref::load(name, case);
            let (media, prompt) = case_prompt(&dir, &r);
            assert_eq!(prompt, r.meta["prompt"].as_str().expect("prompt"), "{name}/{case} rendered prompt");
            let p = prepare_prompt(&tok, &proc, &prompt, &media).expect("prepare");
            assert_eq!(p.input_ids, r.ids("input_ids"), "{name}/{case} input ids");
            let pos: Vec<i64> = (0..3).flat_map(|a| p.positions.iter().map(move |x| x[a])).collect();
            assert_eq!(pos, r.i64s("position_ids"), "{name}/{case} positions");
            assert_eq!(p.rope_delta, r.i64s("rope_delta")[0], "{name}/{case} delta");
            let spans: Vec<(usize, usize)> =
                p.media.iter().flat_map(|i| i.spans.iter().map(|&(o, l)| (o, o + l))).collect();
            let want: Vec<(usize, usize)> = serde_json::from_value(r.meta["spans"].clone()).expect("spans");
            let mut sorted = spans.clone();
            sorted.sort();
            assert_eq!(sorted, want, "{name}/{case} spans");
            // Numeric chain: our tower rows placed per span, prefill in two chunks split inside the first span.
            let h = m.info().hidden_size;
            let rows = tower_rows(&tower, &p, h);
            let spans: Vec<MediaSpan<'_>> = rows.iter().map(|(o, r)| MediaSpan { offset: *o, rows: r }).collect();
            let l = p.input_ids.len();
            let split = want[0].0 + 3;
            let mut st = m.new_state();
            let mut logits = Vec::new();
            for (s, e) in [(0, split), (split, l)] {
                let inj = rows_in_chunk(&spans, s, e, h);
                let input = SeqInput {
                    tokens: &p.input_ids[s..e],
                    positions: Positions::Explicit(&p.positions[s..e]),
                    injected: &inj,
                    logits: LogitsWanted::Last,
                };
                logits = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward").logits.remove(0);
            }
            let v = m.info().vocab_size;
            assert_close(&format!("{name}/{case} end-to-end last logits"), &logits, &r.f32s("step_logits")[..v], 1e-4);
        }
    }
}

/// `qwen4_exp` layer by layer on media prompts: with osprey's own tower rows injected at the
/// placeholders, every hyper-connection stream (and the mixer's output) of a one-shot prefill is within
/// the parity bound of transformers' (tolerance: parity.rs; the tower itself is within 2.6e-6).
#[test]
fn qwen4_exp_streams_match_transformers_layer_by_layer_on_media() {
    for name in ["qwen4_exp-tiny", "qwen4_exp-tiny-sigmoid"] {
        let dir = fixtures().join("models").join(name);
        let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
        let proc = ProcessorConfig::from_dir(&dir).expect("processor");
        let m = model(name);
        let tower = common::tower(name);
        let h = m.info().hidden_size;
        for case in ["image", "two_images", "video"] {
            let r = Ref::load(name, case);
            let (media, prompt) = case_prompt(&dir, &r);
            let p = prepare_prompt(&tok, &proc, &prompt, &media).expect("prepare");
            let rows = tower_rows(&tower, &p, h);
            let spans: Vec<MediaSpan<'_>> = rows.iter().map(|(o, r)| MediaSpan { offset: *o, rows: r }).collect();
            let inj = rows_in_chunk(&spans, 0, p.input_ids.len(), h);
            let input = SeqInput {
                tokens: &p.input_ids,
                positions: Positions::Explicit(&p.positions),
                injected: &inj,
                logits: LogitsWanted::All,
            };
            let mut st = m.new_state();
            let opts =
                osprey_models::ForwardOptions { capture_hidden: true, teacher_inputs: None, ..Default::default() };
            let out = m.forward_with(&mut [SeqStep { state: &mut st, input }], &opts).expect("forward");
            for (i, got) in out.hidden.iter().enumerate() {
                assert_rows_close(
                    &format!("{name}/{case} hidden_states.{i}"),
                    got,
                    &r,
                    &format!("hidden_states.{i}"),
                    1e-4,
                );
            }
            assert_rows_close(&format!("{name}/{case} all logits"), &out.logits[0], &r, "all_logits", 1e-4);
        }
    }
}

/// Media rows from the tower, in-process (what `osprey run` does); counts the encodes.
struct Tower<'a>(&'a VisionTower, usize);

impl RowSource for Tower<'_> {
    fn rows(&mut self, m: &PreparedMedia) -> Result<Arc<Vec<f32>>, RequestError> {
        self.1 += 1;
        let p = m.patches.get()?;
        let rows = self.0.encode(&p.rows, p.grid).expect("encode");
        Ok(Arc::new(rows))
    }
}

/// The one generation driver (the server's runner, `osprey run` and the bench all use it) reproduces
/// transformers' greedy ids for every media case, whatever the prefill chunk: 1 token (every media item
/// spread over many chunks), 7 (chunks that start and end inside media spans) and the whole prompt. It
/// encodes each media item once per generation.
#[test]
fn the_generation_driver_reproduces_transformers_greedy_ids_at_any_chunk_size() {
    for name in ["qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen4_exp-tiny", "qwen4_exp-tiny-sigmoid"] {
        let dir = fixtures().join("models").join(name);
        let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
        let proc = ProcessorConfig::from_dir(&dir).expect("processor");
        let tower = common::tower(name);
        let mut driver = Driver::new(model(name), 16);
        for case in CASES {
            let r = Ref::load(name, case);
            let (media, prompt) = case_prompt(&dir, &r);
            let p = prepare_prompt(&tok, &proc, &prompt, &media).expect("prepare");
            let items = p.media.len();
            let media = p.media.into_iter().map(|i| i.into_media([0; 16])).collect();
            let text = PreparedPrompt::text(p.input_ids);
            let prompt =
                Arc::new(PreparedPrompt { positions: Some(p.positions), rope_delta: p.rope_delta, media, ..text });
            let want = r.ids("generated_ids");
            for chunk in [1, 7, prompt.input_ids.len()] {
                let opts = GenerateOptions { chunk, max_tokens: want.len(), stop_token_ids: Vec::new() };
                let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
                let mut rows = Tower(&tower, 0);
                let got = driver.generate(prompt.clone(), greedy, &opts, &mut rows).expect("generate");
                assert_eq!(got.tokens, want, "{name}/{case} chunk {chunk}");
                assert_eq!(rows.1, items, "{name}/{case} chunk {chunk}: one encode per media item");
            }
        }
        assert_eq!(driver.sequences(), 0, "generate releases its sequence");
    }
}
