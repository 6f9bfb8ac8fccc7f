//! Vision parity with transformers 5.23.0: preprocessing, the vision tower, mRoPE positions, and decoder
//! logits with vision rows injected (one-shot, teacher-forced decode, and chunked prefill split inside
//! media spans). Fixtures: tools/gen_vision_fixtures.py.
//!
//! Tolerances:
//! - pixels: exact (bit-equal f32), resized or not. Our resize reproduces torchvision's uint8 antialiased
//!   bicubic fixed-point arithmetic (int16 weights, per-axis precision), so there is nothing to tolerate;
//!   Pillow's 22-bit variant would differ by up to 2 levels (img_1000x20), which this test would catch.
//! - tower outputs, hidden states and logits: 1e-4 absolute, compared as in parity.rs (hidden states layer
//!   by layer with teacher forcing, free-running prompt logits against transformers in float64, step and
//!   chunk logits against its f32 runs); the tower adds two pre-LN blocks of f32 sums over ≤ 1536 terms.
//! - positions: exact.
//!
//! Teacher forcing at the vision/decoder boundary: the decoder tests inject transformers' own vision rows
//! (`image_embeds` / `video_embeds`), while the tower is compared with them separately (max 2.6e-6, docs/fixtures.md). This
//! matters because the random tiny MoE is ill-conditioned at some tokens: in float64 transformers, a 2e-6
//! random perturbation of the input embeddings of `two_images` moves `hidden_states.3` at token 85 by
//! 7–9e-4 (tools/README.md, "conditioning"), so chaining our tower into the decoder would measure the
//! model's conditioning, not our code. At that token our free-running f32 logits are 7.3e-5 from float64
//! and transformers' f32 ones 2.8e-5, in opposite directions: hence the float64 reference for prompt
//! logits. The end-to-end path (PNG → logits) is tested in the root crate.

use crate::common;

use std::collections::BTreeMap;

use common::{assert_close, assert_rows_close, fixtures, model, Ref};
use osprey_models::positions::{mrope_positions, token_types};
use osprey_models::vision::{
    decode_image, preprocess_image, preprocess_video, rows_in_chunk, DecodeLimits, MediaSpan, ProcessorConfig,
    RgbImage, VisionTower,
};
use osprey_models::{CausalLm, ForwardOptions, LogitsWanted, Positions, SeqInput, SeqState, SeqStep};

const ATOL: f32 = 1e-4;
const MODELS: [&str; 2] = ["qwen3_5-tiny", "qwen3_5_moe-tiny"];
const CASES: [&str; 4] = ["image", "two_images", "video", "image_video"];

fn media(name: &str) -> RgbImage {
    let bytes = std::fs::read(fixtures().join("media").join(name)).expect("media file");
    decode_image(&bytes, DecodeLimits::default()).expect("decode")
}

/// HF pixel rows, decoded from the uint8 codes exactly as the processor computes them. A video's rows are
/// stored whole (`.codes`); an image's patch repeats its one frame over the temporal patch of 2 (the processor
/// tiles it), so its reference keeps one frame per channel (`.codes_one_frame`, [n, 3, 16*16],
/// tools/gen_vision_fixtures.py checks the frames are equal) and the rows are rebuilt here.
fn hf_pixels(pre: &Ref, name: &str) -> (Vec<f32>, [usize; 3]) {
    let codes = if pre.has(&format!("{name}.codes")) {
        pre.raw(&format!("{name}.codes")).2
    } else {
        let (_, shape, one) = pre.raw(&format!("{name}.codes_one_frame"));
        let plane = shape[2];
        one.chunks_exact(plane).flat_map(|frame| frame.iter().chain(frame).copied()).collect()
    };
    let g = pre.i64s(&format!("{name}.grid"));
    (codes.iter().map(|&u| (u as f32 - 127.5) / 127.5).collect(), [g[0] as usize, g[1] as usize, g[2] as usize])
}

fn processor() -> ProcessorConfig {
    ProcessorConfig::from_dir(&fixtures().join("models/qwen3_5_moe-tiny")).expect("processor config")
}

#[test]
fn image_and_video_preprocessing_matches_transformers() {
    let pre = Ref::load_file("preprocess.safetensors");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("ref/preprocess.json")).expect("json"))
            .expect("json");
    let proc = processor();
    let mut small = proc.image.clone();
    small.min_pixels = 4096;
    small.max_pixels = 65536;
    // Upscaled, unresized, extreme aspect ratio (50:1), alpha over white + upscale, downscaled.
    for name in ["img_224x160", "img_256x256", "img_1000x20", "img_rgba_64x64", "img_640x480"] {
        let params = if name == "img_640x480" { &small } else { &proc.image };
        let got = preprocess_image(&media(&format!("{name}.png")), params).expect("preprocess");
        let (want, grid) = hf_pixels(&pre, name);
        assert_eq!(got.grid, grid, "{name} grid");
        let off = got.rows.iter().zip(&want).filter(|(a, b)| a != b).count();
        assert_eq!(off, 0, "{name}: {off} of {} pixel values differ from transformers", want.len());
    }
    for (name, n) in [("vid4_160x224", 4), ("vid5_96x128", 5)] {
        let frames: Vec<RgbImage> = (0..n).map(|i| media(&format!("{name}_{i}.png"))).collect();
        let got = preprocess_video(&frames, 2.0, &proc.video).expect("video");
        let (want, grid) = hf_pixels(&pre, name);
        assert_eq!(got.patches.grid, grid, "{name} grid");
        // Both videos need no resize: bit-exact, including the padding of 5 frames to 6.
        assert_eq!(got.patches.rows, want, "{name} pixels");
        let ts: Vec<f64> = serde_json::from_value(meta["items"][name]["timestamps"].clone()).expect("timestamps");
        assert_eq!(got.timestamps, ts, "{name} timestamps");
    }
}

#[test]
fn exif_orientation_is_applied() {
    let bytes = std::fs::read(fixtures().join("media/exif_rot6.jpg")).expect("jpeg");
    let img = decode_image(&bytes, DecodeLimits::default()).expect("decode");
    let meta: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("ref/preprocess.json")).expect("json"))
            .expect("json");
    let want: Vec<usize> = serde_json::from_value(meta["exif_rot6_size_after_transpose"].clone()).expect("size");
    assert_eq!(vec![img.width, img.height], want);
}

/// Vision rows for a case from HF's pixel rows through our tower: (image rows, video rows).
fn tower_rows(tower: &VisionTower, case: &Ref) -> (Vec<f32>, Vec<f32>) {
    let pre = Ref::load_file("preprocess.safetensors");
    let mut out = (Vec::new(), Vec::new());
    for (kind, name) in case.meta["media"].as_array().expect("media").iter().map(|m| (m[0].as_str(), m[1].as_str())) {
        let (px, grid) = hf_pixels(&pre, name.expect("name"));
        let rows = tower.encode(&px, grid).expect("encode");
        if kind == Some("video") {
            out.1.extend(rows)
        } else {
            out.0.extend(rows)
        }
    }
    out
}

#[test]
fn vision_tower_matches_transformers() {
    vision_tower(common::tower);
}

/// A vision tower on some backend.
pub type TowerLoader = fn(&str) -> VisionTower;

/// Image and video embeddings against transformers, for towers from `load`.
pub fn vision_tower(load: TowerLoader) {
    for m in MODELS {
        let tower = load(m);
        for case in CASES {
            let r = Ref::load(m, case);
            let (img, vid) = tower_rows(&tower, &r);
            if r.has("image_embeds") {
                assert_close(&format!("{m}/{case} image embeds"), &img, &r.f32s("image_embeds"), ATOL);
            }
            if r.has("video_embeds") {
                assert_close(&format!("{m}/{case} video embeds"), &vid, &r.f32s("video_embeds"), ATOL);
            }
        }
    }
}

struct Case {
    ids: Vec<u32>,
    positions: Vec<[i64; 3]>,
    delta: i64,
    /// (offset, rows) per placeholder run: images whole, videos per frame group.
    spans: Vec<(usize, Vec<f32>)>,
}

fn build_case(m: &dyn CausalLm, tower: &VisionTower, r: &Ref) -> Case {
    let ids = r.ids("input_ids");
    let cfg = osprey_models::ModelConfig::from_dir(&fixtures().join("models/qwen3_5_moe-tiny")).expect("config");
    let (img_id, vid_id) =
        (cfg.media_tokens.image_token_id.expect("image id"), cfg.media_tokens.video_token_id.expect("video id"));
    let grids = |name: &str| -> Vec<[usize; 3]> {
        if !r.has(name) {
            return Vec::new();
        }
        r.i64s(name).chunks(3).map(|g| [g[0] as usize, g[1] as usize, g[2] as usize]).collect()
    };
    let pos =
        mrope_positions(&token_types(&ids, img_id, vid_id), &grids("image_grid_thw"), &grids("video_grid_thw"), 2)
            .expect("positions");
    let _ = tower;
    let take = |name: &str| if r.has(name) { r.f32s(name) } else { Vec::new() };
    let (img, vid) = (take("image_embeds"), take("video_embeds"));
    let h = m.info().hidden_size;
    let (mut img_at, mut vid_at) = (0, 0);
    let spans = r.meta["spans"]
        .as_array()
        .expect("spans")
        .iter()
        .map(|s| {
            let (a, b) = (s[0].as_u64().expect("start") as usize, s[1].as_u64().expect("end") as usize);
            let n = (b - a) * h;
            if ids[a] == img_id {
                img_at += n;
                (a, img[img_at - n..img_at].to_vec())
            } else {
                vid_at += n;
                (a, vid[vid_at - n..vid_at].to_vec())
            }
        })
        .collect();
    assert_eq!((img_at, vid_at), (img.len(), vid.len()), "every vision row is placed");
    Case { ids, positions: pos.positions, delta: pos.delta, spans }
}

/// Feeds prompt tokens `[start, end)` with their positions and the vision rows that fall inside.
fn feed(m: &dyn CausalLm, st: &mut SeqState, c: &Case, start: usize, end: usize, logits: LogitsWanted) -> Vec<f32> {
    let spans: Vec<MediaSpan<'_>> = c.spans.iter().map(|(o, rows)| MediaSpan { offset: *o, rows }).collect();
    let inj = rows_in_chunk(&spans, start, end, m.info().hidden_size);
    let input = SeqInput {
        tokens: &c.ids[start..end],
        positions: Positions::Explicit(&c.positions[start..end]),
        injected: &inj,
        logits,
    };
    let out = m.forward(&mut [SeqStep { state: st, input }], false).expect("forward").logits.remove(0);
    st.rope_delta = c.delta;
    out
}

#[test]
fn positions_and_multimodal_logits_match_transformers() {
    positions_and_multimodal_logits(model, common::tower);
}

/// Positions, teacher-forced hidden states and logits with media against transformers, for models and
/// towers from the loaders.
pub fn positions_and_multimodal_logits(load: crate::parity::Loader, load_tower: TowerLoader) {
    for name in MODELS {
        let m = load(name);
        let tower = load_tower(name);
        let v = m.info().vocab_size;
        for case in CASES {
            let r = Ref::load(name, case);
            let c = build_case(&m, &tower, &r);
            // Positions and delta: exact.
            let want = r.i64s("position_ids");
            let l = c.ids.len();
            let got: Vec<i64> = (0..3).flat_map(|a| c.positions.iter().map(move |p| p[a])).collect();
            assert_eq!(got, want, "{name}/{case} positions");
            assert_eq!(c.delta, r.i64s("rope_delta")[0], "{name}/{case} delta");
            // One shot. Hidden states layer by layer with teacher forcing (layer i reads the reference's
            // hidden_states[i]), then all prompt logits of the free-running forward.
            let spans: Vec<MediaSpan<'_>> = c.spans.iter().map(|(o, rows)| MediaSpan { offset: *o, rows }).collect();
            let inj = rows_in_chunk(&spans, 0, l, m.info().hidden_size);
            let teacher: Vec<Vec<f32>> =
                (0..m.info().num_layers).map(|i| r.f32s(&format!("hidden_states.{i}"))).collect();
            let mut st = m.new_state();
            let input = SeqInput {
                tokens: &c.ids,
                positions: Positions::Explicit(&c.positions),
                injected: &inj,
                logits: LogitsWanted::None,
            };
            let opts = ForwardOptions { capture_hidden: true, teacher_inputs: Some(&teacher), ..Default::default() };
            let tf = m.forward_with(&mut [SeqStep { state: &mut st, input }], &opts).expect("forward");
            for (i, h) in tf.hidden.iter().enumerate() {
                assert_rows_close(
                    &format!("{name}/{case} hidden_states.{i} (teacher-forced)"),
                    h,
                    &r,
                    &format!("hidden_states.{i}"),
                    ATOL,
                );
            }
            let mut st = m.new_state();
            let input = SeqInput {
                tokens: &c.ids,
                positions: Positions::Explicit(&c.positions),
                injected: &inj,
                logits: LogitsWanted::All,
            };
            let out = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward");
            assert_rows_close(&format!("{name}/{case} all logits vs f64"), &out.logits[0], &r, "all_logits_f64", ATOL);
            // Teacher-forced decode at position t + delta.
            let steps = r.f32s("step_logits");
            let mut st = m.new_state();
            let mut logits = feed(&m, &mut st, &c, 0, l, LogitsWanted::Last);
            for (i, tok) in r.ids("generated_ids").into_iter().enumerate() {
                assert_close(&format!("{name}/{case} step {i}"), &logits, &steps[i * v..(i + 1) * v], ATOL);
                let input = SeqInput::text(std::slice::from_ref(&tok));
                logits = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("decode").logits.remove(0);
            }
            // Chunked prefill with splits inside media spans: every chunk end, and the end equals one-shot.
            let splits: BTreeMap<String, Vec<usize>> =
                serde_json::from_value(r.meta["splits"].clone()).expect("splits");
            for (split, ends) in splits {
                let want = r.f32s(&format!("chunked.{split}"));
                let mut st = m.new_state();
                let mut start = 0;
                for (k, &end) in ends.iter().enumerate() {
                    let got = feed(&m, &mut st, &c, start, end, LogitsWanted::Last);
                    assert_close(
                        &format!("{name}/{case} split {split} chunk {k}"),
                        &got,
                        &want[k * v..(k + 1) * v],
                        ATOL,
                    );
                    start = end;
                }
                let last = &out.logits[0][(l - 1) * v..];
                let got = &want[(ends.len() - 1) * v..];
                assert_close(&format!("{name}/{case} split {split} vs one-shot"), got, last, ATOL);
            }
        }
    }
}
