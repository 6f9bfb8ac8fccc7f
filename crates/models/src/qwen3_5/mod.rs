//! Qwen3.5 / Qwen3.6 text decoder, dense (`qwen3_5`) and MoE (`qwen3_5_moe`): a hybrid stack of Gated
//! DeltaNet and gated full-attention layers, each followed by a dense MLP or a sparse MoE block.
//!
//! One [`Qwen35::forward`] runs a batch of sequences, each contributing any number of new tokens (a
//! prefill chunk, or one decode token): projections run on all rows at once, token mixers per sequence.

mod forward;

use std::path::Path;
use std::sync::Arc;

use osprey_kernels::rope::MRope;

use crate::checkpoint::{Checkpoint, Weight};
use crate::config::{LayerKind, ModelConfig, TextConfig};
use crate::error::Result;
use crate::layers::attention::GatedAttention;
use crate::layers::gdn::GatedDeltaNet;
use crate::layers::mlp::Mlp;
use crate::layers::moe::{ExpertSource, ResidentExperts, SparseMoe};
use crate::state::{LayerState, SeqState};

pub use forward::{ForwardOptions, ForwardOutput, InjectedRows, LogitsWanted, Positions, SeqInput, SeqStep};

#[derive(Debug)]
enum Mixer {
    Linear(GatedDeltaNet),
    Full(GatedAttention),
}

#[derive(Debug)]
enum Ffn {
    Dense(Box<Mlp>),
    Moe(Box<SparseMoe>),
}

#[derive(Debug)]
struct DecoderLayer {
    input_norm: Vec<f32>,
    post_norm: Vec<f32>,
    mixer: Mixer,
    ffn: Ffn,
}

/// A loaded Qwen3.5 text decoder.
#[derive(Debug)]
pub struct Qwen35 {
    cfg: TextConfig,
    embed: Weight,
    layers: Vec<DecoderLayer>,
    norm: Vec<f32>,
    lm_head: Weight,
    rope: MRope,
    experts: Option<Arc<dyn ExpertSource>>,
}

/// Where the decoder's tensors live: `model.language_model.` in the multimodal (and Hub) layout,
/// `model.` in checkpoints saved from a text-only `*ForCausalLM`.
fn text_prefix(ck: &Checkpoint) -> &'static str {
    if ck.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    }
}

impl Qwen35 {
    /// Loads a Hugging Face model directory with every expert mapped from the checkpoint.
    pub fn load(dir: &Path) -> Result<Self> {
        let cfg = ModelConfig::from_dir(dir)?;
        let ck = Checkpoint::open(dir)?;
        Self::from_checkpoint(&cfg, &ck, None)
    }

    /// Builds the decoder from an opened checkpoint. `experts` replaces the default (every expert
    /// mapped from `ck`) for MoE models, e.g. with the residency manager.
    pub fn from_checkpoint(cfg: &ModelConfig, ck: &Checkpoint, experts: Option<Arc<dyn ExpertSource>>) -> Result<Self> {
        Self::from_checkpoint_with_progress(cfg, ck, experts, &mut |_, _| {})
    }

    /// [`Qwen35::from_checkpoint`], reporting `(layers done, layers)` as layers are mapped.
    pub fn from_checkpoint_with_progress(
        cfg: &ModelConfig,
        ck: &Checkpoint,
        experts: Option<Arc<dyn ExpertSource>>,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let c = cfg.text.clone();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let p = text_prefix(ck);
        let kinds = c.layer_kinds()?;
        let moe = c.moe()?;
        let mut layers = Vec::with_capacity(kinds.len());
        for (i, kind) in kinds.iter().enumerate() {
            let lp = format!("{p}layers.{i}");
            let mixer = match kind {
                LayerKind::Linear => Mixer::Linear(GatedDeltaNet::load(ck, &format!("{lp}.linear_attn"), &c)?),
                LayerKind::Full => Mixer::Full(GatedAttention::load(ck, &format!("{lp}.self_attn"), &c)?),
            };
            let ffn = match moe {
                Some(m) => Ffn::Moe(Box::new(SparseMoe::load(ck, &format!("{lp}.mlp"), i, h, m)?)),
                None => Ffn::Dense(Box::new(Mlp::load(
                    ck,
                    &format!("{lp}.mlp"),
                    h,
                    c.intermediate_size.unwrap_or_default(),
                )?)),
            };
            layers.push(DecoderLayer {
                input_norm: ck.vector(&format!("{lp}.input_layernorm.weight"), h)?,
                post_norm: ck.vector(&format!("{lp}.post_attention_layernorm.weight"), h)?,
                mixer,
                ffn,
            });
            progress(i + 1, kinds.len());
        }
        let experts = match (moe, experts) {
            (Some(_), Some(src)) => Some(src),
            (Some(m), None) => {
                let prefixes: Vec<Option<String>> =
                    (0..kinds.len()).map(|i| Some(format!("{p}layers.{i}.mlp"))).collect();
                Some(Arc::new(ResidentExperts::load(ck, &prefixes, h, m)?) as Arc<dyn ExpertSource>)
            }
            (None, _) => None,
        };
        let embed = ck.weight(&format!("{p}embed_tokens.weight"), &[v, h])?;
        let lm_head = if c.tie_word_embeddings { embed.clone() } else { ck.linear("lm_head", v, h)? };
        let rope_p = c.rope()?;
        let sec = &rope_p.mrope_section;
        let rope = MRope::new(c.head_dim(), c.rot_dim(), rope_p.rope_theta, [sec[0], sec[1], sec[2]]);
        Ok(Qwen35 { norm: ck.vector(&format!("{p}norm.weight"), h)?, cfg: c, embed, layers, lm_head, rope, experts })
    }

    /// The decoder's config.
    pub fn config(&self) -> &TextConfig {
        &self.cfg
    }

    /// A fresh state for a new sequence.
    pub fn new_state(&self) -> SeqState {
        SeqState::new(
            self.layers
                .iter()
                .map(|l| match &l.mixer {
                    Mixer::Linear(g) => LayerState::Linear(g.new_state()),
                    Mixer::Full(a) => LayerState::Full(a.new_cache()),
                })
                .collect(),
        )
    }

    /// Bytes of weights read per token excluding routed experts (the dense part), and per routed expert.
    pub fn weight_bytes(&self) -> (usize, usize) {
        let mut dense = self.embed.bytes() / self.cfg.vocab_size + self.lm_head.bytes();
        for l in &self.layers {
            dense += match &l.mixer {
                Mixer::Linear(g) => g.bytes(),
                Mixer::Full(a) => a.bytes(),
            };
            dense += match &l.ffn {
                Ffn::Dense(m) => m.bytes(),
                Ffn::Moe(m) => m.bytes(),
            };
        }
        let per_expert = match self.cfg.moe() {
            Ok(Some(m)) => self
                .experts
                .as_ref()
                .and_then(|e| e.expert_bytes())
                .unwrap_or(3 * m.intermediate * self.cfg.hidden_size * self.embed.dtype().size()),
            _ => 0,
        };
        (dense, per_expert)
    }
}
