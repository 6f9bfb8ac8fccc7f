//! From a rendered prompt and decoded media to what the model reads: pixel rows per media item, the
//! expanded prompt's token ids, mRoPE positions and delta, and the placeholder span of every image and
//! every video frame group (where the vision rows go).

use std::sync::Arc;

use osprey_models::positions::{mrope_positions, runs, token_types, TokenType};
use osprey_models::vision::{preprocess_image, preprocess_video, PixelPatches, ProcessorConfig, RgbImage};
use osprey_protocol::tokenizer::PreparedMedia;
use osprey_protocol::vision::{PixelPatches as ProtocolPatches, Pixels};
use osprey_protocol::MediaHash;

use crate::placeholders::{expand_media_placeholders, MediaPlaceholder, IMAGE_PAD, VIDEO_PAD};
use crate::{Error, Result, TextTokenizer};

/// A decoded media item, in the order its placeholder appears in the prompt.
#[derive(Clone, Debug)]
pub enum Media {
    /// One image.
    Image(RgbImage),
    /// Video frames (all of them, in order) and their rate.
    Video {
        /// Frames.
        frames: Vec<RgbImage>,
        /// Frames per second of `frames`.
        fps: f64,
    },
    /// An item preprocessed before (the same bytes): its rows and placeholder as they were, shared.
    Preprocessed(PreparedItem),
}

/// A preprocessed item and where its rows go.
#[derive(Clone, Debug)]
pub struct PreparedItem {
    /// Pixel rows and grid for the vision tower (shared with the engine's message, and with a later
    /// prompt that sends the same bytes; made on first need for an item seen before).
    pub patches: Arc<Pixels>,
    /// Whether it is a video.
    pub is_video: bool,
    /// What its placeholder expands to.
    pub placeholder: MediaPlaceholder,
    /// Placeholder runs `(offset, len)` in the prompt: one for an image, one per frame group of a video.
    pub spans: Vec<(usize, usize)>,
}

impl PreparedItem {
    /// The item as the engine's messages carry it, under content hash `hash` (the processor's rows move,
    /// no copy).
    pub fn into_media(self, hash: MediaHash) -> PreparedMedia {
        PreparedMedia { hash, patches: self.patches, spans: self.spans }
    }
}

/// The model-ready prompt.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// The prompt text after placeholder expansion.
    pub text: String,
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// `[t, h, w]` per token.
    pub positions: Vec<[i64; 3]>,
    /// Decode position delta.
    pub rope_delta: i64,
    /// Media items in prompt order (images and videos interleaved as they appear).
    pub media: Vec<PreparedItem>,
}

/// The processor's rows as the engine's messages carry them (moved, no copy).
fn shared(p: PixelPatches) -> Arc<Pixels> {
    Arc::new(Pixels::ready(Arc::new(ProtocolPatches { rows: p.rows, grid: p.grid })))
}

/// One decoded item's pixel rows and placeholder (spans empty: they are the prompt's).
pub fn preprocess_item(m: &Media, proc: &ProcessorConfig) -> Result<PreparedItem> {
    let merge = proc.image.merge_size;
    Ok(match m {
        Media::Image(img) => {
            let p = preprocess_image(img, &proc.image)?;
            let placeholder = MediaPlaceholder::Image { tokens: p.tokens(merge) };
            PreparedItem { patches: shared(p), is_video: false, placeholder, spans: Vec::new() }
        }
        Media::Video { frames, fps } => {
            let v = preprocess_video(frames, *fps, &proc.video)?;
            let [_, h, w] = v.patches.grid;
            let placeholder =
                MediaPlaceholder::Video { tokens_per_group: h * w / (merge * merge), timestamps: v.timestamps };
            PreparedItem { patches: shared(v.patches), is_video: true, placeholder, spans: Vec::new() }
        }
        Media::Preprocessed(item) => PreparedItem { spans: Vec::new(), ..item.clone() },
    })
}

/// Preprocesses `media`, expands the placeholders of `prompt` (a rendered chat template), tokenizes and
/// computes positions. Placeholder and media counts must agree.
pub fn prepare_prompt(tok: &TextTokenizer, proc: &ProcessorConfig, prompt: &str, media: &[Media]) -> Result<Prepared> {
    let merge = proc.image.merge_size;
    let mut items = Vec::with_capacity(media.len());
    for m in media {
        items.push(preprocess_item(m, proc)?);
    }
    let placeholders: Vec<MediaPlaceholder> = items.iter().map(|i| i.placeholder.clone()).collect();
    let text = expand_media_placeholders(prompt, &placeholders)?;
    let input_ids = tok.encode(&text)?;
    let id = |t: &str| tok.token_id(t).ok_or_else(|| Error::Media(format!("the tokenizer has no {t} token")));
    let types = token_types(&input_ids, id(IMAGE_PAD)?, id(VIDEO_PAD)?);
    let grids = |video: bool| -> Vec<[usize; 3]> {
        items.iter().filter(|i| i.is_video == video).map(|i| i.patches.grid()).collect()
    };
    let pos = mrope_positions(&types, &grids(false), &grids(true), merge)?;
    // Assign placeholder runs to items: images in order, video frame groups in order.
    let (mut img_runs, mut vid_runs): (Vec<_>, Vec<_>) =
        runs(&types).into_iter().filter(|r| r.kind != TokenType::Text).partition(|r| r.kind == TokenType::Image);
    img_runs.reverse();
    vid_runs.reverse();
    for item in &mut items {
        let groups = if item.is_video { item.patches.grid()[0] } else { 1 };
        let src = if item.is_video { &mut vid_runs } else { &mut img_runs };
        for _ in 0..groups {
            let r = src.pop().ok_or_else(|| Error::Media("fewer placeholder runs than media".into()))?;
            item.spans.push((r.start, r.len));
        }
    }
    Ok(Prepared { text, input_ids, positions: pos.positions, rope_delta: pos.delta, media: items })
}
