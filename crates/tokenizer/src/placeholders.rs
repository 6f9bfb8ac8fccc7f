//! Expanding the template's media placeholders to one token per vision row, as transformers 5.23's
//! `Qwen3VLProcessor` does on the rendered text:
//! - each `<|image_pad|>` becomes `<|image_pad|>` × (t·h·w / merge²);
//! - each `<|video_pad|>` becomes, per temporal frame group, `<T seconds><|vision_start|>` +
//!   `<|video_pad|>` × (h·w / merge²) + `<|vision_end|>`, with `T` formatted like Python's `f"{t:.1f}"`.
//!   Only the pad is replaced, so the template's own `<|vision_start|>`/`<|vision_end|>` stay around the
//!   groups (the nested layout of 5.23; every group is its own mRoPE item).

use crate::{Error, Result, LITERAL_OPEN};

/// `<|image_pad|>`.
pub const IMAGE_PAD: &str = "<|image_pad|>";
/// `<|video_pad|>`.
pub const VIDEO_PAD: &str = "<|video_pad|>";

/// What one media item expands to.
#[derive(Clone, Debug, PartialEq)]
pub enum MediaPlaceholder {
    /// An image with this many soft tokens.
    Image {
        /// `t·h·w / merge²`.
        tokens: usize,
    },
    /// A video: one entry per temporal frame group.
    Video {
        /// `h·w / merge²`.
        tokens_per_group: usize,
        /// Seconds, one per group.
        timestamps: Vec<f64>,
    },
}

/// Python's `f"{t:.1f}"` (round half to even on the exact binary value; Rust's formatter does the same).
pub fn format_seconds(t: f64) -> String {
    format!("{t:.1}")
}

/// Replaces the i-th `<|image_pad|>` with image i's tokens and the j-th `<|video_pad|>` with video j's
/// groups. The numbers of placeholders and items of each kind must agree. A placeholder a client typed is
/// text (`TextTokenizer::mark_literal` wrapped it in [`LITERAL_OPEN`]/[`LITERAL_CLOSE`]): it is neither
/// expanded nor counted; only the template's own placeholders stand for the request's media.
pub fn expand_media_placeholders(prompt: &str, media: &[MediaPlaceholder]) -> Result<String> {
    let images: Vec<&MediaPlaceholder> = media.iter().filter(|m| matches!(m, MediaPlaceholder::Image { .. })).collect();
    let videos: Vec<&MediaPlaceholder> = media.iter().filter(|m| matches!(m, MediaPlaceholder::Video { .. })).collect();
    let (mut ii, mut vi) = (0, 0);
    let mut out = String::with_capacity(prompt.len());
    let mut rest = prompt;
    loop {
        let next_img = rest.find(IMAGE_PAD);
        let next_vid = rest.find(VIDEO_PAD);
        let (at, is_image) = match (next_img, next_vid) {
            (None, None) => break,
            (Some(a), None) => (a, true),
            (None, Some(b)) => (b, false),
            (Some(a), Some(b)) => (a.min(b), a < b),
        };
        let len = if is_image { IMAGE_PAD.len() } else { VIDEO_PAD.len() };
        if rest[..at].ends_with(LITERAL_OPEN) {
            out.push_str(&rest[..at + len]);
            rest = &rest[at + len..];
            continue;
        }
        out.push_str(&rest[..at]);
        let item = if is_image { images.get(ii) } else { videos.get(vi) };
        match item {
            Some(MediaPlaceholder::Image { tokens }) => {
                out.push_str(&IMAGE_PAD.repeat(*tokens));
                ii += 1;
            }
            Some(MediaPlaceholder::Video { tokens_per_group, timestamps }) => {
                for t in timestamps {
                    out.push_str(&format!("<{} seconds><|vision_start|>", format_seconds(*t)));
                    out.push_str(&VIDEO_PAD.repeat(*tokens_per_group));
                    out.push_str("<|vision_end|>");
                }
                vi += 1;
            }
            None => {
                let kind = if is_image { "image" } else { "video" };
                return Err(Error::Media(format!("the prompt has more {kind} placeholders than {kind}s")));
            }
        }
        rest = &rest[at + len..];
    }
    out.push_str(rest);
    if ii != images.len() || vi != videos.len() {
        return Err(Error::Media(format!(
            "{} images and {} videos given, but the prompt has {ii} image and {vi} video placeholders",
            images.len(),
            videos.len()
        )));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn python_float_formatting_edge_cases() {
        let got: Vec<String> = [0.25, 1.25, 0.35, 0.45, 2.5, 0.05, 3.75].iter().map(|t| format_seconds(*t)).collect();
        // Python: [f"{t:.1f}" for t in ...]
        assert_eq!(got, ["0.2", "1.2", "0.3", "0.5", "2.5", "0.1", "3.8"]);
    }

    #[test]
    fn placeholders_a_client_typed_stay_text() {
        let typed = |t: &str| format!("{LITERAL_OPEN}{t}{}", crate::LITERAL_CLOSE);
        let p = format!("<|vision_start|><|image_pad|><|vision_end|>{} and {}", typed(VIDEO_PAD), typed(IMAGE_PAD));
        let out = expand_media_placeholders(&p, &[MediaPlaceholder::Image { tokens: 2 }]).expect("expand");
        assert_eq!(
            out,
            format!(
                "<|vision_start|><|image_pad|><|image_pad|><|vision_end|>{} and {}",
                typed(VIDEO_PAD),
                typed(IMAGE_PAD)
            )
        );
    }

    #[test]
    fn images_and_videos_expand_in_order_and_counts_are_checked() {
        let media = [
            MediaPlaceholder::Video { tokens_per_group: 2, timestamps: vec![0.25, 1.25] },
            MediaPlaceholder::Image { tokens: 3 },
        ];
        let p = "<|vision_start|><|image_pad|><|vision_end|>x<|vision_start|><|video_pad|><|vision_end|>";
        let out = expand_media_placeholders(p, &media).expect("expand");
        assert_eq!(
            out,
            "<|vision_start|><|image_pad|><|image_pad|><|image_pad|><|vision_end|>x<|vision_start|>\
             <0.2 seconds><|vision_start|><|video_pad|><|video_pad|><|vision_end|>\
             <1.2 seconds><|vision_start|><|video_pad|><|video_pad|><|vision_end|><|vision_end|>"
        );
        assert!(expand_media_placeholders("<|image_pad|><|image_pad|>", &media[1..]).is_err());
        assert!(expand_media_placeholders("no media", &media[1..]).is_err());
    }
}
