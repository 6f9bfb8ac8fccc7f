//! The family registry: maps `config.json`'s `model_type` (or, failing that, its `architectures`) to a
//! model family, and builds the family's decoder behind the [`CausalLm`] seam. An unknown model is refused
//! here, at load, with the list of what is served. Adding a family adds a directory, its entry
//! ([`crate::entry::Family`], declared in the family's own module) and one line in [`FAMILIES`]; nothing
//! else in the runtime changes. Families depend on `entry`, never on this module.

use std::path::Path;
use std::sync::Arc;

use osprey_backend::{BackendRef, Op};

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
pub use crate::entry::{
    ExpertLayout, ExpertsFn, Family, LoadFn, LoadOptions, MediaSupport, QuantRules, VisionFn, DECODER_OPS,
};
use crate::error::{Error, Result};
use crate::family::Model;
use crate::layers::moe::ExpertSource;
use crate::vision::VisionTower;

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
