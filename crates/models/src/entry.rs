//! What a family gives the registry: its entry ([`Family`]: names served, loaders, media, quantization
//! rules, the backend ops it runs) and what loading takes ([`LoadOptions`]). Beside the family seam
//! ([`crate::family`]); the families and the registry both depend on it, so no family reaches back into
//! the registry.

use std::sync::Arc;

use osprey_backend::{BackendRef, Op};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::Result;
use crate::family::Model;
use crate::layers::moe::ExpertSource;
use crate::vision::VisionTower;

/// Where a model's routed experts live in its checkpoint (what the expert store indexes).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertLayout {
    /// Per layer, the tensor prefix of its MoE block (`…layers.{i}.mlp`).
    pub prefixes: Vec<String>,
    /// Routed experts per layer.
    pub num_experts: usize,
    /// Residual width.
    pub hidden: usize,
    /// Expert width.
    pub intermediate: usize,
}

/// How a model is loaded, beyond its directory and backend.
#[derive(Clone, Debug, Default)]
pub struct LoadOptions {
    /// Replaces the default source of routed experts (every expert mapped from the checkpoint), e.g.
    /// with the residency manager.
    pub experts: Option<Arc<dyn ExpertSource>>,
    /// Expert slots per MoE layer on the backend (`None`: the source's
    /// [`ExpertSource::slots_per_layer`], else one per expert).
    pub expert_slots: Option<usize>,
    /// RAM for cached PLE table rows, all layers together (`qwen4_exp`; default 1 GiB). The caller may
    /// keep a clone and change it while the model runs.
    pub ple_budget: crate::ple_budget::PleBudget,
    /// Guesses each MoE layer's experts while the layer before computes, so a disk-backed expert source
    /// reads them ahead (`None`: no read-ahead; answers are the same either way).
    pub predictor: Option<Arc<dyn crate::layers::predict::ExpertPredictor>>,
    /// With a predictor: also upload each guess the expert source holds in RAM into the next layer's
    /// backend slots while the layer before computes (a device backend whose slots hold fewer experts
    /// than a layer has: the host-to-device copies overlap compute). Answers are the same either way.
    pub guess_uploads: bool,
    /// With a predictor: how many MoE layers ahead each layer guesses (1, or 0: the next only; 2: the next
    /// two, so the reads of the layer after next queue behind the next one's and the disk never waits for
    /// a layer's routing).
    pub prefetch_depth: usize,
    /// Load the checkpoint's draft head (`mtp.*`, speculative decoding) when it has one: the head's
    /// layer then keeps its own plane in the KV pages.
    pub draft_head: bool,
}

/// Loads a family's decoder from a parsed config and an opened checkpoint, its weights placed on the
/// backend; `progress` gets (layers done, layers).
pub type LoadFn = fn(&ModelConfig, &Checkpoint, LoadOptions, BackendRef, &mut dyn FnMut(usize, usize)) -> Result<Model>;

/// The routed-expert layout of a checkpoint of this family (`None` for a dense model).
pub type ExpertsFn = fn(&ModelConfig, &Checkpoint) -> Result<Option<ExpertLayout>>;

/// How `osprey quantize` picks a family's tensors (tensor names are the family's business).
#[derive(Debug)]
pub struct QuantRules {
    /// A routed expert's projection in the per-expert (Hub) layout.
    pub is_routed_expert: fn(&str) -> bool,
    /// A decoder linear that `--all-linear` quantises (`name`, `shape`).
    pub eligible_linear: fn(&str, &[usize]) -> bool,
    /// Name suffixes of the fused expert tensors `[E, 2I, H]` (gate rows first) and `[E, H, I]`, which
    /// are split into the Hub layout; the per-expert names are `{prefix}{e}.{gate,up,down}_proj.weight`.
    pub fused_experts: (&'static str, &'static str),
    /// `exclude_modules` written to `quantization_config` (experts only, or `--all-linear`).
    pub exclude_modules: fn(bool) -> Vec<&'static str>,
}

/// The media a family's checkpoints accept (when they carry a vision tower).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MediaSupport {
    /// Still images.
    pub images: bool,
    /// Videos (frame lists, animated files).
    pub video: bool,
}

/// One registry entry.
#[derive(Debug)]
pub struct Family {
    /// Registry name (also [`crate::LmInfo::family`]).
    pub name: &'static str,
    /// `model_type` values served (the wrapper's and the text config's).
    pub model_types: &'static [&'static str],
    /// `architectures` entries served, for configs without a known `model_type`.
    pub architectures: &'static [&'static str],
    /// Builds the decoder.
    pub load: LoadFn,
    /// Finds the routed experts.
    pub experts: ExpertsFn,
    /// Loads the vision tower of a multimodal checkpoint (`None`: text-only).
    pub vision: VisionFn,
    /// What media the vision tower takes.
    pub media: MediaSupport,
    /// Tensor selection for `osprey quantize`.
    pub quant: QuantRules,
    /// The backend ops its decoder runs (NVFP4 linears are asked for when the checkpoint is
    /// quantized, bidirectional attention when the vision tower loads).
    pub ops: &'static [Op],
}

/// The ops every decoder of today's families runs.
pub const DECODER_OPS: &[Op] = &[
    Op::Memory,
    Op::Fences,
    Op::LinearDense,
    Op::Embed,
    Op::Elementwise,
    Op::Norms,
    Op::Rotary,
    Op::AttentionPaged,
    Op::GatedDeltaNet,
    Op::Router,
];

/// The vision tower of a checkpoint of this family (`None` for a text-only one).
pub type VisionFn = fn(&ModelConfig, &Checkpoint, BackendRef) -> Result<Option<VisionTower>>;
