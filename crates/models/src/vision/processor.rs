//! Processor parameters read from the checkpoint: `processor_config.json` (transformers 5: nested
//! `image_processor` / `video_processor`) or the older `preprocessor_config.json` (+
//! `video_preprocessor_config.json`). Defaults are the values real Qwen3.5 checkpoints ship.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// Image processor parameters (`Qwen2VLImageProcessor`).
#[derive(Clone, Debug, PartialEq)]
pub struct ImageParams {
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Spatial merge (2 → 2×2 patches per soft token).
    pub merge_size: usize,
    /// Frames per temporal patch.
    pub temporal_patch_size: usize,
    /// Minimum pixels after resize (`size.shortest_edge`).
    pub min_pixels: usize,
    /// Maximum pixels after resize (`size.longest_edge`).
    pub max_pixels: usize,
    /// Per-channel mean.
    pub mean: [f32; 3],
    /// Per-channel std.
    pub std: [f32; 3],
    /// 1/255.
    pub rescale_factor: f64,
    /// Resize at all.
    pub do_resize: bool,
}

impl Default for ImageParams {
    fn default() -> Self {
        ImageParams {
            patch_size: 16,
            merge_size: 2,
            temporal_patch_size: 2,
            min_pixels: 65536,
            max_pixels: 16777216,
            mean: [0.5; 3],
            std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
            do_resize: true,
        }
    }
}

/// Video processor parameters (`Qwen3VLVideoProcessor`).
#[derive(Clone, Debug, PartialEq)]
pub struct VideoParams {
    /// Geometry and normalisation (same fields as images; pixel limits apply to `t·h·w`).
    pub image: ImageParams,
    /// Frames sampled per second of video.
    pub fps: f64,
    /// Fewest frames sampled.
    pub min_frames: usize,
    /// Most frames sampled.
    pub max_frames: usize,
    /// Sample frames at all (else every frame is used).
    pub do_sample_frames: bool,
    /// Per-frame pixel cap of the reference implementation (off in transformers 5.23 unless set).
    pub cap_pixels_per_frame: bool,
    /// Token cap per frame used by `cap_pixels_per_frame`.
    pub max_video_tokens: usize,
}

impl Default for VideoParams {
    fn default() -> Self {
        VideoParams {
            image: ImageParams { min_pixels: 4096, max_pixels: 25165824, ..ImageParams::default() },
            fps: 2.0,
            min_frames: 4,
            max_frames: 768,
            do_sample_frames: true,
            cap_pixels_per_frame: false,
            max_video_tokens: 768,
        }
    }
}

/// Both processors.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ProcessorConfig {
    /// Images.
    pub image: ImageParams,
    /// Videos.
    pub video: VideoParams,
}

#[derive(Debug, Default, Deserialize)]
struct Size {
    shortest_edge: Option<usize>,
    longest_edge: Option<usize>,
}

#[derive(Debug, Default, Deserialize)]
struct Raw {
    patch_size: Option<usize>,
    merge_size: Option<usize>,
    temporal_patch_size: Option<usize>,
    size: Option<Size>,
    min_pixels: Option<usize>,
    max_pixels: Option<usize>,
    image_mean: Option<Vec<f32>>,
    image_std: Option<Vec<f32>>,
    rescale_factor: Option<f64>,
    resample: Option<u32>,
    do_resize: Option<bool>,
    do_rescale: Option<bool>,
    do_normalize: Option<bool>,
    fps: Option<f64>,
    min_frames: Option<usize>,
    max_frames: Option<usize>,
    do_sample_frames: Option<bool>,
    cap_pixels_per_frame: Option<bool>,
    max_video_tokens: Option<usize>,
}

fn three(v: Option<Vec<f32>>, default: [f32; 3], name: &str) -> Result<[f32; 3]> {
    match v {
        None => Ok(default),
        Some(v) => v.try_into().map_err(|_| Error::Unsupported(format!("{name} must have 3 values"))),
    }
}

impl Raw {
    fn image(self, d: &ImageParams) -> Result<ImageParams> {
        if let Some(r) = self.resample {
            if r != 3 {
                return Err(Error::Unsupported(format!("resample {r} (only 3 = bicubic)")));
            }
        }
        if self.do_rescale == Some(false) || self.do_normalize == Some(false) {
            return Err(Error::Unsupported("do_rescale/do_normalize = false".into()));
        }
        let size = self.size.unwrap_or_default();
        let p = ImageParams {
            patch_size: self.patch_size.unwrap_or(d.patch_size),
            merge_size: self.merge_size.unwrap_or(d.merge_size),
            temporal_patch_size: self.temporal_patch_size.unwrap_or(d.temporal_patch_size),
            min_pixels: size.shortest_edge.or(self.min_pixels).unwrap_or(d.min_pixels),
            max_pixels: size.longest_edge.or(self.max_pixels).unwrap_or(d.max_pixels),
            mean: three(self.image_mean, d.mean, "image_mean")?,
            std: three(self.image_std, d.std, "image_std")?,
            rescale_factor: self.rescale_factor.unwrap_or(d.rescale_factor),
            do_resize: self.do_resize.unwrap_or(d.do_resize),
        };
        if p.patch_size == 0 || p.merge_size == 0 || p.temporal_patch_size == 0 || p.min_pixels > p.max_pixels {
            return Err(Error::Unsupported(format!("processor geometry {p:?}")));
        }
        Ok(p)
    }
}

fn read_json(path: &Path) -> Result<Option<serde_json::Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = crate::files::read_small(path, crate::files::MAX_CONFIG_BYTES)
        .map_err(|source| Error::Io { path: path.to_path_buf(), source })?;
    serde_json::from_str(&text).map(Some).map_err(|source| Error::Json { path: path.to_path_buf(), source })
}

fn parse(v: Option<&serde_json::Value>, path: &Path) -> Result<Raw> {
    match v {
        None => Ok(Raw::default()),
        Some(v) => serde_json::from_value(v.clone()).map_err(|source| Error::Json { path: path.to_path_buf(), source }),
    }
}

impl ProcessorConfig {
    /// Reads the processor config of a model directory; absent files give the Qwen3.5 defaults.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let (img_path, vid_path) = (dir.join("processor_config.json"), dir.join("video_preprocessor_config.json"));
        let (image_raw, video_raw) = if let Some(v) = read_json(&img_path)? {
            (parse(v.get("image_processor"), &img_path)?, parse(v.get("video_processor"), &img_path)?)
        } else {
            let pre = dir.join("preprocessor_config.json");
            let image = parse(read_json(&pre)?.as_ref(), &pre)?;
            let video = parse(read_json(&vid_path)?.as_ref(), &vid_path)?;
            (image, video)
        };
        let image = image_raw.image(&ImageParams::default())?;
        let d = VideoParams::default();
        let video = VideoParams {
            fps: video_raw.fps.unwrap_or(d.fps),
            min_frames: video_raw.min_frames.unwrap_or(d.min_frames),
            max_frames: video_raw.max_frames.unwrap_or(d.max_frames),
            do_sample_frames: video_raw.do_sample_frames.unwrap_or(d.do_sample_frames),
            cap_pixels_per_frame: video_raw.cap_pixels_per_frame.unwrap_or(d.cap_pixels_per_frame),
            max_video_tokens: video_raw.max_video_tokens.unwrap_or(d.max_video_tokens),
            image: video_raw.image(&d.image)?,
        };
        Ok(ProcessorConfig { image, video })
    }
}
