//! The Qwen3.5 vision tower (`model.visual`, shared by `qwen3_5`, `qwen3_5_moe` and `qwen4_exp`):
//! patch embedding (the Conv3d as one matmul), learned position table bilinearly resampled
//! (align_corners) to each grid, 2-D rotary, `depth` pre-LN blocks with attention restricted to one image
//! or one video frame group, tanh-GELU MLP, then the merger (LayerNorm, 2×2 merge, exact GELU MLP) to
//! the decoder's hidden size. No deepstack (Qwen3-VL has it; Qwen3.5 does not).

use osprey_backend::{AttnShape, Backend, BackendRef, Tensor};
use serde::Deserialize;

use crate::checkpoint::Checkpoint;
use crate::error::{Error, Result};
use crate::layers::{load_vector, place};

/// `vision_config` with the Hugging Face field names.
#[derive(Clone, Debug, Deserialize)]
pub struct VisionConfig {
    /// Blocks.
    pub depth: usize,
    /// Tower width.
    pub hidden_size: usize,
    /// Attention heads.
    pub num_heads: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Patch side in pixels.
    pub patch_size: usize,
    /// Merge side (2 → 4 patches per output row).
    pub spatial_merge_size: usize,
    /// Frames per temporal patch.
    pub temporal_patch_size: usize,
    /// Output width (the decoder's hidden size).
    pub out_hidden_size: usize,
    /// Rows of the learned position table (a square grid).
    pub num_position_embeddings: usize,
    /// Input channels.
    #[serde(default = "three")]
    pub in_channels: usize,
    /// Block MLP activation.
    #[serde(default = "tanh_gelu")]
    pub hidden_act: String,
    /// Rotary base (`rope_parameters.rope_theta`).
    #[serde(default)]
    pub rope_parameters: Option<serde_json::Value>,
}

fn three() -> usize {
    3
}
fn tanh_gelu() -> String {
    "gelu_pytorch_tanh".into()
}

impl VisionConfig {
    fn theta(&self) -> f64 {
        self.rope_parameters.as_ref().and_then(|r| r.get("rope_theta")).and_then(|t| t.as_f64()).unwrap_or(10000.0)
    }

    fn validate(&self) -> Result<()> {
        let side = (self.num_position_embeddings as f64).sqrt() as usize;
        let hd = self.hidden_size / self.num_heads.max(1);
        let ok = self.hidden_act == "gelu_pytorch_tanh"
            && self.hidden_size.is_multiple_of(self.num_heads.max(1))
            && hd.is_multiple_of(4)
            && side * side == self.num_position_embeddings
            && self.spatial_merge_size > 0;
        if !ok {
            return Err(Error::Unsupported(format!("vision_config {self:?}")));
        }
        Ok(())
    }
}

#[derive(Debug)]
struct Affine {
    w: Tensor,
    b: Tensor,
}

impl Affine {
    fn load(be: &dyn Backend, ck: &Checkpoint, p: &str, out: usize, inp: &[usize]) -> Result<Self> {
        let mut shape = vec![out];
        shape.extend_from_slice(inp);
        Ok(Affine {
            w: place(be, ck.weight(&format!("{p}.weight"), &shape)?)?,
            b: load_vector(be, ck, &format!("{p}.bias"), out)?,
        })
    }

    fn forward(&self, be: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        let mut y = be.linear(x, &self.w)?;
        be.add_bias(&mut y, &self.b);
        Ok(y)
    }
}

#[derive(Debug)]
struct Norm {
    w: Tensor,
    b: Tensor,
}

impl Norm {
    fn load(be: &dyn Backend, ck: &Checkpoint, p: &str, d: usize) -> Result<Self> {
        Ok(Norm {
            w: load_vector(be, ck, &format!("{p}.weight"), d)?,
            b: load_vector(be, ck, &format!("{p}.bias"), d)?,
        })
    }

    fn apply(&self, be: &dyn Backend, x: &Tensor) -> Tensor {
        let mut y = x.clone();
        be.layer_norm(&mut y, &self.w, &self.b, 1e-6);
        y
    }
}

#[derive(Debug)]
struct Block {
    norm1: Norm,
    norm2: Norm,
    qkv: Affine,
    proj: Affine,
    fc1: Affine,
    fc2: Affine,
}

/// The loaded tower.
#[derive(Debug)]
pub struct VisionTower {
    cfg: VisionConfig,
    backend: BackendRef,
    patch: Affine,
    pos_embed: Vec<f32>,
    side: usize,
    blocks: Vec<Block>,
    merger_norm: Norm,
    merger_fc1: Affine,
    merger_fc2: Affine,
}

/// Per patch of one frame, in merge-block-major order: its (row, col) in the patch grid.
fn block_order(h: usize, w: usize, m: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(h * w);
    for bh in 0..h / m {
        for bw in 0..w / m {
            for ih in 0..m {
                for iw in 0..m {
                    out.push((bh * m + ih, bw * m + iw));
                }
            }
        }
    }
    out
}

/// Two taps and weights of `F.interpolate(bilinear, align_corners=True)` from `side` to `size` at `index`.
fn taps(index: usize, size: usize, side: usize) -> [(usize, f32); 2] {
    let src = index as f32 * (side - 1) as f32 / (size.max(2) - 1) as f32;
    let f = src.floor();
    let t = |o: f32| (((f + o) as usize).min(side - 1), (1.0 - (src - f - o).abs()).max(0.0));
    [t(0.0), t(1.0)]
}

impl VisionTower {
    /// Loads `model.visual.*` for the given `vision_config` JSON onto `backend`.
    pub fn load(backend: BackendRef, ck: &Checkpoint, vision_config: &serde_json::Value) -> Result<Self> {
        let be = backend.as_ref();
        let cfg: VisionConfig = serde_json::from_value(vision_config.clone())
            .map_err(|source| Error::Json { path: "config.json (vision_config)".into(), source })?;
        cfg.validate()?;
        let p = "model.visual";
        let (d, inter, ps, tp, c) =
            (cfg.hidden_size, cfg.intermediate_size, cfg.patch_size, cfg.temporal_patch_size, cfg.in_channels);
        let blocks = (0..cfg.depth)
            .map(|i| {
                let b = format!("{p}.blocks.{i}");
                Ok(Block {
                    norm1: Norm::load(be, ck, &format!("{b}.norm1"), d)?,
                    norm2: Norm::load(be, ck, &format!("{b}.norm2"), d)?,
                    qkv: Affine::load(be, ck, &format!("{b}.attn.qkv"), 3 * d, &[d])?,
                    proj: Affine::load(be, ck, &format!("{b}.attn.proj"), d, &[d])?,
                    fc1: Affine::load(be, ck, &format!("{b}.mlp.linear_fc1"), inter, &[d])?,
                    fc2: Affine::load(be, ck, &format!("{b}.mlp.linear_fc2"), d, &[inter])?,
                })
            })
            .collect::<Result<_>>()?;
        let merged = d * cfg.spatial_merge_size * cfg.spatial_merge_size;
        let side = (cfg.num_position_embeddings as f64).sqrt() as usize;
        Ok(VisionTower {
            patch: Affine::load(be, ck, &format!("{p}.patch_embed.proj"), d, &[c, tp, ps, ps])?,
            pos_embed: ck.weight(&format!("{p}.pos_embed.weight"), &[cfg.num_position_embeddings, d])?.to_f32(),
            side,
            blocks,
            backend: backend.clone(),
            merger_norm: Norm::load(be, ck, &format!("{p}.merger.norm"), d)?,
            merger_fc1: Affine::load(be, ck, &format!("{p}.merger.linear_fc1"), merged, &[merged])?,
            merger_fc2: Affine::load(be, ck, &format!("{p}.merger.linear_fc2"), cfg.out_hidden_size, &[merged])?,
            cfg,
        })
    }

    /// Loads the tower of a model directory onto `backend`; `None` for a text-only checkpoint.
    pub fn from_dir(dir: &std::path::Path, backend: BackendRef) -> Result<Option<Self>> {
        let cfg = crate::config::ModelConfig::from_dir(dir)?;
        let Some(v) = cfg.vision else { return Ok(None) };
        let ck = Checkpoint::open(dir)?;
        Self::load(backend, &ck, &v).map(Some)
    }

    /// The config.
    pub fn config(&self) -> &VisionConfig {
        &self.cfg
    }

    /// Encodes one image or video: `rows [t·h·w, C·T·P·P]` with `grid [t, h, w]` →
    /// `[t·h·w / merge², out_hidden_size]`, in placeholder order.
    pub fn encode(&self, rows: &[f32], grid: [usize; 3]) -> Result<Vec<f32>> {
        let c = &self.cfg;
        let [t, h, w] = grid;
        let m = c.spatial_merge_size;
        let (d, heads) = (c.hidden_size, c.num_heads);
        let hd = d / heads;
        let n = t * h * w;
        let row_len = self.patch.w.cols();
        if h % m != 0 || w % m != 0 || rows.len() != n * row_len || n == 0 {
            return Err(Error::InvalidInput(format!("pixel rows do not match grid {grid:?}")));
        }
        let be = self.backend.as_ref();
        // 1. Patch embedding + interpolated learned positions (the table resampled on the host for this
        //    grid, once per frame).
        let mut x = self.patch.forward(be, &be.upload_f32(rows, &[n, row_len])?)?;
        let order = block_order(h, w, m);
        let mut pos = vec![0f32; h * w * d];
        for (p, &(r, col)) in order.iter().enumerate() {
            let out = &mut pos[p * d..(p + 1) * d];
            for (th, wh) in taps(r, h, self.side) {
                for (tw, ww) in taps(col, w, self.side) {
                    let wt = wh * ww;
                    let src = &self.pos_embed[(th * self.side + tw) * d..(th * self.side + tw + 1) * d];
                    out.iter_mut().zip(src).for_each(|(o, s)| *o += s * wt);
                }
            }
        }
        be.add(&mut x, &be.upload_f32(&pos.repeat(t), &[n, d])?);
        // 2. 2-D rotary tables: the first hd/4 frequencies take the row, the next hd/4 the column.
        let quarter = hd / 4;
        let inv: Vec<f32> =
            (0..quarter).map(|j| 1.0 / (self.cfg.theta() as f32).powf((2 * j) as f32 / (hd / 2) as f32)).collect();
        let mut cos = vec![0f32; h * w * hd / 2];
        let mut sin = vec![0f32; h * w * hd / 2];
        for (p, &(r, col)) in order.iter().enumerate() {
            for j in 0..quarter {
                for (k, v) in [(j, r as f32 * inv[j]), (quarter + j, col as f32 * inv[j])] {
                    cos[p * hd / 2 + k] = v.cos();
                    sin[p * hd / 2 + k] = v.sin();
                }
            }
        }
        let (cos, sin) = (be.upload_f32(&cos.repeat(t), &[n, hd / 2])?, be.upload_f32(&sin.repeat(t), &[n, hd / 2])?);
        // 3. Blocks; attention sees only its own frame group (h·w rows).
        let shape = AttnShape { heads, kv_heads: heads, head_dim: hd };
        let group = h * w;
        for b in &self.blocks {
            let qkv = b.qkv.forward(be, &b.norm1.apply(be, &x))?;
            let mut parts = be.split_cols(&qkv, 1, &[d, d, d])?.into_iter();
            let (mut q, mut k, v) = (parts.next().expect("q"), parts.next().expect("k"), parts.next().expect("v"));
            be.rotate_half(&mut q, hd, &cos, &sin);
            be.rotate_half(&mut k, hd, &cos, &sin);
            let mut attn = be.zeros_f32(&[n, d])?;
            for g in 0..t {
                let rows = g * group..(g + 1) * group;
                be.attention_bidirectional(&q, &k, &v, rows, shape, (hd as f32).powf(-0.5), &mut attn);
            }
            be.add(&mut x, &b.proj.forward(be, &attn)?);
            let mut hmid = b.fc1.forward(be, &b.norm2.apply(be, &x))?;
            be.gelu(&mut hmid, true);
            be.add(&mut x, &b.fc2.forward(be, &hmid)?);
        }
        // 4. Merger: LayerNorm per patch, then each 2×2 block (4 consecutive rows) is one row of 4·d.
        let rows_out = n / (m * m);
        let merged = self.merger_norm.apply(be, &x).reshape(&[rows_out, d * m * m]);
        let mut y = self.merger_fc1.forward(be, &merged)?;
        be.gelu(&mut y, false);
        Ok(be.download_f32(&self.merger_fc2.forward(be, &y)?)?)
    }
}
