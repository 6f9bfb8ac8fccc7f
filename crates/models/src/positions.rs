//! mRoPE positions (`get_rope_index` of transformers 5.23, REFERENCE.md §4).
//!
//! Tokens are cut into maximal runs of one type (text, image placeholders, video placeholders). Text
//! advances one position per token on all three axes. A media run must be exactly one image, or one video
//! frame group (every temporal group of a video is its own item, separated by its timestamp text); its
//! tokens get `(cur, cur + y, cur + x)` over the merged grid, and `cur` then advances by `max(gh, gw)`.
//! The delta `max(position) + 1 − len` continues decode positions: token `t` gets `t + delta`.

use crate::error::{Error, Result};

/// Token type of a prompt position.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenType {
    /// Ordinary text (vision start/end markers included).
    Text,
    /// `<|image_pad|>`.
    Image,
    /// `<|video_pad|>`.
    Video,
}

/// Types of `ids` given the two placeholder ids.
pub fn token_types(ids: &[u32], image_token: u32, video_token: u32) -> Vec<TokenType> {
    ids.iter()
        .map(|&t| match t {
            t if t == image_token => TokenType::Image,
            t if t == video_token => TokenType::Video,
            _ => TokenType::Text,
        })
        .collect()
}

/// A maximal run of one token type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Its type.
    pub kind: TokenType,
    /// First position.
    pub start: usize,
    /// Tokens in the run.
    pub len: usize,
}

/// Maximal runs of equal type.
pub fn runs(types: &[TokenType]) -> Vec<Run> {
    let mut out: Vec<Run> = Vec::new();
    for (i, &k) in types.iter().enumerate() {
        match out.last_mut() {
            Some(r) if r.kind == k => r.len += 1,
            _ => out.push(Run { kind: k, start: i, len: 1 }),
        }
    }
    out
}

/// Positions `[t, h, w]` per token and the decode delta.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MropePositions {
    /// One `[t, h, w]` per prompt token.
    pub positions: Vec<[i64; 3]>,
    /// `max(position) + 1 − len`.
    pub delta: i64,
}

/// Computes positions; grids are in patches (`[t, h, w]`), `merge` the spatial merge size. Errors when the
/// placeholder runs disagree with the grids (a request-building bug or a forged prompt).
pub fn mrope_positions(
    types: &[TokenType],
    image_grids: &[[usize; 3]],
    video_grids: &[[usize; 3]],
    merge: usize,
) -> Result<MropePositions> {
    let videos: Vec<[usize; 3]> = video_grids.iter().flat_map(|&[t, h, w]| std::iter::repeat_n([1, h, w], t)).collect();
    let (mut images, mut videos) = (image_grids.iter(), videos.iter());
    let mut pos = Vec::with_capacity(types.len());
    let mut cur: i64 = 0;
    for run in runs(types) {
        let grid = match run.kind {
            TokenType::Text => {
                pos.extend((0..run.len as i64).map(|k| [cur + k; 3]));
                cur += run.len as i64;
                continue;
            }
            TokenType::Image => images.next(),
            TokenType::Video => videos.next(),
        };
        let [_, h, w] = *grid
            .ok_or_else(|| Error::InvalidInput(format!("more {:?} placeholder runs than media items", run.kind)))?;
        let (gh, gw) = (h / merge, w / merge);
        if gh * gw != run.len {
            return Err(Error::InvalidInput(format!(
                "{:?} run at {} has {} placeholders but its grid needs {}",
                run.kind,
                run.start,
                run.len,
                gh * gw
            )));
        }
        for y in 0..gh as i64 {
            for x in 0..gw as i64 {
                pos.push([cur, cur + y, cur + x]);
            }
        }
        cur += gh.max(gw) as i64;
    }
    if images.next().is_some() || videos.next().is_some() {
        return Err(Error::InvalidInput("more media items than placeholder runs".into()));
    }
    let max = pos.iter().flat_map(|p| p.iter().copied()).max().unwrap_or(-1);
    Ok(MropePositions { delta: max + 1 - types.len() as i64, positions: pos })
}

#[cfg(test)]
mod tests {
    use super::*;
    use TokenType::{Image as I, Text as T, Video as V};

    #[test]
    fn text_only_is_plain_positions() {
        let p = mrope_positions(&[T, T, T], &[], &[], 2).expect("ok");
        assert_eq!(p.positions, vec![[0; 3], [1; 3], [2; 3]]);
        assert_eq!(p.delta, 0);
    }

    #[test]
    fn image_then_text_and_video_groups() {
        // 2 text, a 4x6-patch image (2x3 merged = 6 tokens), 1 text.
        let mut types = vec![T, T];
        types.extend([I; 6]);
        types.push(T);
        let p = mrope_positions(&types, &[[1, 4, 6]], &[], 2).expect("ok");
        assert_eq!(p.positions[2], [2, 2, 2]);
        assert_eq!(p.positions[7], [2, 3, 4]);
        // cur advances by max(2, 3) = 3: the text after the image is at 5.
        assert_eq!(p.positions[8], [5; 3]);
        assert_eq!(p.delta, 6 - 9);
        // A 2-group video: groups separated by text, each restarts T at its own cur.
        let types = [T, V, V, T, V, V];
        let p = mrope_positions(&types, &[], &[[2, 2, 4]], 2).expect("ok");
        assert_eq!(p.positions, vec![[0; 3], [1, 1, 1], [1, 1, 2], [3; 3], [4, 4, 4], [4, 4, 5]]);
    }

    #[test]
    fn mismatched_counts_are_errors() {
        assert!(mrope_positions(&[T, I, I, I], &[[1, 4, 4]], &[], 2).is_err());
        assert!(mrope_positions(&[T, I, I, I, I], &[], &[], 2).is_err());
        assert!(mrope_positions(&[T], &[[1, 2, 2]], &[], 2).is_err());
    }
}
