//! Qwen3.8-Flash-Next (`qwen4_exp`), the second model family on the runtime seams: Qwen3.5-MoE's hybrid
//! stack of Gated DeltaNet and gated attention, with hyper-connections ([`hc`]) in place of the residual
//! and its norms, per-layer n-gram embeddings ([`ple`], hashed by [`ngram`]) on some layers, a QSA indexer
//! ([`qsa`]) choosing which tokens each attention query sees, a sigmoid or silu output gate on the
//! Gated DeltaNet norm and an optional router renormalisation. transformers 5.23.0's
//! `modular_qwen4_exp.py` is the ground truth (REFERENCE.md §2). What is in and what is not yet:
//! docs/qwen4_exp.md.

mod forward;
mod hc;
pub(crate) mod ngram;
mod params;
mod ple;
mod qsa;
mod state;
mod table;

pub use ngram::ple_table_rows;
pub use table::{PleBudget, PleCounts, PleStats, DEFAULT_PLE_RAM_BYTES};

use std::sync::Arc;

use osprey_backend::{BackendRef, MRope, Tensor};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::entry::{Family, MediaSupport, QuantRules};
use crate::error::Result;
use crate::family::{CausalLm, ForwardOptions, ForwardOutput, KvLayout, LmInfo, Model, SeqStep};
use crate::kv::PageTable;
use crate::layers::attention::GatedAttention;
use crate::layers::gdn::GatedDeltaNet;
use crate::layers::moe::{expert_dtype, ExpertSource, ResidentExperts, SparseMoe};
use crate::layers::{load_linear, place};
use crate::qwen_layout::{self, expert_layout, is_routed_expert, text_prefix};
use crate::state::SeqState;
use crate::vision::VisionTower;
use hc::HyperConnection;
use params::{Kind, Params};
use ple::Ple;
use qsa::{Indexer, IndexerState};
use state::{LayerState, Mix, Qwen4State};

/// Today's decoder ops and those only this family runs (hyper-connections, PLE, QSA, grouped norms).
const QWEN4_OPS: [osprey_backend::Op; 13] = {
    use osprey_backend::Op::*;
    [
        Memory,
        LinearDense,
        Embed,
        Elementwise,
        Norms,
        Rotary,
        AttentionPaged,
        GatedDeltaNet,
        Router,
        GroupedNorms,
        HyperConnections,
        Ple,
        AttentionSelected,
    ]
};

/// The registry entry of `qwen4_exp`, multimodal wrapper or text-only.
pub(crate) static FAMILY: Family = Family {
    name: "qwen4_exp",
    model_types: crate::served::QWEN4_EXP.model_types,
    architectures: crate::served::QWEN4_EXP.architectures,
    load: |cfg, ck, opts, backend, progress| Ok(Box::new(Qwen4Exp::load(cfg, ck, opts, backend, progress)?) as Model),
    experts: expert_layout,
    // The tower is Qwen3.5-MoE's (`Qwen4ExpVisionModel = Qwen3_5MoeVisionModel`).
    vision: |cfg, ck, backend| cfg.vision.as_ref().map(|v| VisionTower::load(backend, ck, v)).transpose(),
    media: MediaSupport { images: true, video: true },
    ops: &QWEN4_OPS,
    quant: QuantRules {
        is_routed_expert,
        eligible_linear,
        fused_experts: ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"),
        exclude_modules: |all_linear| {
            let mut v = vec!["lm_head", "*embed_tokens*", "*.mlp.gate", "*shared_expert_gate*", "model.visual*"];
            v.extend(["*hyper_connection*", "*.ple.*", "*indexer*"]);
            if !all_linear {
                v.extend(["*self_attn*", "*linear_attn*", "*shared_expert*"]);
            }
            v
        },
    },
};

/// Decoder linears `--all-linear` quantises: attention, Gated DeltaNet and expert projections; not the
/// hyper-connections, PLE, the indexer, routers, embeddings, norms or convolutions.
fn eligible_linear(name: &str, shape: &[usize]) -> bool {
    qwen_layout::eligible_linear(name, shape, &["hyper_connection", ".ple.", "indexer"])
}

#[derive(Debug)]
enum Mixer {
    Linear(Box<GatedDeltaNet>),
    Indexed(Box<GatedAttention>, Box<Indexer>),
}

#[derive(Debug)]
struct Layer {
    ple: Option<Box<Ple>>,
    attn_hc: HyperConnection,
    mixer: Mixer,
    mlp_hc: HyperConnection,
    moe: Box<SparseMoe>,
}

/// A loaded `qwen4_exp` text decoder.
#[derive(Debug)]
pub(crate) struct Qwen4Exp {
    p: Params,
    hidden: usize,
    vocab: usize,
    info: LmInfo,
    kv: KvLayout,
    backend: BackendRef,
    embed: Tensor,
    layers: Vec<Layer>,
    mixer: HyperConnection,
    lm_head: Tensor,
    rope: MRope,
    experts: Arc<dyn ExpertSource>,
    /// The PLE row caches' counters (all PLE layers).
    ple_stats: Arc<PleStats>,
}

impl Qwen4Exp {
    fn load(
        cfg: &ModelConfig,
        ck: &Checkpoint,
        opts: crate::entry::LoadOptions,
        backend: BackendRef,
        progress: &mut dyn FnMut(usize, usize),
    ) -> Result<Self> {
        let b = backend.as_ref();
        let c = &cfg.text;
        let p = Params::from_config(c)?;
        let (h, v) = (c.hidden_size, c.vocab_size);
        let eps = c.rms_norm_eps as f32;
        let pre = text_prefix(ck);
        let mut moe = c.moe()?.ok_or_else(|| crate::error::Error::Unsupported("qwen4_exp without experts".into()))?;
        moe.renorm = p.norm_topk_prob;
        let rope_p = c.rope()?;
        let sec = &rope_p.mrope_section;
        let rope = MRope::new(c.head_dim(), c.rot_dim(), rope_p.rope_theta, [sec[0], sec[1], sec[2]]);
        let hc_dims = (h, p.hc, p.hc_lowrank);
        let mut layers = Vec::with_capacity(p.kinds.len());
        let ple_stats = opts.ple_budget.stats();
        for (i, kind) in p.kinds.iter().enumerate() {
            let lp = format!("{pre}layers.{i}");
            let mixer = match kind {
                Kind::Linear => Mixer::Linear(Box::new(
                    GatedDeltaNet::load(b, ck, &format!("{lp}.linear_attn"), c)?.with_sigmoid_gate(p.sigmoid_gate),
                )),
                Kind::Indexed => Mixer::Indexed(
                    Box::new(GatedAttention::load(b, ck, &format!("{lp}.self_attn"), c)?),
                    Box::new(Indexer::load(b, ck, &format!("{lp}.self_attn.indexer"), p.qsa, h, &rope, eps)?),
                ),
            };
            let ple = match p.ple_layers.iter().position(|&l| l == i) {
                Some(index) => {
                    let ram = (&opts.ple_budget, &ple_stats);
                    Some(Box::new(Ple::load(b, ck, &format!("{lp}.ple"), index, &p, (h, eps), ram)?))
                }
                None => None,
            };
            layers.push(Layer {
                ple,
                attn_hc: HyperConnection::load(b, ck, &format!("{lp}.attn_hyper_connection"), hc_dims, true, eps)?,
                mixer,
                mlp_hc: HyperConnection::load(b, ck, &format!("{lp}.mlp_hyper_connection"), hc_dims, true, eps)?,
                moe: {
                    let mp = format!("{lp}.mlp");
                    let dtype = expert_dtype(ck, &mp, h, moe)?;
                    Box::new(SparseMoe::load(b, ck, &mp, i, h, moe, dtype, opts.expert_slots)?)
                },
            });
            progress(i + 1, p.kinds.len());
        }
        let mut moes: Vec<&mut SparseMoe> = layers.iter_mut().map(|l| &mut *l.moe).collect();
        SparseMoe::read_ahead(&mut moes, opts.predictor.clone(), opts.guess_uploads, opts.prefetch_depth);
        let experts = match opts.experts {
            Some(src) => src,
            None => {
                let prefixes: Vec<Option<String>> =
                    (0..layers.len()).map(|i| Some(format!("{pre}layers.{i}.mlp"))).collect();
                Arc::new(ResidentExperts::load(ck, &prefixes, h, moe)?) as Arc<dyn ExpertSource>
            }
        };
        let embed = place(b, ck.weight(&format!("{pre}embed_tokens.weight"), &[v, h])?)?;
        let lm_head = if c.tie_word_embeddings { embed.clone() } else { load_linear(b, ck, "lm_head", v, h)? };
        let mixer = HyperConnection::load(b, ck, &format!("{pre}hyper_connection_mixer"), hc_dims, false, eps)?;
        let info = LmInfo {
            family: FAMILY.name,
            hidden_size: h,
            vocab_size: v,
            num_layers: layers.len(),
            moe_layers: layers.len(),
            experts_per_token: moe.top_k,
            eos_token_ids: c.eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default(),
            max_position_embeddings: c.max_position_embeddings,
        };
        let kv = KvLayout {
            layers: p.kinds.iter().filter(|k| **k == Kind::Indexed).count(),
            kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim(),
        };
        Ok(Qwen4Exp {
            p,
            hidden: h,
            vocab: v,
            info,
            kv,
            backend,
            embed,
            layers,
            mixer,
            lm_head,
            rope,
            experts,
            ple_stats,
        })
    }
}

impl CausalLm for Qwen4Exp {
    fn info(&self) -> &LmInfo {
        &self.info
    }

    fn kv_layout(&self) -> KvLayout {
        self.kv
    }

    fn backend(&self) -> &BackendRef {
        &self.backend
    }

    fn forward_with(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput> {
        self.run(steps, opts)
    }

    fn new_state_with(&self, kv: PageTable) -> Result<SeqState> {
        let b = self.backend.as_ref();
        let mut kv_layers = 0..;
        let layers = self
            .layers
            .iter()
            .map(|l| {
                Ok(LayerState {
                    mix: match &l.mixer {
                        Mixer::Linear(g) => Mix::Linear(g.new_state(b)?),
                        Mixer::Indexed(..) => Mix::Indexed {
                            kv_layer: kv_layers.next().unwrap_or_default(),
                            indexer: IndexerState::default(),
                        },
                    },
                    ple: l.ple.as_ref().map(|p| p.new_state(b)).transpose()?,
                })
            })
            .collect::<Result<_>>()?;
        let history = vec![self.p.ngram.eos; self.p.ngram.ngram_size - 1];
        Ok(SeqState::new(Box::new(Qwen4State { layers, history, positions: Vec::new() }), kv))
    }

    fn weight_bytes(&self) -> (usize, usize) {
        let mut dense = self.embed.bytes() / self.vocab + self.lm_head.bytes() + self.mixer.bytes();
        for l in &self.layers {
            dense += l.attn_hc.bytes() + l.mlp_hc.bytes() + l.moe.bytes() + l.ple.as_ref().map_or(0, |p| p.bytes());
            dense += match &l.mixer {
                Mixer::Linear(g) => g.bytes(),
                Mixer::Indexed(a, i) => a.bytes() + i.bytes(),
            };
        }
        let per_expert = self.experts.expert_bytes().unwrap_or(0);
        (dense, per_expert)
    }

    fn slot_stats(&self) -> osprey_protocol::runner::ExpertSlots {
        self.layers.iter().fold(osprey_protocol::runner::ExpertSlots::default(), |a, l| a + l.moe.slot_stats())
    }

    fn family_stats(&self) -> Vec<crate::FamilyStat> {
        if !self.layers.iter().any(|l| l.ple.is_some()) {
            return Vec::new();
        }
        let p = self.ple_stats.counts();
        let residency = if p.hits + p.misses == 0 { 1.0 } else { p.hits as f64 / (p.hits + p.misses) as f64 };
        let stat = |name, help, counter, value| crate::FamilyStat { name, help, counter, value };
        vec![
            stat("osprey_ple_hits_total", "PLE rows served from the RAM cache.", true, p.hits as f64),
            stat("osprey_ple_misses_total", "PLE rows read from the table on disk.", true, p.misses as f64),
            stat("osprey_ple_bytes_read_total", "Bytes of PLE rows read from the table.", true, p.bytes_read as f64),
            stat("osprey_ple_resident_bytes", "Bytes of PLE rows held in RAM.", false, p.resident_bytes as f64),
            stat("osprey_ple_table_bytes", "Bytes of the PLE tables on disk.", false, p.table_bytes as f64),
            stat("osprey_ple_residency", "Fraction of PLE row lookups served from RAM.", false, residency),
        ]
    }
}
