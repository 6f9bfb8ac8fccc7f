//! Tensor naming the Qwen MoE families share (`qwen4_exp` inherits Qwen3.5-MoE's layout): where the
//! decoder's tensors live, where the routed experts are, and which linears `osprey quantize` may take.

use crate::checkpoint::Checkpoint;
use crate::config::ModelConfig;
use crate::entry::ExpertLayout;
use crate::error::Result;

/// Where the decoder's tensors live: `model.language_model.` in the multimodal (and Hub) layout,
/// `model.` in checkpoints saved from a text-only `*ForCausalLM`.
pub(crate) fn text_prefix(ck: &Checkpoint) -> &'static str {
    if ck.contains("model.language_model.embed_tokens.weight") {
        "model.language_model."
    } else {
        "model."
    }
}

/// The routed experts: one MoE block per decoder layer, then the draft head's (`mtp.*`) when the
/// checkpoint has one.
pub(crate) fn expert_layout(cfg: &ModelConfig, ck: &Checkpoint) -> Result<Option<ExpertLayout>> {
    let Some(moe) = cfg.text.moe()? else { return Ok(None) };
    let p = text_prefix(ck);
    let mut prefixes: Vec<String> = (0..cfg.text.num_hidden_layers).map(|i| format!("{p}layers.{i}.mlp")).collect();
    if cfg.text.mtp_num_hidden_layers > 0 && ck.contains("mtp.layers.0.mlp.gate.weight") {
        prefixes.push("mtp.layers.0.mlp".into());
    }
    Ok(Some(ExpertLayout {
        prefixes,
        num_experts: moe.num_experts,
        hidden: cfg.text.hidden_size,
        intermediate: moe.intermediate,
    }))
}

/// A routed expert's projection in the Hub layout (one tensor per expert).
pub(crate) fn is_routed_expert(name: &str) -> bool {
    name.contains(".mlp.experts.") && name.ends_with("_proj.weight") && !name.contains("gate_up_proj")
}

/// A decoder linear `--all-linear` may quantise: a 2-D `layers.*.weight` that is not a router, the
/// shared-expert gate, an embedding, `lm_head`, a norm, a convolution, the vision tower, nor one of the
/// family's own `excluded` name parts.
pub(crate) fn eligible_linear(name: &str, shape: &[usize], excluded: &[&str]) -> bool {
    let always = ["embed_tokens", "lm_head", "visual", ".mlp.gate.weight", "shared_expert_gate", "conv1d", "norm"];
    shape.len() == 2
        && name.ends_with(".weight")
        && name.contains("layers.")
        && !always.iter().chain(excluded).any(|x| name.contains(x))
}
