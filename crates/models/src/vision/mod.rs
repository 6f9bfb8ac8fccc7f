//! Vision: media decoding, preprocessing (exact transformers geometry), the vision tower, and the
//! mapping of vision rows onto a prompt's placeholder spans for chunked injection.

mod media;
mod preprocess;
mod processor;
mod tower;

pub use media::{declared_size, decode_animation, decode_image, DecodeLimits, Frames, RgbImage};
pub use preprocess::{
    frame_group_timestamps, image_target_size, preprocess_image, preprocess_video, resize_bicubic,
    sample_frame_indices, smart_resize, smart_resize_video, PixelPatches, VideoPatches,
};
pub use processor::{ImageParams, ProcessorConfig, VideoParams};
pub use tower::{VisionConfig, VisionTower};

use crate::family::InjectedRows;

/// Vision rows of one placeholder run of a prompt: an image, or one frame group of a video.
#[derive(Clone, Copy, Debug)]
pub struct MediaSpan<'a> {
    /// Prompt position of the run's first placeholder.
    pub offset: usize,
    /// `[len, hidden]` rows, in placeholder order.
    pub rows: &'a [f32],
}

/// The rows to inject into a forward over prompt tokens `[start, end)`: every part of every span that
/// falls inside the chunk, whether the span began in an earlier chunk (or before a cache hit) or not.
pub fn rows_in_chunk<'a>(spans: &[MediaSpan<'a>], start: usize, end: usize, hidden: usize) -> Vec<InjectedRows<'a>> {
    spans
        .iter()
        .filter_map(|s| {
            let len = s.rows.len() / hidden;
            let (a, b) = (s.offset.max(start), (s.offset + len).min(end));
            (a < b).then(|| InjectedRows {
                offset: a - start,
                rows: &s.rows[(a - s.offset) * hidden..(b - s.offset) * hidden],
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_are_clipped_to_the_chunk() {
        let rows: Vec<f32> = (0..10).map(|v| v as f32).collect(); // 5 rows of width 2 at positions 3..8
        let spans = [MediaSpan { offset: 3, rows: &rows }];
        assert!(rows_in_chunk(&spans, 0, 3, 2).is_empty());
        let mid = rows_in_chunk(&spans, 5, 7, 2);
        assert_eq!(mid.len(), 1);
        assert_eq!((mid[0].offset, mid[0].rows), (0, &rows[4..8]));
        let tail = rows_in_chunk(&spans, 6, 20, 2);
        assert_eq!((tail[0].offset, tail[0].rows), (0, &rows[6..10]));
        let head = rows_in_chunk(&spans, 0, 4, 2);
        assert_eq!((head[0].offset, head[0].rows), (3, &rows[0..2]));
        assert!(rows_in_chunk(&spans, 8, 9, 2).is_empty());
    }
}
