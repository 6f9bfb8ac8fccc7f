//! `config.json` structs with the Hugging Face field names (`qwen3_5`, `qwen3_5_moe` and their `_text`
//! variants). Unknown keys are tolerated (real configs carry keys transformers ignores, such as
//! `attn_output_gate` or `mtp_num_hidden_layers`); unsupported values are rejected by
//! [`TextConfig::validate`] at load, never in the forward.

use std::path::Path;

use serde::Deserialize;

use crate::error::{Error, Result};

/// The whole `config.json`: a multimodal wrapper (`text_config` + `vision_config`) or a bare text config.
#[derive(Clone, Debug)]
pub struct ModelConfig {
    /// `model_type` at the top level (`qwen3_5`, `qwen3_5_moe`, `qwen3_5_moe_text`, ...).
    pub model_type: String,
    /// `architectures` (the registry's second key).
    pub architectures: Vec<String>,
    /// The decoder's config.
    pub text: TextConfig,
    /// The vision tower's config, kept raw until the vision tower reads it.
    pub vision: Option<serde_json::Value>,
    /// Special token ids the multimodal wrapper declares.
    pub media_tokens: MediaTokens,
    /// The checkpoint declares a quantization (`quantization_config`, or `hf_quant_config.json`):
    /// its linears may be NVFP4.
    pub quantized: bool,
}

/// Token ids of the media placeholders (multimodal checkpoints only).
#[derive(Clone, Debug, Default, Deserialize)]
pub struct MediaTokens {
    /// `<|image_pad|>`.
    pub image_token_id: Option<u32>,
    /// `<|video_pad|>`.
    pub video_token_id: Option<u32>,
    /// `<|vision_start|>`.
    pub vision_start_token_id: Option<u32>,
    /// `<|vision_end|>`.
    pub vision_end_token_id: Option<u32>,
}

/// Rotary parameters (`rope_parameters` in transformers 5; older configs spread them over the top level).
#[derive(Clone, Debug, Deserialize)]
pub struct RopeParameters {
    /// Only `default` is used by Qwen3.5.
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
    /// Base θ.
    pub rope_theta: f64,
    /// Fraction of head_dim that is rotated.
    #[serde(default = "default_partial_rotary")]
    pub partial_rotary_factor: f64,
    /// Frequencies per axis (T, H, W); they sum to `rot_dim / 2`.
    #[serde(default = "default_mrope_section")]
    pub mrope_section: Vec<usize>,
}

fn default_rope_type() -> String {
    "default".into()
}
fn default_partial_rotary() -> f64 {
    0.25
}
fn default_mrope_section() -> Vec<usize> {
    vec![11, 11, 10]
}
fn default_kernel() -> usize {
    4
}
fn default_eps() -> f64 {
    1e-6
}
fn default_act() -> String {
    "silu".into()
}

/// `eos_token_id` is an int or a list of ints.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum TokenIds {
    /// One id.
    One(u32),
    /// Several ids.
    Many(Vec<u32>),
}

impl TokenIds {
    /// All ids as a list.
    pub fn to_vec(&self) -> Vec<u32> {
        match self {
            TokenIds::One(i) => vec![*i],
            TokenIds::Many(v) => v.clone(),
        }
    }
}

/// The decoder's config (`qwen3_5_text` / `qwen3_5_moe_text`).
#[derive(Clone, Debug, Deserialize)]
pub struct TextConfig {
    /// Model type string, used to choose dense vs MoE.
    #[serde(default)]
    pub model_type: String,
    /// Vocabulary rows of the embedding and lm_head.
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// Decoder layers.
    pub num_hidden_layers: usize,
    /// Full-attention query heads.
    pub num_attention_heads: usize,
    /// Full-attention KV heads.
    pub num_key_value_heads: usize,
    /// Full-attention head dim (defaults to hidden/heads).
    pub head_dim: Option<usize>,
    /// MLP activation; only `silu` is implemented.
    #[serde(default = "default_act")]
    pub hidden_act: String,
    /// Context length the model was trained for.
    #[serde(default)]
    pub max_position_embeddings: usize,
    /// RMSNorm epsilon.
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    /// lm_head shares the embedding matrix.
    #[serde(default)]
    pub tie_word_embeddings: bool,
    /// Layers of the multi-token-prediction head (`mtp.*`; 0: none). Loaded only for speculative decoding.
    #[serde(default)]
    pub mtp_num_hidden_layers: usize,
    /// Rotary parameters (transformers 5 layout).
    pub rope_parameters: Option<RopeParameters>,
    /// Legacy top-level θ.
    pub rope_theta: Option<f64>,
    /// Legacy top-level partial rotary factor.
    pub partial_rotary_factor: Option<f64>,
    /// Legacy `rope_scaling` (holds `mrope_section`).
    pub rope_scaling: Option<serde_json::Value>,
    /// q/k/v/o biases (Qwen3.5 has none; rejected if set).
    #[serde(default)]
    pub attention_bias: bool,
    /// Per layer: `linear_attention` or `full_attention`.
    pub layer_types: Option<Vec<String>>,
    /// Used when `layer_types` is absent: every n-th layer is full attention.
    pub full_attention_interval: Option<usize>,
    /// Gated DeltaNet conv kernel width.
    #[serde(default = "default_kernel")]
    pub linear_conv_kernel_dim: usize,
    /// Gated DeltaNet key head dim.
    #[serde(default)]
    pub linear_key_head_dim: usize,
    /// Gated DeltaNet value head dim.
    #[serde(default)]
    pub linear_value_head_dim: usize,
    /// Gated DeltaNet key heads.
    #[serde(default)]
    pub linear_num_key_heads: usize,
    /// Gated DeltaNet value heads.
    #[serde(default)]
    pub linear_num_value_heads: usize,
    /// Dense MLP width (`qwen3_5`).
    pub intermediate_size: Option<usize>,
    /// Routed experts (`qwen3_5_moe`).
    pub num_experts: Option<usize>,
    /// Experts per token.
    pub num_experts_per_tok: Option<usize>,
    /// Routed expert width.
    pub moe_intermediate_size: Option<usize>,
    /// Shared expert width.
    pub shared_expert_intermediate_size: Option<usize>,
    /// End-of-sequence token(s).
    pub eos_token_id: Option<TokenIds>,
    /// Padding token.
    pub pad_token_id: Option<u32>,
    /// Every other field, for a family that reads fields of its own (`qwen4_exp`'s hyper-connections,
    /// PLE and QSA).
    #[serde(flatten)]
    pub extra: serde_json::Map<String, serde_json::Value>,
}

/// The two token mixers of the hybrid stack.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LayerKind {
    /// Gated DeltaNet.
    Linear,
    /// Gated full attention.
    Full,
    /// Gated attention behind a QSA indexer (`qwen4_exp`).
    Indexed,
}

/// MoE geometry.
#[derive(Clone, Copy, Debug)]
pub struct MoeConfig {
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Experts per token.
    pub top_k: usize,
    /// Routed expert width.
    pub intermediate: usize,
    /// Shared expert width.
    pub shared_intermediate: usize,
    /// The kept experts' weights are renormalised to sum to one (Qwen3.5 always; `qwen4_exp` per its
    /// `norm_topk_prob`).
    pub renorm: bool,
}

impl TextConfig {
    /// Full-attention head dim.
    pub fn head_dim(&self) -> usize {
        self.head_dim.unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    /// Rotary parameters, from `rope_parameters` or the legacy top-level fields.
    pub fn rope(&self) -> Result<RopeParameters> {
        if let Some(r) = &self.rope_parameters {
            return Ok(r.clone());
        }
        let theta = self.rope_theta.ok_or_else(|| Error::Unsupported("config has no rope_parameters".into()))?;
        let section = self
            .rope_scaling
            .as_ref()
            .and_then(|s| s.get("mrope_section"))
            .and_then(|s| serde_json::from_value(s.clone()).ok())
            .unwrap_or_else(default_mrope_section);
        Ok(RopeParameters {
            rope_type: default_rope_type(),
            rope_theta: theta,
            partial_rotary_factor: self.partial_rotary_factor.unwrap_or_else(default_partial_rotary),
            mrope_section: section,
        })
    }

    /// Layer kinds, from `layer_types` or the `full_attention_interval` rule transformers applies.
    pub fn layer_kinds(&self) -> Result<Vec<LayerKind>> {
        let types = match &self.layer_types {
            Some(t) => t.clone(),
            None => {
                let every = self.full_attention_interval.unwrap_or(4);
                (0..self.num_hidden_layers)
                    .map(|i| if (i + 1) % every == 0 { "full_attention" } else { "linear_attention" }.to_string())
                    .collect()
            }
        };
        if types.len() != self.num_hidden_layers {
            return Err(Error::Unsupported(format!(
                "layer_types has {} entries for {} layers",
                types.len(),
                self.num_hidden_layers
            )));
        }
        types
            .iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                "linear_attention" => Ok(LayerKind::Linear),
                "full_attention" => Ok(LayerKind::Full),
                "indexed_attention" => Ok(LayerKind::Indexed),
                other => Err(Error::Unsupported(format!(
                    "layer {i} has layer type {other:?}, which osprey does not implement"
                ))),
            })
            .collect()
    }

    /// MoE geometry, or `None` for the dense model.
    pub fn moe(&self) -> Result<Option<MoeConfig>> {
        let is_moe = self.model_type.contains("moe") || self.num_experts.is_some();
        if !is_moe {
            return Ok(None);
        }
        let need =
            |v: Option<usize>, name: &str| v.ok_or_else(|| Error::Unsupported(format!("MoE config lacks {name}")));
        let m = MoeConfig {
            num_experts: need(self.num_experts, "num_experts")?,
            top_k: need(self.num_experts_per_tok, "num_experts_per_tok")?,
            intermediate: need(self.moe_intermediate_size, "moe_intermediate_size")?,
            shared_intermediate: need(self.shared_expert_intermediate_size, "shared_expert_intermediate_size")?,
            renorm: true,
        };
        if m.top_k == 0 || m.top_k > m.num_experts {
            return Err(Error::Unsupported(format!("num_experts_per_tok {} with {} experts", m.top_k, m.num_experts)));
        }
        Ok(Some(m))
    }

    /// Rejects what the runtime does not implement, with a message naming the field.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Unsupported(m));
        if self.hidden_act != "silu" {
            return bad(format!("hidden_act {:?} (only silu)", self.hidden_act));
        }
        if self.attention_bias {
            return bad("attention_bias = true".into());
        }
        if self.num_attention_heads == 0
            || self.num_key_value_heads == 0
            || !self.num_attention_heads.is_multiple_of(self.num_key_value_heads)
        {
            return bad(format!(
                "{} attention heads with {} KV heads",
                self.num_attention_heads, self.num_key_value_heads
            ));
        }
        let rope = self.rope()?;
        if rope.rope_type != "default" {
            return bad(format!("rope_type {:?}", rope.rope_type));
        }
        let rot = self.rot_dim();
        if !rot.is_multiple_of(2)
            || rot > self.head_dim()
            || rope.mrope_section.len() != 3
            || rope.mrope_section.iter().sum::<usize>() != rot / 2
        {
            return bad(format!(
                "mrope_section {:?} does not cover {} rotary frequencies",
                rope.mrope_section,
                rot / 2
            ));
        }
        let kinds = self.layer_kinds()?;
        if kinds.contains(&LayerKind::Linear) {
            let (nk, nv) = (self.linear_num_key_heads, self.linear_num_value_heads);
            if nk == 0 || nv == 0 || nv % nk != 0 || self.linear_key_head_dim == 0 || self.linear_value_head_dim == 0 {
                return bad(format!("linear attention with {nk} key heads and {nv} value heads"));
            }
            if self.linear_conv_kernel_dim < 1 {
                return bad("linear_conv_kernel_dim 0".into());
            }
        }
        if self.moe()?.is_none() && self.intermediate_size.is_none() {
            return bad("dense config lacks intermediate_size".into());
        }
        Ok(())
    }

    /// Rotated dims per head.
    pub fn rot_dim(&self) -> usize {
        let f = self.rope().map(|r| r.partial_rotary_factor).unwrap_or(1.0);
        (self.head_dim() as f64 * f) as usize
    }
}

/// Accepts the quantisation configs the loader implements: ModelOpt NVFP4 (group 16) and
/// compressed-tensors `nvfp4-pack-quantized`. Which tensors are quantised is read per tensor at load
/// (`Checkpoint::linear`), so `exclude_modules` / `ignore` lists need no interpretation: excluded
/// modules are simply stored dense.
pub fn check_quantization(q: &serde_json::Value) -> Result<()> {
    let s = |k: &str| q.get(k).and_then(|v| v.as_str()).unwrap_or_default().to_string();
    let algo = if q.get("quantization").is_some() {
        q["quantization"]["quant_algo"].as_str().unwrap_or_default().to_string()
    } else {
        s("quant_algo")
    };
    let group = q
        .get("group_size")
        .or_else(|| q.get("quantization").and_then(|x| x.get("group_size")))
        .and_then(|g| g.as_u64());
    match s("quant_method").as_str() {
        "compressed-tensors" => {
            if s("format") != "nvfp4-pack-quantized" {
                return Err(Error::Unsupported(format!(
                    "compressed-tensors format {:?} (only nvfp4-pack-quantized)",
                    s("format")
                )));
            }
        }
        _ => {
            if algo != "NVFP4" {
                return Err(Error::Unsupported(format!("quant_algo {algo:?} (only NVFP4)")));
            }
            if group.is_some_and(|g| g != 16) {
                return Err(Error::Unsupported(format!("NVFP4 group_size {group:?} (only 16)")));
            }
        }
    }
    Ok(())
}

impl ModelConfig {
    /// Reads and validates `dir/config.json` (and `hf_quant_config.json` when present).
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = crate::files::read_small(&path, crate::files::MAX_CONFIG_BYTES)
            .map_err(|source| Error::Io { path: path.clone(), source })?;
        let cfg = Self::from_json(&text).map_err(|e| match e {
            Error::Json { source, .. } => Error::Json { path, source },
            other => other,
        })?;
        let mut cfg = cfg;
        let hq = dir.join("hf_quant_config.json");
        if let Ok(t) = crate::files::read_small(&hq, crate::files::MAX_CONFIG_BYTES) {
            let v: serde_json::Value = serde_json::from_str(&t).map_err(|source| Error::Json { path: hq, source })?;
            check_quantization(&v)?;
            cfg.quantized = true;
        }
        Ok(cfg)
    }

    /// Parses a `config.json` body.
    pub fn from_json(text: &str) -> Result<Self> {
        let json_err = |source| Error::Json { path: "config.json".into(), source };
        let v: serde_json::Value = serde_json::from_str(text).map_err(json_err)?;
        let model_type = v.get("model_type").and_then(|m| m.as_str()).unwrap_or_default().to_string();
        let architectures: Vec<String> = v
            .get("architectures")
            .and_then(|a| a.as_array())
            .map(|a| a.iter().filter_map(|s| s.as_str().map(String::from)).collect())
            .unwrap_or_default();
        // Refuse what no family serves before parsing family fields (the error names what is served).
        crate::served::served(&model_type, &architectures)?;
        let text_v = v.get("text_config").cloned().unwrap_or_else(|| v.clone());
        let mut text: TextConfig = serde_json::from_value(text_v).map_err(json_err)?;
        if text.model_type.is_empty() {
            text.model_type = model_type.clone();
        }
        // The wrapper's tie flag wins when present (transformers reads it from the top-level config).
        if let Some(t) = v.get("tie_word_embeddings").and_then(|t| t.as_bool()) {
            text.tie_word_embeddings = t;
        }
        let media_tokens: MediaTokens = serde_json::from_value(v.clone()).map_err(json_err)?;
        text.validate()?;
        if let Some(q) = v.get("quantization_config") {
            check_quantization(q)?;
        }
        let quantized = v.get("quantization_config").is_some_and(|q| !q.is_null());
        Ok(ModelConfig {
            model_type,
            architectures,
            text,
            vision: v.get("vision_config").cloned(),
            media_tokens,
            quantized,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TINY: &str = r#"{"model_type":"qwen3_5_moe_text","vocab_size":16,"hidden_size":8,"num_hidden_layers":2,
        "num_attention_heads":2,"num_key_value_heads":1,"head_dim":4,"rope_parameters":{"rope_theta":1e6,
        "partial_rotary_factor":0.5,"mrope_section":[1,0,0]},"linear_num_key_heads":1,"linear_num_value_heads":2,
        "linear_key_head_dim":4,"linear_value_head_dim":4,"num_experts":4,"num_experts_per_tok":2,
        "moe_intermediate_size":4,"shared_expert_intermediate_size":4,"some_future_key":true}"#;

    #[test]
    fn bare_text_config_with_unknown_keys_and_default_layer_types() {
        let c = ModelConfig::from_json(TINY).expect("valid");
        assert_eq!(c.text.layer_kinds().expect("kinds"), vec![LayerKind::Linear, LayerKind::Linear]);
        assert_eq!(c.text.moe().expect("moe").map(|m| m.top_k), Some(2));
        assert_eq!(c.text.rot_dim(), 2);
    }

    #[test]
    fn unsupported_values_are_rejected_with_the_field_named() {
        let bad_layer =
            TINY.replace("\"some_future_key\":true", "\"layer_types\":[\"linear_attention\",\"sliding_attention\"]");
        let e = ModelConfig::from_json(&bad_layer).expect_err("must reject").to_string();
        assert!(e.contains("sliding_attention"), "{e}");
        let bad_type = TINY.replace("qwen3_5_moe_text", "llama");
        assert!(ModelConfig::from_json(&bad_type).expect_err("reject").to_string().contains("llama"));
        let int8 = TINY.replace(
            "\"some_future_key\":true",
            "\"quantization_config\":{\"quant_method\":\"modelopt\",\"quant_algo\":\"INT8\"}",
        );
        assert!(ModelConfig::from_json(&int8).expect_err("reject").to_string().contains("INT8"));
        let nvfp4 = TINY.replace(
            "\"some_future_key\":true",
            "\"quantization_config\":{\"quant_method\":\"modelopt\",\"quant_algo\":\"NVFP4\",\"group_size\":16}",
        );
        assert!(ModelConfig::from_json(&nvfp4).is_ok());
        let bad_section = TINY.replace("[1,0,0]", "[2,1,0]");
        assert!(ModelConfig::from_json(&bad_section).expect_err("reject").to_string().contains("mrope_section"));
    }
}
