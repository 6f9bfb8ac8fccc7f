//! The family registry: maps `config.json`'s `model_type` (or, failing that, its `architectures`) to a
//! model family, and builds the family's decoder behind the [`CausalLm`] seam. An unknown model is refused
//! here, at load, with the list of what is served. Adding a family adds a directory and one entry to
//! [`FAMILIES`]; nothing else in the runtime changes.

use std::path::Path;
use std::sync::Arc;

use osprey_backend::{BackendRef, Op};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::error::{Error, Result};
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
    pub ple_budget: crate::PleBudget,
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

/// Every family osprey serves.
pub static FAMILIES: &[&Family] = &[&crate::qwen3_5::FAMILY, &crate::qwen4_exp::FAMILY];

/// The family of a config, by `model_type`, then by `architectures`; a clear error naming what is served.
pub fn family_of(model_type: &str, architectures: &[String]) -> Result<&'static Family> {
    Ok(FAMILIES[crate::served::served(model_type, architectures)?])
}

/// Loads a Hugging Face model directory with its weights placed on `backend`.
pub fn load_on(dir: &Path, backend: BackendRef) -> Result<Model> {
    let cfg = ModelConfig::from_dir(dir)?;
    let ck = Checkpoint::open(dir)?;
    load_with_progress(&cfg, &ck, None, backend, &mut |_, _| {})
}

/// Builds the decoder on `backend` from an opened checkpoint; `experts` replaces the default expert
/// source of MoE models (e.g. with the residency manager).
pub fn load_checkpoint(
    cfg: &ModelConfig,
    ck: &Checkpoint,
    experts: Option<Arc<dyn ExpertSource>>,
    backend: BackendRef,
) -> Result<Model> {
    load_with_progress(cfg, ck, experts, backend, &mut |_, _| {})
}

/// Builds the decoder with its weights placed on `backend`, reporting `(layers done, layers)`.
pub fn load_with_progress(
    cfg: &ModelConfig,
    ck: &Checkpoint,
    experts: Option<Arc<dyn ExpertSource>>,
    backend: BackendRef,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model> {
    load_with_options(cfg, ck, LoadOptions { experts, ..LoadOptions::default() }, backend, progress)
}

/// Builds the decoder with `opts`, its weights placed on `backend`, reporting `(layers done, layers)`.
/// A backend that lacks an op the family runs is refused here, naming the ops.
pub fn load_with_options(
    cfg: &ModelConfig,
    ck: &Checkpoint,
    opts: LoadOptions,
    backend: BackendRef,
    progress: &mut dyn FnMut(usize, usize),
) -> Result<Model> {
    let family = family_for(cfg)?;
    let mut ops = family.ops.to_vec();
    if cfg.quantized {
        ops.push(Op::LinearNvfp4);
    }
    osprey_backend::require(backend.as_ref(), &ops).map_err(|e| Error::Unsupported(e.to_string()))?;
    (family.load)(cfg, ck, opts, backend, progress)
}

/// Where the checkpoint's routed experts are (`None` for a dense model).
pub fn expert_layout(cfg: &ModelConfig, ck: &Checkpoint) -> Result<Option<ExpertLayout>> {
    (family_for(cfg)?.experts)(cfg, ck)
}

/// The checkpoint's vision tower and the media it takes (`None` for a text-only checkpoint).
pub fn load_vision(
    cfg: &ModelConfig,
    ck: &Checkpoint,
    backend: BackendRef,
) -> Result<Option<(VisionTower, MediaSupport)>> {
    let f = family_for(cfg)?;
    if cfg.vision.is_some() {
        osprey_backend::require(backend.as_ref(), &[Op::AttentionBidirectional])
            .map_err(|e| Error::Unsupported(e.to_string()))?;
    }
    Ok((f.vision)(cfg, ck, backend)?.map(|t| (t, f.media)))
}

/// The family a config belongs to.
pub fn family_for(cfg: &ModelConfig) -> Result<&'static Family> {
    family_of(&cfg.model_type, &cfg.architectures)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `family_of` indexes FAMILIES by the served-names table: the two must list the families in one order.
    #[test]
    fn the_served_names_are_the_families_in_their_order() {
        assert_eq!(FAMILIES.len(), crate::served::ALL.len());
        for (f, n) in FAMILIES.iter().zip(crate::served::ALL) {
            assert_eq!((f.model_types, f.architectures), (n.model_types, n.architectures), "{}", f.name);
        }
    }

    #[test]
    fn configs_map_to_families_and_unknown_ones_are_refused_by_name() {
        assert_eq!(family_of("qwen3_5_moe", &[]).expect("served").name, "qwen3_5");
        assert_eq!(family_of("qwen3_5_text", &[]).expect("served").name, "qwen3_5");
        let by_arch = family_of("", &["Qwen3_5MoeForConditionalGeneration".into()]).expect("by architecture");
        assert_eq!(by_arch.name, "qwen3_5");
        let e = family_of("llama", &["LlamaForCausalLM".into()]).expect_err("unknown").to_string();
        assert!(e.contains("\"llama\"") && e.contains("qwen3_5_moe"), "{e}");
    }
}
