//! The names each family is served under (`model_type`s and `architectures`), kept apart from the
//! families themselves: reading a config refuses a model no family serves without depending on the
//! families (which depend on the config), and the registry finds a config's family by the same table.

use crate::error::{Error, Result};

/// One family's names.
#[derive(Debug)]
pub(crate) struct Names {
    /// `model_type` values (the wrapper's and the text config's).
    pub(crate) model_types: &'static [&'static str],
    /// `architectures` entries, for configs without a known `model_type`.
    pub(crate) architectures: &'static [&'static str],
}

/// Qwen3.5 / Qwen3.6, dense and MoE, multimodal wrapper or text-only.
pub(crate) const QWEN3_5: Names = Names {
    model_types: &["qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"],
    architectures: &[
        "Qwen3_5ForConditionalGeneration",
        "Qwen3_5MoeForConditionalGeneration",
        "Qwen3_5ForCausalLM",
        "Qwen3_5MoeForCausalLM",
    ],
};

/// `qwen4_exp` (Qwen3.8-Flash-Next), multimodal wrapper or text-only.
pub(crate) const QWEN4_EXP: Names = Names {
    model_types: &["qwen4_exp", "qwen4_exp_text"],
    architectures: &["Qwen4ExpForConditionalGeneration", "Qwen4ExpForCausalLM"],
};

/// Every family's names, in the registry's order ([`crate::registry::FAMILIES`]).
pub(crate) const ALL: &[&Names] = &[&QWEN3_5, &QWEN4_EXP];

/// The index in [`ALL`] of the family serving a config, by `model_type`, then by `architectures`; a clear
/// error naming what is served.
pub(crate) fn served(model_type: &str, architectures: &[String]) -> Result<usize> {
    if let Some(i) = ALL.iter().position(|n| n.model_types.contains(&model_type)) {
        return Ok(i);
    }
    if let Some(i) = ALL.iter().position(|n| architectures.iter().any(|a| n.architectures.contains(&a.as_str()))) {
        return Ok(i);
    }
    let served: Vec<&str> = ALL.iter().flat_map(|n| n.model_types.iter().copied()).collect();
    Err(Error::Unsupported(format!(
        "model_type {model_type:?} (architectures {architectures:?}) is not served by osprey; supported model_types: {}",
        served.join(", ")
    )))
}
