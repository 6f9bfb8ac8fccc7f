//! `bench serve --scenario long-images` (issue 53): a seeded conversation of images that grows to a
//! target context, the workload osprey exists for. Turn `t` adds one or two 512×384 images (every fifth
//! turn a 4-frame video instead) and a question, and resends the whole history with the answers so far;
//! the run ends at the first turn whose prompt reaches `context_tokens` (as the server counts it), after
//! `requests` turns, or at a failed turn (a full context is an answer too, and the last turn). A server
//! must take the history's images in one request (osprey: `--max-media-per-request`, 256 by default).
//!
//! Per turn the client's view (TTFT, prompt, cached and new tokens, decode rate) and, against osprey,
//! its `/metrics` after the turn: KV pages and bytes, recurrent-state snapshots and their bytes,
//! vision-cache hits and misses during the turn, expert residency and the process's resident memory.
//! `text_only` sends the same conversation with each image (and frame) replaced by a seeded sentence of
//! as many words as the image has tokens in Qwen3.5 (16-pixel patches, 2×2 merged: w·h/1024; a video's
//! frame pairs merged in time), so a text-only peer such as llama-server sees the context grow alike.

use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::{json, Value};

use super::{image_part, sentence, synth_png, ServeOptions};
use crate::rng::Rng;

/// Image size of a turn's pictures, and of a video's frames.
const IMAGE: (u32, u32) = (512, 384);
const FRAME: (u32, u32) = (256, 192);
const FRAMES: u64 = 4;

/// One turn's media and server-side view (the gauges `None` against a server that is not osprey).
#[derive(Clone, Debug, Default, Serialize)]
pub struct TurnStats {
    /// Media items this turn added (an image, or a video: one item each, as the vision encoder counts).
    pub media_items: usize,
    /// Bytes of the request body (the whole history, its images base64-encoded).
    pub request_bytes: usize,
    /// Prompt tokens not served from the prefix cache (`prompt − cached`).
    pub new_tokens: Option<u64>,
    /// `osprey_kv_pages_used` after the turn.
    pub kv_pages_used: Option<f64>,
    /// KV bytes those pages hold (pages × the prefix cache's bytes per page).
    pub kv_bytes: Option<f64>,
    /// Recurrent-state snapshots the prefix cache holds (`osprey_prefix_cache_snapshots`).
    pub snapshots: Option<f64>,
    /// Their bytes (`osprey_prefix_cache_host_bytes`).
    pub snapshot_bytes: Option<f64>,
    /// Vision-encoder cache hits during the turn.
    pub vision_hits: Option<f64>,
    /// Media items the vision encoder computed during the turn.
    pub vision_misses: Option<f64>,
    /// Fraction of expert accesses served from RAM (`osprey_expert_residency`, mean over layers).
    pub expert_residency: Option<f64>,
    /// The server's resident memory (`osprey_process_resident_bytes`).
    pub rss_bytes: Option<f64>,
    /// TTFT of the turn's message sent alone with fresh media right after it (`--cold-reference`).
    pub cold_ttft_s: Option<f64>,
    /// Cached prompt tokens of that cold request (its template's first tokens at most).
    pub cold_cached_tokens: Option<u64>,
}

/// Whether turn `t` is a video turn.
fn video_turn(t: usize) -> bool {
    t % 5 == 4
}

/// Images turn `t` adds (0 for a video turn).
fn images_of(o: &ServeOptions, t: usize) -> usize {
    if video_turn(t) {
        0
    } else {
        1 + (Rng(o.seed.wrapping_add(t as u64 * 31)).next() % 2) as usize
    }
}

/// A seeded sentence of as many words as a `w`×`h` picture has tokens (the text-only stand-in).
fn stand_in(seed: u64, tokens: u32) -> Value {
    json!({"type": "text", "text": format!("[picture: {}]", sentence(&mut Rng(seed), tokens as usize))})
}

/// The user message of turn `t`.
pub(super) fn user_turn(o: &ServeOptions, t: usize) -> Value {
    message(o, t, 0)
}

/// Turn `t`'s message alone, its media drawn afresh (same sizes, other pixels: nothing cached for them),
/// the same question: a cold request of the turn's content.
pub(super) fn cold_turn(o: &ServeOptions, t: usize) -> Value {
    message(o, t, 0xC01D_C01D)
}

/// Turn `t`'s message with its media seeds salted by `salt` (0: the conversation's own).
fn message(o: &ServeOptions, t: usize, salt: u64) -> Value {
    let question = o.seed.wrapping_add(t as u64 * 1_000_003);
    let seed = question ^ salt;
    let mut content = Vec::new();
    if video_turn(t) {
        if o.text_only {
            let tokens = (FRAME.0 * FRAME.1 / 1024) * FRAMES as u32 / 2;
            content.push(stand_in(seed, tokens));
        } else {
            let frames: Vec<String> = (0..FRAMES)
                .map(|f| {
                    use base64::Engine;
                    let png = synth_png(FRAME.0, FRAME.1, seed.wrapping_add(f));
                    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
                })
                .collect();
            content.push(json!({"type": "video", "video": frames, "fps": 2.0}));
        }
    }
    for i in 0..images_of(o, t) as u64 {
        content.push(if o.text_only {
            stand_in(seed.wrapping_add(i), IMAGE.0 * IMAGE.1 / 1024)
        } else {
            image_part(IMAGE.0, IMAGE.1, seed.wrapping_add(i))
        });
    }
    let mut rng = Rng(question ^ 0x5EED);
    let what = if video_turn(t) { "the video" } else { "these pictures" };
    content.push(json!({"type": "text", "text": format!("How do {what} relate to the {}?", sentence(&mut rng, 3))}));
    json!({"role": "user", "content": content})
}

/// The messages of turn `i`: every earlier turn and its answer, then turn `i`'s question.
pub(super) fn history(o: &ServeOptions, i: usize, answers: &[String]) -> Value {
    let mut m = Vec::with_capacity(2 * i + 1);
    for t in 0..i {
        m.push(user_turn(o, t));
        m.push(json!({"role": "assistant", "content": answers.get(t).map_or("", String::as_str)}));
    }
    m.push(user_turn(o, i));
    Value::Array(m)
}

/// Media items turn `t` adds (a video is one).
pub(super) fn media_items(o: &ServeOptions, t: usize) -> usize {
    if video_turn(t) {
        1
    } else {
        images_of(o, t)
    }
}

/// Every sample of `/metrics` text by name: the sum over its labels and how many there were.
pub(super) fn gauges(text: &str) -> BTreeMap<String, (f64, usize)> {
    let mut out: BTreeMap<String, (f64, usize)> = BTreeMap::new();
    for line in text.lines().filter(|l| !l.starts_with('#')) {
        let Some((name, value)) = line.rsplit_once(' ') else { continue };
        let name = name.split('{').next().unwrap_or(name);
        if let Ok(v) = value.parse::<f64>() {
            let e = out.entry(name.to_string()).or_insert((0.0, 0));
            e.0 += v;
            e.1 += 1;
        }
    }
    out
}

/// The server-side part of a turn from `/metrics` before and after it.
pub(super) fn turn_stats(before: &BTreeMap<String, (f64, usize)>, after: &BTreeMap<String, (f64, usize)>) -> TurnStats {
    let sum = |k: &str| after.get(k).map(|v| v.0);
    let mean = |k: &str| after.get(k).filter(|v| v.1 > 0).map(|v| v.0 / v.1 as f64);
    let delta = |k: &str| Some(sum(k)? - before.get(k).map_or(0.0, |v| v.0));
    // Bytes a page holds: the prefix cache's page bytes over its pages (one page a node).
    let page_bytes = match (sum("osprey_prefix_cache_device_bytes"), sum("osprey_prefix_cache_nodes")) {
        (Some(b), Some(n)) if n > 0.0 => Some(b / n),
        _ => None,
    };
    TurnStats {
        kv_pages_used: sum("osprey_kv_pages_used"),
        kv_bytes: sum("osprey_kv_pages_used").zip(page_bytes).map(|(p, b)| p * b),
        snapshots: sum("osprey_prefix_cache_snapshots"),
        snapshot_bytes: sum("osprey_prefix_cache_host_bytes"),
        vision_hits: delta("osprey_vision_cache_hits_total"),
        vision_misses: delta("osprey_vision_cache_misses_total"),
        expert_residency: mean("osprey_expert_residency"),
        rss_bytes: sum("osprey_process_resident_bytes"),
        ..TurnStats::default()
    }
}

/// The per-turn table of a long-images run.
pub(super) fn turn_table(samples: &[super::Sample]) -> String {
    let mut out = String::from(
        "| turn | media | prompt | cached | new | TTFT ms | cold TTFT ms | decode tok/s | KV pages | KV MB | snapshots | snapshot MB | vision hits/misses | residency | RSS MB |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    let n = |v: Option<u64>| v.map_or("–".into(), |v| v.to_string());
    let f = |v: Option<f64>, scale: f64, digits: usize| v.map_or("–".into(), |v| format!("{:.*}", digits, v * scale));
    for s in samples {
        let Some(t) = &s.turn else { continue };
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {}/{} | {} | {} |\n",
            s.index + 1,
            t.media_items,
            n(s.prompt_tokens),
            n(s.cached_tokens),
            n(t.new_tokens),
            f(s.ttft_s, 1e3, 1),
            f(t.cold_ttft_s, 1e3, 1),
            f(s.output_tok_s, 1.0, 1),
            f(t.kv_pages_used, 1.0, 0),
            f(t.kv_bytes, 1e-6, 1),
            f(t.snapshots, 1.0, 0),
            f(t.snapshot_bytes, 1e-6, 1),
            f(t.vision_hits, 1.0, 0),
            f(t.vision_misses, 1.0, 0),
            f(t.expert_residency, 1.0, 3),
            f(t.rss_bytes, 1e-6, 0),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn o(text_only: bool) -> ServeOptions {
        ServeOptions { text_only, ..super::super::tests::options(super::super::Scenario::LongImages) }
    }

    /// Turns are seeded, every fifth is a video, the history resends every earlier turn unchanged
    /// (what lets a prefix cache serve it), and the text-only form has no media at all.
    #[test]
    fn turns_are_seeded_and_the_history_grows_by_one_turn() {
        let answers = vec![String::from("x"); 6];
        let (a, b) = (history(&o(false), 5, &answers), history(&o(false), 6, &answers));
        assert_eq!(a.as_array().map(Vec::len), Some(11));
        assert_eq!(a.as_array().expect("a")[..10], b.as_array().expect("b")[..10], "earlier turns unchanged");
        assert_eq!(user_turn(&o(false), 4)["content"][0]["type"], "video");
        assert_eq!(media_items(&o(false), 4), 1);
        assert!((0..4).all(|t| (1..=2).contains(&media_items(&o(false), t))));
        let text = history(&o(true), 6, &answers).to_string();
        assert!(!text.contains("image_url") && !text.contains("\"video\"") && text.contains("[picture:"));
        // A cold reference: the same question and media of the same kinds, other pixels.
        for t in [3, 4] {
            let (turn, cold) = (user_turn(&o(false), t), cold_turn(&o(false), t));
            let parts =
                |v: &Value| v["content"].as_array().map(|a| a.iter().map(|p| p["type"].clone()).collect::<Vec<_>>());
            assert_eq!(parts(&turn), parts(&cold));
            assert_eq!(
                turn["content"].as_array().and_then(|a| a.last()),
                cold["content"].as_array().and_then(|a| a.last())
            );
            assert_ne!(turn["content"][0], cold["content"][0], "turn {t}: fresh media");
        }
    }

    #[test]
    fn turn_stats_read_gauges_and_the_turns_deltas() {
        let before = gauges("osprey_vision_cache_hits_total 2\nosprey_vision_cache_misses_total 3\n");
        let after = gauges(
            "# HELP x\nosprey_vision_cache_hits_total 5\nosprey_vision_cache_misses_total 4\nosprey_kv_pages_used 10\n\
             osprey_prefix_cache_device_bytes 800\nosprey_prefix_cache_nodes 4\nosprey_expert_residency{layer=\"0\"} 0.5\n\
             osprey_expert_residency{layer=\"1\"} 1\n",
        );
        let t = turn_stats(&before, &after);
        assert_eq!((t.vision_hits, t.vision_misses, t.kv_pages_used), (Some(3.0), Some(1.0), Some(10.0)));
        assert_eq!((t.kv_bytes, t.expert_residency, t.rss_bytes), (Some(2000.0), Some(0.75), None));
    }
}
