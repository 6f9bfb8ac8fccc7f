//! `osprey bench synth`: a synthetic checkpoint of a real model's layer geometry, written from Rust, so
//! the disk tier can be measured at real expert sizes without Python or real weights (the Python
//! generator stays the source of transformers fixtures).
//!
//! The checkpoint is a Hugging Face directory osprey loads like any other: `config.json` (a text-only
//! `qwen3_5_moe_text`, or `qwen4_exp_text` for Qwen3.8-Flash-Next's geometry, with ModelOpt NVFP4
//! `quantization_config`; with [`Options::vision_layers`], the multimodal `qwen3_5_moe` / `qwen4_exp`
//! wrapper with a vision tower of the real widths and `processor_config.json`), one safetensors shard
//! per layer plus one for the embedding and head (and one for the tower), and `model.safetensors.index.json`. Routed experts are NVFP4 (ModelOpt
//! layout: packed nibbles, e4m3 block scales, a global scale); everything else is bf16. Values are
//! seeded noise scaled by 1/sqrt(fan-in), so activations stay O(1) through the layers; a shard is built
//! in memory and written before the next, so memory stays at one layer's bytes.

use std::collections::BTreeMap;
use std::path::Path;

use safetensors::tensor::TensorView;
use safetensors::Dtype;
use serde::Serialize;

use crate::rng::Rng;
use serde_json::json;

/// A layer geometry to synthesise.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Geometry {
    /// Name for the report.
    pub name: &'static str,
    /// Residual width.
    pub hidden: usize,
    /// Attention query heads.
    pub heads: usize,
    /// Attention KV heads.
    pub kv_heads: usize,
    /// Attention head width.
    pub head_dim: usize,
    /// Gated DeltaNet key heads.
    pub linear_k_heads: usize,
    /// Gated DeltaNet value heads.
    pub linear_v_heads: usize,
    /// Gated DeltaNet head width.
    pub linear_dim: usize,
    /// Routed experts per layer.
    pub experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Routed expert width.
    pub expert_width: usize,
    /// Shared expert width.
    pub shared_width: usize,
    /// Vocabulary (embedding and head rows).
    pub vocab: usize,
    /// Qwen3.8-Flash-Next's additions (a `qwen4_exp` checkpoint), or none (`qwen3_5_moe`).
    pub flash: Option<Flash>,
    /// The vision tower's widths (written when [`Options::vision_layers`] is not zero).
    pub vision: Vision,
}

/// A vision tower's widths (its depth is [`Options::vision_layers`]).
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Vision {
    /// Tower width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Attention heads.
    pub heads: usize,
    /// Rows of the learned position grid (a square).
    pub positions: usize,
    /// Blocks of the real tower (the speed checkpoint cuts them as it cuts the decoder's layers).
    pub depth: usize,
}

/// Qwen3.5's vision tower (all sizes, and Qwen3.8-Flash-Next's): 27 blocks of width 1152, MLP 4304,
/// 16 heads, a 48×48 position grid; patch 16, temporal patch 2, 2×2 merge into the decoder's width.
pub const QWEN35_VISION: Vision = Vision { hidden: 1152, intermediate: 4304, heads: 16, positions: 2304, depth: 27 };

/// What a checkpoint holds beyond its decoder geometry.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Options {
    /// Vision blocks to write; 0 writes a text-only checkpoint.
    pub vision_layers: usize,
    /// `max_position_embeddings`.
    pub context: usize,
}

impl Default for Options {
    fn default() -> Self {
        Options { vision_layers: 0, context: 32768 }
    }
}

/// The embedded tokenizer's ids of the media tokens (the checkpoint is served with its files).
const IMAGE_TOKEN: u32 = 1004;
const VIDEO_TOKEN: u32 = 1005;
const VISION_START: u32 = 1001;
const VISION_END: u32 = 1002;
const IM_END: u32 = 994;
/// Tokens of the embedded tokenizer.
const TOKENIZER_TOKENS: usize = 1024;

/// What `qwen4_exp` adds to a Qwen3.5-MoE layer.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Flash {
    /// Hyper-connection streams.
    pub hc: usize,
    /// Rank of the hyper-connection mixers.
    pub hc_rank: usize,
    /// PLE embedding width (all heads together).
    pub ple_dim: usize,
    /// Hash heads per n-gram order (orders 2 and 3).
    pub ple_heads_per_order: usize,
    /// Rows per hash head are the primes above this (20 M in the real model).
    pub ple_vocab_base: u64,
    /// QSA indexer heads and width.
    pub indexer_heads: usize,
    /// Width of an indexer head.
    pub indexer_dim: usize,
}

/// Qwen3.5-35B-A3B's layer shapes (BENCHMARKS.md's q35moe-L4 uses them).
pub const QWEN35_35B_A3B: Geometry = Geometry {
    name: "qwen3.5-35b-a3b",
    hidden: 2048,
    heads: 16,
    kv_heads: 2,
    head_dim: 256,
    linear_k_heads: 16,
    linear_v_heads: 32,
    linear_dim: 128,
    experts: 256,
    top_k: 8,
    expert_width: 512,
    shared_width: 512,
    vocab: 32768,
    flash: None,
    vision: QWEN35_VISION,
};

/// Qwen3.8-Flash-Next's layer shapes (issue 15: hidden 2560, 512 experts top-10 of width 640, 4 streams
/// of rank 320, PLE 16 heads x 160). The PLE table is the one part cut (`--ple-vocab-base` picks its
/// rows; the real 20 M gives ~100 GB per PLE layer).
pub const QWEN38_FLASH_NEXT: Geometry = Geometry {
    name: "qwen3.8-flash-next",
    hidden: 2560,
    heads: 20,
    kv_heads: 2,
    head_dim: 256,
    linear_k_heads: 16,
    linear_v_heads: 32,
    linear_dim: 128,
    experts: 512,
    top_k: 10,
    expert_width: 640,
    shared_width: 640,
    vocab: 32768,
    flash: Some(Flash {
        hc: 4,
        hc_rank: 320,
        ple_dim: 2560,
        ple_heads_per_order: 8,
        ple_vocab_base: 100_000,
        indexer_heads: 16,
        indexer_dim: 128,
    }),
    vision: QWEN35_VISION,
};

/// A tiny geometry for tests.
pub const TINY: Geometry = Geometry {
    name: "tiny",
    hidden: 128,
    heads: 4,
    kv_heads: 2,
    head_dim: 64,
    linear_k_heads: 2,
    linear_v_heads: 4,
    linear_dim: 32,
    experts: 8,
    top_k: 2,
    expert_width: 64,
    shared_width: 64,
    vocab: 1024,
    flash: None,
    vision: Vision { hidden: 64, intermediate: 128, heads: 2, positions: 64, depth: 2 },
};

/// [`TINY`] as a `qwen4_exp` checkpoint, for tests.
pub const TINY_FLASH: Geometry = Geometry {
    name: "tiny-flash",
    flash: Some(Flash {
        hc: 4,
        hc_rank: 16,
        ple_dim: 64,
        ple_heads_per_order: 2,
        ple_vocab_base: 1000,
        indexer_heads: 2,
        indexer_dim: 32,
    }),
    ..TINY
};

/// Looks a geometry up by name.
pub fn geometry(name: &str) -> Option<Geometry> {
    [QWEN35_35B_A3B, QWEN38_FLASH_NEXT, TINY, TINY_FLASH].into_iter().find(|g| g.name == name)
}

/// What was written.
#[derive(Clone, Debug, Serialize)]
pub struct SynthReport {
    /// The geometry written.
    pub geometry: Geometry,
    /// Decoder layers.
    pub layers: usize,
    /// What else it holds.
    pub options: Options,
    /// Bytes of all routed experts (NVFP4 with their scales).
    pub expert_bytes: u64,
    /// Bytes written in all.
    pub total_bytes: u64,
    /// Seconds it took.
    pub secs: f64,
}

type Tensors = Vec<(String, Dtype, Vec<usize>, Vec<u8>)>;

fn bf16(rng: &mut Rng, shape: &[usize], scale: f32, base: f32) -> Vec<u8> {
    let n: usize = shape.iter().product();
    (0..n).flat_map(|_| half::bf16::from_f32(base + scale * rng.normal()).to_le_bytes()).collect()
}

fn dense(t: &mut Tensors, rng: &mut Rng, name: String, out: usize, inp: usize) {
    let w = bf16(rng, &[out, inp], 1.0 / (inp as f32).sqrt(), 0.0);
    t.push((name, Dtype::BF16, vec![out, inp], w));
}

fn vector(t: &mut Tensors, rng: &mut Rng, name: String, n: usize, base: f32) {
    t.push((name, Dtype::BF16, vec![n], bf16(rng, &[n], 0.1, base)));
}

/// An NVFP4 linear in ModelOpt's layout: random codes, block scales near 1/(2·sqrt(fan-in)) so the
/// dequantised weights are O(1/sqrt(fan-in)) like the dense ones.
fn nvfp4(t: &mut Tensors, rng: &mut Rng, prefix: &str, out: usize, inp: usize) -> u64 {
    let packed: Vec<u8> = (0..out * inp / 2).map(|_| rng.next() as u8).collect();
    let scale = e4m3_code(0.5 / (inp as f32).sqrt() * 4.0);
    let scales: Vec<u8> = vec![scale; out * inp / 16];
    let bytes = (packed.len() + scales.len()) as u64;
    t.push((format!("{prefix}.weight"), Dtype::U8, vec![out, inp / 2], packed));
    t.push((format!("{prefix}.weight_scale"), Dtype::F8_E4M3, vec![out, inp / 16], scales));
    t.push((format!("{prefix}.weight_scale_2"), Dtype::F32, vec![], 0.25f32.to_le_bytes().to_vec()));
    t.push((format!("{prefix}.input_scale"), Dtype::F32, vec![], 1.0f32.to_le_bytes().to_vec()));
    bytes
}

/// e4m3 code of a positive value (round to nearest on the 3-bit mantissa; enough for a scale).
fn e4m3_code(v: f32) -> u8 {
    let e = v.log2().floor() as i32;
    let m = ((v / 2f32.powi(e) - 1.0) * 8.0).round() as i32;
    let (e, m) = if m == 8 { (e + 1, 0) } else { (e, m) };
    (((e + 7).clamp(1, 15) as u8) << 3) | (m.clamp(0, 7) as u8)
}

/// A hyper-connection's mixers (and its injection, but for the final mixer).
fn hyper_connection(t: &mut Tensors, rng: &mut Rng, p: &str, h: usize, f: Flash, inject: bool) {
    let wide = f.hc * h;
    vector(t, rng, format!("{p}.hc_norm.weight"), wide, 0.0);
    dense(t, rng, format!("{p}.input_mix_weight_down.weight"), f.hc_rank, wide);
    dense(t, rng, format!("{p}.input_mix_weight_up.weight"), wide, f.hc_rank);
    if inject {
        dense(t, rng, format!("{p}.block_inject_weight.weight"), f.hc, wide);
    }
}

/// One PLE layer: its table (one tensor), projections, norms and conv.
fn ple(t: &mut Tensors, rng: &mut Rng, p: &str, h: usize, f: Flash, index: usize) {
    let wide = f.hc * h;
    let head = f.ple_dim / (2 * f.ple_heads_per_order);
    let rows = osprey_models::ple_table_rows(f.ple_vocab_base, 2 * f.ple_heads_per_order, index, 128) as usize;
    t.push((
        format!("{p}.ple_embedding.ngram_embedding.weight"),
        Dtype::BF16,
        vec![rows, head],
        bf16(rng, &[rows, head], 1.0, 0.0),
    ));
    dense(t, rng, format!("{p}.key_proj.weight"), wide, f.ple_dim);
    dense(t, rng, format!("{p}.value_proj.weight"), h, f.ple_dim);
    for n in ["norm_key", "norm_query", "norm_conv"] {
        vector(t, rng, format!("{p}.{n}.weight"), wide, 0.0);
    }
    t.push((format!("{p}.conv1d.weight"), Dtype::BF16, vec![wide, 1, 4], bf16(rng, &[wide, 4], 0.3, 0.0)));
}

/// mRoPE sections over the `head_dim / 8` rotary frequencies (a quarter of the head rotates): Qwen3.5's
/// `[11, 11, 10]` at head_dim 256, the same proportions otherwise.
fn sections(head_dim: usize) -> [usize; 3] {
    let half = head_dim / 8;
    if half == 32 {
        [11, 11, 10]
    } else {
        [half - 2 * (half / 3), half / 3, half / 3]
    }
}

fn write(dir: &Path, file: &str, t: &Tensors, index: &mut BTreeMap<String, String>) -> std::io::Result<u64> {
    let views: Vec<(String, TensorView<'_>)> = t
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).expect("shape and bytes agree")))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join(file)).map_err(std::io::Error::other)?;
    for (n, ..) in t {
        index.insert(n.clone(), file.to_string());
    }
    Ok(t.iter().map(|(.., b)| b.len() as u64).sum())
}

/// Writes `layers` layers of geometry `g` (every fourth a full-attention layer, the others Gated
/// DeltaNet, as Qwen3.5; with `g.flash`, a `qwen4_exp` checkpoint: hyper-connections, PLE on every
/// fourth layer from the first, QSA indexers) into `dir`, text only.
pub fn synth(dir: &Path, g: Geometry, layers: usize, seed: u64) -> std::io::Result<SynthReport> {
    synth_with(dir, g, layers, seed, Options::default())
}

/// [`synth`] with a vision tower and a context length of choice.
pub fn synth_with(dir: &Path, g: Geometry, layers: usize, seed: u64, o: Options) -> std::io::Result<SynthReport> {
    let t0 = std::time::Instant::now();
    std::fs::create_dir_all(dir)?;
    let mut rng = Rng(seed);
    let mut index = BTreeMap::new();
    let (mut expert_bytes, mut total) = (0u64, 0u64);
    let h = g.hidden;
    // The multimodal layout nests the decoder under `language_model` (REFERENCE.md section 1).
    let tp = if o.vision_layers > 0 { "model.language_model" } else { "model" };
    let types: Vec<&str> =
        (0..layers).map(|i| if (i + 1) % 4 == 0 { "full_attention" } else { "linear_attention" }).collect();
    for (i, kind) in types.iter().enumerate() {
        let mut t: Tensors = Vec::new();
        let p = format!("{tp}.layers.{i}");
        match g.flash {
            None => {
                vector(&mut t, &mut rng, format!("{p}.input_layernorm.weight"), h, 0.0);
                vector(&mut t, &mut rng, format!("{p}.post_attention_layernorm.weight"), h, 0.0);
            }
            Some(f) => {
                for hcp in ["attn_hyper_connection", "mlp_hyper_connection"] {
                    hyper_connection(&mut t, &mut rng, &format!("{p}.{hcp}"), h, f, true);
                }
                // PLE on the first layer of every 4 (a linear layer), as the real config spreads it.
                if i % 4 == 0 {
                    ple(&mut t, &mut rng, &format!("{p}.ple"), h, f, i / 4);
                }
            }
        }
        attention(&mut t, &mut rng, &p, kind, &g);
        let m = format!("{p}.mlp");
        dense(&mut t, &mut rng, format!("{m}.gate.weight"), g.experts, h);
        dense(&mut t, &mut rng, format!("{m}.shared_expert_gate.weight"), 1, h);
        for n in ["gate_proj", "up_proj"] {
            dense(&mut t, &mut rng, format!("{m}.shared_expert.{n}.weight"), g.shared_width, h);
        }
        dense(&mut t, &mut rng, format!("{m}.shared_expert.down_proj.weight"), h, g.shared_width);
        for e in 0..g.experts {
            let ep = format!("{m}.experts.{e}");
            expert_bytes += nvfp4(&mut t, &mut rng, &format!("{ep}.gate_proj"), g.expert_width, h);
            expert_bytes += nvfp4(&mut t, &mut rng, &format!("{ep}.up_proj"), g.expert_width, h);
            expert_bytes += nvfp4(&mut t, &mut rng, &format!("{ep}.down_proj"), h, g.expert_width);
        }
        total += write(dir, &format!("model-layer-{i:03}.safetensors"), &t, &mut index)?;
    }
    let mut t: Tensors = Vec::new();
    t.push((
        format!("{tp}.embed_tokens.weight"),
        Dtype::BF16,
        vec![g.vocab, h],
        bf16(&mut rng, &[g.vocab, h], 1.0, 0.0),
    ));
    match g.flash {
        None => vector(&mut t, &mut rng, format!("{tp}.norm.weight"), h, 0.0),
        Some(f) => hyper_connection(&mut t, &mut rng, &format!("{tp}.hyper_connection_mixer"), h, f, false),
    }
    // Rows past the embedded tokenizer's tokens are zero: their logits are 0 where the others spread
    // about it, so a greedy answer is made of tokens the tokenizer can show (a token it has no text for
    // streams nothing, and a benchmark would see no first token). They are read at full cost all the same.
    let mut head = bf16(&mut rng, &[g.vocab, h], 1.0 / (h as f32).sqrt(), 0.0);
    head[TOKENIZER_TOKENS.min(g.vocab) * h * 2..].fill(0);
    t.push(("lm_head.weight".into(), Dtype::BF16, vec![g.vocab, h], head));
    total += write(dir, "model-embed.safetensors", &t, &mut index)?;
    if o.vision_layers > 0 {
        let t = tower(&mut rng, g.vision, o.vision_layers, h);
        total += write(dir, "model-visual.safetensors", &t, &mut index)?;
        let pc = processor_config();
        std::fs::write(dir.join("processor_config.json"), serde_json::to_string_pretty(&pc)?)?;
    }
    let cfg = config(&g, layers, &types, o);
    std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&cfg)?)?;
    let idx = json!({"metadata": {"total_size": total}, "weight_map": index});
    std::fs::write(dir.join("model.safetensors.index.json"), serde_json::to_string_pretty(&idx)?)?;
    Ok(SynthReport {
        geometry: g,
        layers,
        options: o,
        expert_bytes,
        total_bytes: total,
        secs: t0.elapsed().as_secs_f64(),
    })
}

/// A linear with its bias (the vision tower's layers all have one).
fn affine(t: &mut Tensors, rng: &mut Rng, p: &str, out: usize, inp: usize) {
    dense(t, rng, format!("{p}.weight"), out, inp);
    vector(t, rng, format!("{p}.bias"), out, 0.0);
}

/// A LayerNorm: weight near 1, bias near 0.
fn layer_norm(t: &mut Tensors, rng: &mut Rng, p: &str, d: usize) {
    vector(t, rng, format!("{p}.weight"), d, 1.0);
    vector(t, rng, format!("{p}.bias"), d, 0.0);
}

/// `model.visual.*`: the patch embedding (a Conv3d over 3 channels × 2 frames × 16 × 16), the learned
/// position grid, `depth` pre-norm blocks, and the merger (LayerNorm, 2×2 merge, MLP into `out` wide rows).
fn tower(rng: &mut Rng, v: Vision, depth: usize, out: usize) -> Tensors {
    let (d, p) = (v.hidden, "model.visual");
    let mut t: Tensors = Vec::new();
    let shape = vec![d, 3, 2, 16, 16];
    let w = bf16(rng, &shape, 1.0 / (3.0f32 * 2.0 * 256.0).sqrt(), 0.0);
    t.push((format!("{p}.patch_embed.proj.weight"), Dtype::BF16, shape, w));
    vector(&mut t, rng, format!("{p}.patch_embed.proj.bias"), d, 0.0);
    let pos = bf16(rng, &[v.positions, d], 0.1, 0.0);
    t.push((format!("{p}.pos_embed.weight"), Dtype::BF16, vec![v.positions, d], pos));
    for i in 0..depth {
        let b = format!("{p}.blocks.{i}");
        layer_norm(&mut t, rng, &format!("{b}.norm1"), d);
        layer_norm(&mut t, rng, &format!("{b}.norm2"), d);
        affine(&mut t, rng, &format!("{b}.attn.qkv"), 3 * d, d);
        affine(&mut t, rng, &format!("{b}.attn.proj"), d, d);
        affine(&mut t, rng, &format!("{b}.mlp.linear_fc1"), v.intermediate, d);
        affine(&mut t, rng, &format!("{b}.mlp.linear_fc2"), d, v.intermediate);
    }
    layer_norm(&mut t, rng, &format!("{p}.merger.norm"), d);
    affine(&mut t, rng, &format!("{p}.merger.linear_fc1"), 4 * d, 4 * d);
    affine(&mut t, rng, &format!("{p}.merger.linear_fc2"), out, 4 * d);
    t
}

/// Qwen3.5's preprocessing (REFERENCE.md section 3): images resized to between 65,536 and 16,777,216
/// pixels, videos sampled at 2 fps (4 to 768 frames) within 25,165,824 pixels, mean and std 0.5.
fn processor_config() -> serde_json::Value {
    let common = json!({"do_convert_rgb": true, "do_normalize": true, "do_rescale": true, "do_resize": true,
        "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], "merge_size": 2, "patch_size": 16,
        "resample": 3, "rescale_factor": 1.0 / 255.0, "temporal_patch_size": 2});
    let mut image = common.clone();
    let mut video = common;
    if let (Some(i), Some(v)) = (image.as_object_mut(), video.as_object_mut()) {
        i.insert("image_processor_type".into(), json!("Qwen2VLImageProcessor"));
        i.insert("size".into(), json!({"shortest_edge": 65536, "longest_edge": 16777216}));
        v.insert("video_processor_type".into(), json!("Qwen3VLVideoProcessor"));
        v.insert("size".into(), json!({"shortest_edge": 4096, "longest_edge": 25165824}));
        for (k, x) in [("fps", json!(2)), ("min_frames", json!(4)), ("max_frames", json!(768))] {
            v.insert(k.into(), x);
        }
        v.insert("do_sample_frames".into(), json!(true));
        v.insert("cap_pixels_per_frame".into(), json!(false));
    }
    json!({"processor_class": "Qwen3VLProcessor", "image_processor": image, "video_processor": video})
}

/// A layer's attention: Gated DeltaNet (`linear_attention`) or gated full attention (with the flash
/// geometry's indexer).
fn attention(t: &mut Tensors, rng: &mut Rng, p: &str, kind: &str, g: &Geometry) {
    let h = g.hidden;
    if kind == "linear_attention" {
        let (kd, vd) = (g.linear_k_heads * g.linear_dim, g.linear_v_heads * g.linear_dim);
        let conv = 2 * kd + vd;
        let a = format!("{p}.linear_attn");
        dense(t, rng, format!("{a}.in_proj_qkv.weight"), conv, h);
        dense(t, rng, format!("{a}.in_proj_z.weight"), vd, h);
        dense(t, rng, format!("{a}.in_proj_a.weight"), g.linear_v_heads, h);
        dense(t, rng, format!("{a}.in_proj_b.weight"), g.linear_v_heads, h);
        dense(t, rng, format!("{a}.out_proj.weight"), h, vd);
        t.push((format!("{a}.conv1d.weight"), Dtype::BF16, vec![conv, 1, 4], bf16(rng, &[conv, 4], 0.5, 0.0)));
        vector(t, rng, format!("{a}.A_log"), g.linear_v_heads, 1.0);
        vector(t, rng, format!("{a}.dt_bias"), g.linear_v_heads, 1.0);
        vector(t, rng, format!("{a}.norm.weight"), g.linear_dim, 1.0);
    } else {
        let a = format!("{p}.self_attn");
        dense(t, rng, format!("{a}.q_proj.weight"), 2 * g.heads * g.head_dim, h);
        dense(t, rng, format!("{a}.k_proj.weight"), g.kv_heads * g.head_dim, h);
        dense(t, rng, format!("{a}.v_proj.weight"), g.kv_heads * g.head_dim, h);
        dense(t, rng, format!("{a}.o_proj.weight"), h, g.heads * g.head_dim);
        vector(t, rng, format!("{a}.q_norm.weight"), g.head_dim, 0.0);
        vector(t, rng, format!("{a}.k_norm.weight"), g.head_dim, 0.0);
        if let Some(f) = g.flash {
            let ix = format!("{a}.indexer");
            dense(t, rng, format!("{ix}.index_qk_proj.weight"), (f.indexer_heads + 1) * f.indexer_dim, h);
            vector(t, rng, format!("{ix}.q_layernorm.weight"), f.indexer_dim, 0.0);
            vector(t, rng, format!("{ix}.k_layernorm.weight"), f.indexer_dim, 0.0);
        }
    }
}

/// The checkpoint's `config.json`: the model's shapes, its layer types and the NVFP4 quantization of
/// its experts (the `qwen4_exp` fields with the flash geometry); with a tower, the multimodal wrapper.
fn config(g: &Geometry, layers: usize, types: &[&str], o: Options) -> serde_json::Value {
    let h = g.hidden;
    let mut exclude =
        vec!["lm_head", "*embed_tokens*", "*self_attn*", "*linear_attn*", "*shared_expert*", "*.mlp.gate"];
    if g.flash.is_some() {
        exclude.extend(["*hyper_connection*", "*.ple.*", "*indexer*"]);
    }
    if o.vision_layers > 0 {
        exclude.push("*visual*");
    }
    let qc = json!({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": exclude});
    let mut cfg = json!({
        "architectures": ["Qwen3_5MoeForCausalLM"], "model_type": "qwen3_5_moe_text",
        "vocab_size": g.vocab, "hidden_size": h, "num_hidden_layers": layers, "layer_types": types,
        "num_attention_heads": g.heads, "num_key_value_heads": g.kv_heads, "head_dim": g.head_dim,
        "linear_num_key_heads": g.linear_k_heads, "linear_num_value_heads": g.linear_v_heads,
        "linear_key_head_dim": g.linear_dim, "linear_value_head_dim": g.linear_dim, "linear_conv_kernel_dim": 4,
        "num_experts": g.experts, "num_experts_per_tok": g.top_k, "moe_intermediate_size": g.expert_width,
        "shared_expert_intermediate_size": g.shared_width, "hidden_act": "silu", "rms_norm_eps": 1e-6,
        "max_position_embeddings": o.context, "tie_word_embeddings": false,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                            "mrope_section": sections(g.head_dim), "mrope_interleaved": true},
        "quantization_config": qc.clone(),
    });
    if let Some(f) = g.flash {
        let kinds: Vec<&str> =
            types.iter().map(|k| if *k == "full_attention" { "indexed_attention" } else { k }).collect();
        let ple_ids: Vec<usize> = (0..layers).filter(|i| i % 4 == 0).map(|i| i + 1).collect();
        let extra = json!({
            "architectures": ["Qwen4ExpForCausalLM"], "model_type": "qwen4_exp_text", "layer_types": kinds,
            "hc_count": f.hc, "hc_lowrank": f.hc_rank, "ple_layer_ids": ple_ids, "ple_embed_dim": f.ple_dim,
            "ple_conv_kernel_size": 4, "ngram_size": 3, "heads_per_ngram": f.ple_heads_per_order,
            "ngram_vocab_size_base": f.ple_vocab_base, "make_ngram_vocab_size_divisible_by": 128, "seed": 1234,
            "indexer_n_heads": f.indexer_heads, "indexer_kv_heads": 1, "indexer_head_dim": f.indexer_dim,
            "indexer_budget": 2048, "indexer_compress_ratio": 64, "output_gate_type": "silu",
            "norm_topk_prob": true, "eos_token_id": 0,
        });
        if let (Some(c), Some(e)) = (cfg.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
    }
    if o.vision_layers == 0 {
        return cfg;
    }
    multimodal(cfg, g, o.vision_layers, qc)
}

/// The multimodal wrapper around a text config: `qwen3_5_moe` (or `qwen4_exp`) with the text config,
/// the tower's config and the media token ids of the embedded tokenizer.
fn multimodal(mut text: serde_json::Value, g: &Geometry, depth: usize, qc: serde_json::Value) -> serde_json::Value {
    let (model_type, arch) = if g.flash.is_some() {
        ("qwen4_exp", "Qwen4ExpForConditionalGeneration")
    } else {
        ("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration")
    };
    if let Some(t) = text.as_object_mut() {
        t.remove("quantization_config");
        t.remove("architectures");
        t.insert("eos_token_id".into(), json!(IM_END));
    }
    let v = g.vision;
    json!({
        "architectures": [arch], "model_type": model_type, "tie_word_embeddings": false,
        "image_token_id": IMAGE_TOKEN, "video_token_id": VIDEO_TOKEN,
        "vision_start_token_id": VISION_START, "vision_end_token_id": VISION_END,
        "text_config": text,
        "vision_config": {"depth": depth, "hidden_size": v.hidden, "intermediate_size": v.intermediate,
            "num_heads": v.heads, "num_position_embeddings": v.positions, "out_hidden_size": g.hidden,
            "patch_size": 16, "temporal_patch_size": 2, "spatial_merge_size": 2, "in_channels": 3,
            "hidden_act": "gelu_pytorch_tanh", "model_type": format!("{model_type}_vision")},
        "quantization_config": qc,
    })
}
