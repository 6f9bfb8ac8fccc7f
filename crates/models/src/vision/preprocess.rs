//! Image and video preprocessing exactly as transformers 5.23's `Qwen2VLImageProcessor` /
//! `Qwen3VLVideoProcessor` (REFERENCE.md §3): `smart_resize` with Python's half-to-even rounding,
//! antialiased bicubic resize (torchvision's uint8 two-pass fixed-point algorithm, see below), fused
//! rescale + normalise, and patchify into merge-block-major rows of
//! `C·T·P·P` values (the flattened `Conv3d` kernel order, so the patch embedding is one matmul).

use crate::error::{Error, Result};
use crate::vision::media::RgbImage;
use crate::vision::processor::{ImageParams, VideoParams};

/// Patch rows of one image or video and its grid in patches.
#[derive(Clone, Debug, PartialEq)]
pub struct PixelPatches {
    /// `[t·h·w, C·T·P·P]` in merge-block-major order.
    pub rows: Vec<f32>,
    /// `[t, h, w]` in patches (`t` in temporal patches).
    pub grid: [usize; 3],
}

impl PixelPatches {
    /// Soft tokens the decoder sees: `t·h·w / merge²`.
    pub fn tokens(&self, merge: usize) -> usize {
        self.grid.iter().product::<usize>() / (merge * merge)
    }
}

/// Python's `round()` on a float: ties to even.
fn py_round(x: f64) -> i64 {
    x.round_ties_even() as i64
}

fn aspect_check(h: usize, w: usize) -> Result<()> {
    if h == 0 || w == 0 {
        return Err(Error::InvalidInput("image has a zero dimension".into()));
    }
    let r = h.max(w) as f64 / h.min(w) as f64;
    if r > 200.0 {
        return Err(Error::InvalidInput(format!("absolute aspect ratio must be smaller than 200, got {r}")));
    }
    Ok(())
}

/// `smart_resize` of the image processor: both sides multiples of `factor`, area in `[min, max]` pixels.
pub fn smart_resize(h: usize, w: usize, factor: usize, min_pixels: usize, max_pixels: usize) -> Result<(usize, usize)> {
    aspect_check(h, w)?;
    let f = factor as f64;
    let (hf, wf) = (h as f64, w as f64);
    let mut hb = py_round(hf / f) * factor as i64;
    let mut wb = py_round(wf / f) * factor as i64;
    if (hb * wb) as f64 > max_pixels as f64 {
        let beta = ((hf * wf) / max_pixels as f64).sqrt();
        hb = (factor as i64).max(((hf / beta / f).floor() * f) as i64);
        wb = (factor as i64).max(((wf / beta / f).floor() * f) as i64);
    } else if ((hb * wb) as f64) < min_pixels as f64 {
        let beta = (min_pixels as f64 / (hf * wf)).sqrt();
        hb = ((hf * beta / f).ceil() * f) as i64;
        wb = ((wf * beta / f).ceil() * f) as i64;
    }
    Ok((hb as usize, wb as usize))
}

/// The video variant: area checks on `t̄·h̄·w̄`, small frames first upscaled to at least `factor`.
pub fn smart_resize_video(
    t: usize,
    h: usize,
    w: usize,
    (temporal, factor): (usize, usize),
    min_pixels: usize,
    max_pixels: usize,
) -> Result<(usize, usize)> {
    if t < temporal {
        return Err(Error::InvalidInput(format!("t:{t} must be larger than temporal_factor:{temporal}")));
    }
    aspect_check(h, w)?;
    let (mut hf, mut wf) = (h as f64, w as f64);
    let f = factor as f64;
    if h < factor || w < factor {
        let scale = (f / hf).max(f / wf);
        hf = (hf * scale).trunc();
        wf = (wf * scale).trunc();
    }
    let mut hb = py_round(hf / f) * factor as i64;
    let mut wb = py_round(wf / f) * factor as i64;
    let tb = py_round(t as f64 / temporal as f64) * temporal as i64;
    let tf = t as f64;
    if (tb * hb * wb) as f64 > max_pixels as f64 {
        let beta = ((tf * hf * wf) / max_pixels as f64).sqrt();
        hb = (factor as i64).max(((hf / beta / f).floor() * f) as i64);
        wb = (factor as i64).max(((wf / beta / f).floor() * f) as i64);
    } else if ((tb * hb * wb) as f64) < min_pixels as f64 {
        let beta = (min_pixels as f64 / (tf * hf * wf)).sqrt();
        hb = ((hf * beta / f).ceil() * f) as i64;
        wb = ((wf * beta / f).ceil() * f) as i64;
    }
    Ok((hb as usize, wb as usize))
}

// ---- Antialiased bicubic resample of uint8 images, as torchvision's uint8 path computes it ----
//
// torch (`upsample_avx_bilinear_bicubic_uint8`, a port of Pillow-SIMD) and Pillow share the algorithm:
// a horizontal pass then a vertical pass with a uint8 image in between, Keys bicubic (a = −0.5) with the
// support widened by the downscale factor, weights normalised to sum 1 in f64 and applied in fixed point
// with rounding and saturation. They differ only in the fixed-point precision: Pillow uses 22 bits,
// torch uses int16 weights with, per axis, the largest precision (< 22 bits) at which the largest weight
// still fits in int16. We follow torch, which is what transformers' default (torchvision) backend runs.

fn bicubic(x: f64) -> f64 {
    const A: f64 = -0.5;
    let x = x.abs();
    if x < 1.0 {
        ((A + 2.0) * x - (A + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        (((x - 5.0) * x + 8.0) * x - 4.0) * A
    } else {
        0.0
    }
}

/// Per output pixel: first input index, tap count, fixed-point weights (`ksize` per pixel), precision.
struct Coeffs {
    bounds: Vec<(usize, usize)>,
    ksize: usize,
    k: Vec<i32>,
    precision: u32,
}

fn coeffs(in_size: usize, out_size: usize) -> Coeffs {
    let scale = in_size as f64 / out_size as f64;
    let filterscale = scale.max(1.0);
    let support = 2.0 * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size);
    let mut weights = vec![0f64; out_size * ksize];
    let mut wt_max = 0f64;
    for xx in 0..out_size {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(in_size as i64) as usize - xmin;
        let w = &mut weights[xx * ksize..xx * ksize + xmax];
        for (x, v) in w.iter_mut().enumerate() {
            *v = bicubic((x as f64 + xmin as f64 - center + 0.5) * ss);
        }
        let ww: f64 = w.iter().sum();
        if ww != 0.0 {
            for v in w.iter_mut() {
                *v /= ww;
                wt_max = wt_max.max(*v);
            }
        }
        bounds.push((xmin, xmax));
    }
    let mut precision = 0;
    while precision < 22 && ((0.5 + wt_max * (1u64 << (precision + 1)) as f64) as i64) < (1 << 15) {
        precision += 1;
    }
    let one = (1u64 << precision) as f64;
    let k = weights
        .iter()
        .map(|&v| if v < 0.0 { (-0.5 + v * one) as i16 as i32 } else { (0.5 + v * one) as i16 as i32 })
        .collect();
    Coeffs { bounds, ksize, k, precision }
}

#[inline]
fn clip8(v: i64, precision: u32) -> u8 {
    (v >> precision).clamp(0, 255) as u8
}

/// Resizes an RGB image to `(h, w)`: antialiased bicubic, horizontal pass then vertical, uint8 between.
pub fn resize_bicubic(img: &RgbImage, h: usize, w: usize) -> RgbImage {
    let mut cur = img.clone();
    if w != cur.width {
        let c = coeffs(cur.width, w);
        let mut out = vec![0u8; cur.height * w * 3];
        for y in 0..cur.height {
            let row = &cur.data[y * cur.width * 3..(y + 1) * cur.width * 3];
            for (xx, &(xmin, n)) in c.bounds.iter().enumerate() {
                let k = &c.k[xx * c.ksize..xx * c.ksize + n];
                for ch in 0..3 {
                    let mut ss: i64 = 1 << (c.precision - 1);
                    for (x, kv) in k.iter().enumerate() {
                        ss += row[(xmin + x) * 3 + ch] as i64 * *kv as i64;
                    }
                    out[(y * w + xx) * 3 + ch] = clip8(ss, c.precision);
                }
            }
        }
        cur = RgbImage { width: w, height: cur.height, data: out };
    }
    if h != cur.height {
        let c = coeffs(cur.height, h);
        let mut out = vec![0u8; h * cur.width * 3];
        let stride = cur.width * 3;
        for (yy, &(ymin, n)) in c.bounds.iter().enumerate() {
            let k = &c.k[yy * c.ksize..yy * c.ksize + n];
            for i in 0..stride {
                let mut ss: i64 = 1 << (c.precision - 1);
                for (y, kv) in k.iter().enumerate() {
                    ss += cur.data[(ymin + y) * stride + i] as i64 * *kv as i64;
                }
                out[yy * stride + i] = clip8(ss, c.precision);
            }
        }
        cur = RgbImage { width: cur.width, height: h, data: out };
    }
    cur
}

/// Fused rescale + normalise, per channel: `(x − mean/rescale) / (std/rescale)` in f32, as transformers'
/// torchvision backend computes it. Returns `[3, H, W]`.
fn normalize(img: &RgbImage, mean: [f32; 3], std: [f32; 3], rescale: f64) -> Vec<f32> {
    let inv = (1.0 / rescale) as f32;
    let (m, s) = (mean.map(|v| v * inv), std.map(|v| v * inv));
    let hw = img.width * img.height;
    let mut out = vec![0f32; 3 * hw];
    for (p, px) in img.data.chunks_exact(3).enumerate() {
        for c in 0..3 {
            out[c * hw + p] = (px[c] as f32 - m[c]) / s[c];
        }
    }
    out
}

/// Patch rows from normalised frames `[F][3, H, W]` (`F` a multiple of `temporal`).
fn patchify(frames: &[Vec<f32>], h: usize, w: usize, patch: usize, merge: usize, temporal: usize) -> PixelPatches {
    let (gt, gh, gw) = (frames.len() / temporal, h / patch, w / patch);
    let row_len = 3 * temporal * patch * patch;
    let mut rows = Vec::with_capacity(gt * gh * gw * row_len);
    for t in 0..gt {
        for bh in 0..gh / merge {
            for bw in 0..gw / merge {
                for mh in 0..merge {
                    for mw in 0..merge {
                        let (y0, x0) = ((bh * merge + mh) * patch, (bw * merge + mw) * patch);
                        for c in 0..3 {
                            for tp in 0..temporal {
                                let f = &frames[t * temporal + tp];
                                for py in 0..patch {
                                    let at = c * h * w + (y0 + py) * w + x0;
                                    rows.extend_from_slice(&f[at..at + patch]);
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    PixelPatches { rows, grid: [gt, gh, gw] }
}

/// Resized size of an image (what the placeholder count depends on), without touching pixels.
pub fn image_target_size(p: &ImageParams, h: usize, w: usize) -> Result<(usize, usize)> {
    let factor = p.patch_size * p.merge_size;
    if p.do_resize {
        smart_resize(h, w, factor, p.min_pixels, p.max_pixels)
    } else if !h.is_multiple_of(factor) || !w.is_multiple_of(factor) {
        Err(Error::InvalidInput(format!("image {w}x{h} is not a multiple of {factor} and resizing is off")))
    } else {
        Ok((h, w))
    }
}

/// Image → patch rows (the image is its own temporal pair: the frame is repeated `temporal_patch_size` times).
pub fn preprocess_image(img: &RgbImage, p: &ImageParams) -> Result<PixelPatches> {
    let (h, w) = image_target_size(p, img.height, img.width)?;
    let resized = if (h, w) == (img.height, img.width) { img.clone() } else { resize_bicubic(img, h, w) };
    let frame = normalize(&resized, p.mean, p.std, p.rescale_factor);
    let frames = vec![frame; p.temporal_patch_size];
    Ok(patchify(&frames, h, w, p.patch_size, p.merge_size, p.temporal_patch_size))
}

/// Frame indices `Qwen3VLVideoProcessor.sample_frames` keeps: `n = int(total / video_fps · fps)` clamped to
/// `[min_frames, min(max_frames, total)]`, then `linspace(0, total−1, n).round()` (ties to even).
pub fn sample_frame_indices(total: usize, video_fps: f64, p: &VideoParams) -> Vec<usize> {
    if !p.do_sample_frames {
        return (0..total).collect();
    }
    let n = (total as f64 / video_fps * p.fps).trunc() as usize;
    let n = n.max(p.min_frames).min(p.max_frames).min(total);
    if n == 0 {
        return Vec::new();
    }
    if n == 1 {
        return vec![0];
    }
    let stop = (total - 1) as f64;
    let step = stop / (n - 1) as f64;
    (0..n).map(|i| if i == n - 1 { stop } else { i as f64 * step }.round_ties_even() as usize).collect()
}

/// One timestamp per temporal group: indices padded to a multiple of `temporal` with the last one, then
/// the mean of each group's first and last `index / video_fps`.
pub fn frame_group_timestamps(indices: &[usize], video_fps: f64, temporal: usize) -> Vec<f64> {
    let mut idx = indices.to_vec();
    while !idx.len().is_multiple_of(temporal) {
        idx.push(*idx.last().expect("non-empty"));
    }
    idx.chunks(temporal).map(|g| (g[0] as f64 / video_fps + g[temporal - 1] as f64 / video_fps) / 2.0).collect()
}

/// A preprocessed video: patch rows plus the timestamp of each frame group (for the prompt).
#[derive(Clone, Debug, PartialEq)]
pub struct VideoPatches {
    /// Rows and grid.
    pub patches: PixelPatches,
    /// Seconds, one per temporal group (`grid[0]` of them).
    pub timestamps: Vec<f64>,
}

/// Decoded frames (all of the video, in order) at `video_fps` → sampled, resized, padded, patchified.
pub fn preprocess_video(frames: &[RgbImage], video_fps: f64, p: &VideoParams) -> Result<VideoPatches> {
    if frames.is_empty() {
        return Err(Error::InvalidMedia("the video has no frames".into()));
    }
    if !(video_fps.is_finite() && video_fps > 0.0) {
        return Err(Error::InvalidMedia(format!("the video's frame rate must be positive, got {video_fps}")));
    }
    let (w0, h0) = (frames[0].width, frames[0].height);
    if frames.iter().any(|f| f.width != w0 || f.height != h0) {
        return Err(Error::InvalidMedia("the video's frames differ in size".into()));
    }
    let indices = sample_frame_indices(frames.len(), video_fps, p);
    let t = indices.len();
    let factor = p.image.patch_size * p.image.merge_size;
    let temporal = p.image.temporal_patch_size;
    if t < temporal {
        // transformers raises "t:1 must be larger than temporal_factor:2" here; say it in the client's terms.
        return Err(Error::InvalidMedia(format!(
            "the video has {} frame{} ({t} after sampling at the model's frame rate); this model needs at least {temporal} frames per video (send a single frame as an image)",
            frames.len(),
            if frames.len() == 1 { "" } else { "s" }
        )));
    }
    let mut max_pixels = p.image.max_pixels;
    if p.cap_pixels_per_frame {
        let frame_cap = p.max_video_tokens * factor * factor;
        let per_frame = frame_cap.min(p.image.max_pixels / t.max(1)).max((p.image.min_pixels as f64 * 1.05) as usize);
        max_pixels = per_frame * t;
    }
    let (h, w) = if p.image.do_resize {
        smart_resize_video(t, h0, w0, (temporal, factor), p.image.min_pixels, max_pixels)?
    } else {
        (h0, w0)
    };
    if h % factor != 0 || w % factor != 0 {
        return Err(Error::InvalidInput(format!("video frames {w0}x{h0} are not a multiple of {factor}")));
    }
    let mut norm: Vec<Vec<f32>> = indices
        .iter()
        .map(|&i| {
            let f = &frames[i];
            let r = if (h, w) == (f.height, f.width) { f.clone() } else { resize_bicubic(f, h, w) };
            normalize(&r, p.image.mean, p.image.std, p.image.rescale_factor)
        })
        .collect();
    while !norm.len().is_multiple_of(temporal) {
        norm.push(norm.last().expect("non-empty").clone());
    }
    let patches = patchify(&norm, h, w, p.image.patch_size, p.image.merge_size, temporal);
    Ok(VideoPatches { patches, timestamps: frame_group_timestamps(&indices, video_fps, temporal) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn smart_resize_matches_reference_examples() {
        // REFERENCE.md §3: a 224x160 (WxH) image is below min_pixels and becomes 320x224 (HxW).
        assert_eq!(smart_resize(160, 224, 32, 65536, 16777216).expect("ok"), (224, 320));
        assert_eq!(smart_resize(256, 256, 32, 65536, 16777216).expect("ok"), (256, 256));
        // Half-to-even: 48/32 = 1.5 rounds to 2, 80/32 = 2.5 rounds to 2.
        assert_eq!(smart_resize(48, 80, 32, 0, 1 << 30).expect("ok"), (64, 64));
        assert!(smart_resize(1, 300, 32, 0, 1 << 30).is_err());
        // Video: 4 frames of 160x224 (HxW) stay 160x224 (grid [2,10,14]).
        assert_eq!(smart_resize_video(4, 160, 224, (2, 32), 4096, 25165824).expect("ok"), (160, 224));
    }

    #[test]
    fn frame_sampling_and_timestamps() {
        let p = VideoParams::default();
        assert_eq!(sample_frame_indices(4, 2.0, &p), vec![0, 1, 2, 3]);
        // 48 frames at 24 fps = 2 s → 4 frames (min_frames): linspace(0, 47, 4) = 0, 15.67, 31.33, 47.
        assert_eq!(sample_frame_indices(48, 24.0, &p), vec![0, 16, 31, 47]);
        // linspace(0, 9, 5) = 0, 2.25, 4.5, 6.75, 9 → 4.5 rounds to 4 (ties to even).
        assert_eq!(sample_frame_indices(10, 1.0, &VideoParams { fps: 0.5, ..p.clone() }), vec![0, 2, 4, 7, 9]);
        assert_eq!(frame_group_timestamps(&[0, 1, 2, 3, 4], 2.0, 2), vec![0.25, 1.25, 2.0]);
    }

    #[test]
    fn identity_resize_and_patch_order() {
        let img = RgbImage { width: 4, height: 2, data: (0..24).map(|v| v as u8).collect() };
        assert_eq!(resize_bicubic(&img, 2, 4), img);
        // 4x4 image, patch 2, merge 2, temporal 1: one merge block of 4 patches, rows [C=3][2][2].
        let img = RgbImage { width: 4, height: 4, data: (0..48).map(|v| v as u8).collect() };
        let frame = normalize(&img, [0.0; 3], [1.0; 3], 1.0);
        let p = patchify(&[frame], 4, 4, 2, 2, 1);
        assert_eq!(p.grid, [1, 2, 2]);
        // Second patch (mh=0, mw=1), channel 0: pixels (0,2),(0,3),(1,2),(1,3) → values 6, 9, 18, 21.
        assert_eq!(&p.rows[12..16], &[6.0, 9.0, 18.0, 21.0]);
    }

    #[test]
    fn downscale_is_a_weighted_average() {
        let img = RgbImage { width: 4, height: 1, data: vec![10, 10, 10, 10, 10, 10, 200, 200, 200, 200, 200, 200] };
        let out = resize_bicubic(&img, 1, 2);
        assert_eq!(out.width, 2);
        assert!(out.data[0] < 60 && out.data[3] > 150, "{:?}", out.data);
    }
}
