//! Qwen3.5 / Qwen3.6 text decoder, dense (`qwen3_5`) and MoE (`qwen3_5_moe`): a hybrid stack of Gated
//! DeltaNet and gated full-attention layers, each followed by a dense MLP or a sparse MoE block.
//!
//! One forward runs a batch of sequences, each contributing any number of new tokens (a prefill chunk, or
//! one decode token): projections run on all rows at once, token mixers per sequence. The runtime reaches
//! it only through the [`CausalLm`] seam and the registry entry [`FAMILY`]; the Qwen3.5 tensor names
//! (`model.language_model.…`) live in this directory alone.

mod forward;
mod mtp;
mod state;

use std::sync::Arc;

use osprey_backend::{BackendRef, MRope, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::{LayerKind, ModelConfig, TextConfig};
use crate::entry::{Family, MediaSupport, QuantRules};
use crate::error::Result;
use crate::family::{CausalLm, ForwardOptions, ForwardOutput, KvLayout, LmInfo, Model, SeqStep};
use crate::kv::PageTable;
use crate::layers::attention::GatedAttention;
use crate::layers::gdn::GatedDeltaNet;
use crate::layers::mlp::Mlp;
use crate::layers::moe::{expert_dtype, ExpertSource, ResidentExperts, SparseMoe};
use crate::layers::{load_linear, load_vector, place};
use crate::qwen_layout::{self, expert_layout, is_routed_expert, text_prefix};
use crate::state::SeqState;
use crate::vision::VisionTower;
use state::{HybridState, LayerState};

/// The registry entry of Qwen3.5 / Qwen3.6, dense and MoE, multimodal wrapper or text-only.
pub(crate) static FAMILY: Family = Family {
    name: "qwen3_5",
    model_types: crate::served::QWEN3_5.model_types,
    architectures: crate::served::QWEN3_5.architectures,
    load: |cfg, ck, opts, backend, progress| {
        Ok(Box::new(Qwen35::from_checkpoint_with_progress(cfg, ck, opts, backend, progress)?) as Model)
    },
    experts: expert_layout,
    vision: |cfg, ck, backend| cfg.vision.as_ref().map(|v| VisionTower::load(backend, ck, v)).transpose(),
    media: MediaSupport { images: true, video: true },
    ops: crate::entry::DECODER_OPS,
    quant: QuantRules {
        is_routed_expert,
        eligible_linear,
        fused_experts: ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        exclude_modules: |all_linear| {
            if all_linear {
                vec!["lm_head", "*embed_tokens*", "*.mlp.gate", "*shared_expert_gate*", "model.visual*"]
            } else {
                vec![
                    "lm_head",
                    "*embed_tokens*",
                    "*self_attn*",
                    "*linear_attn*",
                    "*shared_expert*",
                    "*.mlp.gate",
                    "model.visual*",
                ]
            }
        },
    },
};

/// Decoder linears `--all-linear` quantises: not the routers, the shared-expert gate, embeddings,
/// `lm_head`, norms, convolutions or the vision tower.
fn eligible_linear(name: &str, shape: &[usize]) -> bool {
    qwen_layout::eligible_linear(name, shape, &[])
}

#[derive(Debug)]
enum Mixer {
    Linear(Box<GatedDeltaNet>),
    Full(Box<GatedAttention>),
}

#[derive(Debug)]
enum Ffn {
    Dense(Box<Mlp>),
    Moe(Box<SparseMoe>),
}

#[derive(Debug)]
struct DecoderLayer {
    input_norm: Tensor,
    post_norm: Tensor,
    mixer: Mixer,
    ffn: Ffn,
}

impl DecoderLayer {
    /// Layer `{lp}` of kind `kind`, its routed experts (if any) under expert-layer index `index`.
    fn load(
        b: &dyn osprey_backend::Backend,
        ck: &Checkpoint,
        lp: &str,
        kind: LayerKind,
        index: usize,
        c: &TextConfig,
        expert_slots: Option<usize>,
    ) -> Result<Self> {
        let h = c.hidden_size;
        let mixer = match kind {
            LayerKind::Linear => Mixer::Linear(Box::new(GatedDeltaNet::load(b, ck, &format!("{lp}.linear_attn"), c)?)),
            LayerKind::Full => Mixer::Full(Box::new(GatedAttention::load(b, ck, &format!("{lp}.self_attn"), c)?)),
            LayerKind::Indexed => {
                return Err(crate::error::Error::Unsupported(format!(
                    "{lp}: indexed attention is qwen4_exp's, not {}'s",
                    c.model_type
                )))
            }
        };
        let mp = format!("{lp}.mlp");
        let ffn = match c.moe()? {
            Some(m) => {
                let dtype = expert_dtype(ck, &mp, h, m)?;
                Ffn::Moe(Box::new(SparseMoe::load(b, ck, &mp, index, h, m, dtype, expert_slots)?))
            }
            None => Ffn::Dense(Box::new(Mlp::load(b, ck, &mp, h, c.intermediate_size.unwrap_or_default())?)),
        };
        Ok(DecoderLayer {
            input_norm: load_vector(b, ck, &format!("{lp}.input_layernorm.weight"), h)?,
            post_norm: load_vector(b, ck, &format!("{lp}.post_attention_layernorm.weight"), h)?,
            mixer,
            ffn,
        })
    }
}

/// A loaded Qwen3.5 text decoder.
#[derive(Debug)]
pub(crate) struct Qwen35 {
    cfg: TextConfig,
    info: LmInfo,
    /// Where the weights live and the forward runs.
    backend: BackendRef,
    embed: Tensor,
    layers: Vec<DecoderLayer>,
    norm: Tensor,
    lm_head: Tensor,
    rope: MRope,
    experts: Option<Arc<dyn ExpertSource>>,
    /// The multi-token-prediction head, when loaded for speculative decoding.
    draft: Option<mtp::MtpHead>,
}

impl Qwen35 {
    /// Builds the decoder from an opened checkpoint with its weights placed on `backend`, reporting
    /// `(layers done, layers)` as layers are placed. `experts` replaces the default (every expert mapped
    /// from `ck`) for MoE models, e.g. with the residency manager.
    fn from_checkpoint_with_progress(
        cfg: &ModelConfig,
        ck: &Checkpoint,
        opts: crate::entry::LoadOptions,
        backend: BackendRef,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let b = backend.as_ref();
        let c = cfg.text.clone();
        let (h, v) = (c.hidden_size, c.vocab_size);
        let p = text_prefix(ck);
        let kinds = c.layer_kinds()?;
        let moe = c.moe()?;
        let mut layers = Vec::with_capacity(kinds.len());
        for (i, kind) in kinds.iter().enumerate() {
            layers.push(DecoderLayer::load(b, ck, &format!("{p}layers.{i}"), *kind, i, &c, opts.expert_slots)?);
            progress(i + 1, kinds.len());
        }
        let mut moes: Vec<&mut SparseMoe> = layers
            .iter_mut()
            .filter_map(|l| match &mut l.ffn {
                Ffn::Moe(m) => Some(&mut **m),
                Ffn::Dense(_) => None,
            })
            .collect();
        SparseMoe::read_ahead(&mut moes, opts.predictor.clone(), opts.guess_uploads, opts.prefetch_depth);
        // The draft head's layer takes the next expert-layer index and the next KV plane.
        let kv_planes = kinds.iter().filter(|k| matches!(k, LayerKind::Full)).count();
        let draft = if opts.draft_head { mtp::MtpHead::load(b, ck, &c, opts.expert_slots, kv_planes)? } else { None };
        let experts = match (moe, opts.experts) {
            (Some(_), Some(src)) => Some(src),
            (Some(m), None) => {
                let mut prefixes: Vec<Option<String>> =
                    (0..kinds.len()).map(|i| Some(format!("{p}layers.{i}.mlp"))).collect();
                if draft.is_some() {
                    prefixes.push(Some(mtp::MOE_PREFIX.into()));
                }
                Some(Arc::new(ResidentExperts::load(ck, &prefixes, h, m)?) as Arc<dyn ExpertSource>)
            }
            (None, _) => None,
        };
        let embed = place(b, ck.weight(&format!("{p}embed_tokens.weight"), &[v, h])?)?;
        let lm_head = if c.tie_word_embeddings { embed.clone() } else { load_linear(b, ck, "lm_head", v, h)? };
        let rope_p = c.rope()?;
        let sec = &rope_p.mrope_section;
        let rope = MRope::new(c.head_dim(), c.rot_dim(), rope_p.rope_theta, [sec[0], sec[1], sec[2]]);
        let info = LmInfo {
            family: FAMILY.name,
            hidden_size: h,
            vocab_size: v,
            num_layers: kinds.len(),
            moe_layers: if moe.is_some() { kinds.len() } else { 0 },
            experts_per_token: moe.map_or(0, |m| m.top_k),
            eos_token_ids: c.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default(),
            max_position_embeddings: c.max_position_embeddings,
        };
        let norm = load_vector(b, ck, &format!("{p}norm.weight"), h)?;
        Ok(Qwen35 { norm, cfg: c, info, backend, embed, layers, lm_head, rope, experts, draft })
    }
}

impl CausalLm for Qwen35 {
    fn info(&self) -> &LmInfo {
        &self.info
    }

    fn kv_layout(&self) -> KvLayout {
        let layers = self.layers.iter().filter(|l| matches!(l.mixer, Mixer::Full(_))).count()
            + usize::from(self.draft.is_some());
        KvLayout { layers, kv_heads: self.cfg.num_key_value_heads, head_dim: self.cfg.head_dim() }
    }

    fn backend(&self) -> &BackendRef {
        &self.backend
    }

    fn forward_with(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput> {
        self.run(steps, opts)
    }

    fn new_state_with(&self, kv: PageTable) -> Result<SeqState> {
        let mut kv_layers = 0..;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(match &l.mixer {
                    Mixer::Linear(g) => LayerState::Linear(g.new_state(self.backend.as_ref())?),
                    Mixer::Full(_) => LayerState::Full { kv_layer: kv_layers.next().unwrap_or_default() },
                })
            })
            .collect::<Result<_>>()?;
        Ok(SeqState::new(Box::new(HybridState { layers }), kv))
    }

    fn has_draft_head(&self) -> bool {
        self.draft.is_some()
    }

    fn draft(&self, steps: &mut [crate::DraftStep<'_, '_>], capture: bool) -> Result<crate::DraftOutput> {
        match &self.draft {
            Some(d) => d.run(self, steps, capture),
            None => Err(crate::error::Error::Unsupported("no draft head loaded".into())),
        }
    }

    fn slot_stats(&self) -> osprey_protocol::runner::ExpertSlots {
        self.layers
            .iter()
            .chain(self.draft.as_ref().map(|d| &d.layer))
            .filter_map(|l| match &l.ffn {
                Ffn::Moe(m) => Some(m.slot_stats()),
                Ffn::Dense(_) => None,
            })
            .fold(osprey_protocol::runner::ExpertSlots::default(), |a, s| a + s)
    }

    fn weight_bytes(&self) -> (usize, usize) {
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
