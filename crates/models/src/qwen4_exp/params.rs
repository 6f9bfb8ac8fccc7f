//! The fields `qwen4_exp` adds to the Qwen3.5-MoE text config (transformers 5.23.0
//! `Qwen4ExpTextConfig`), read from the config's extra fields.

use serde_json::{Map, Value};

use super::ngram::NGramSpec;
use crate::config::TextConfig;
use crate::error::{Error, Result};

/// The two token mixers: Gated DeltaNet, or gated attention behind a QSA indexer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    Linear,
    Indexed,
}

/// QSA indexer geometry.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Qsa {
    pub heads: usize,
    pub head_dim: usize,
    /// Complete blocks kept per query (`indexer_budget / indexer_compress_ratio`).
    pub top_blocks: usize,
    /// Tokens per block.
    pub ratio: usize,
}

/// Everything `qwen4_exp` reads beyond [`TextConfig`].
#[derive(Clone, Debug)]
pub(crate) struct Params {
    pub kinds: Vec<Kind>,
    pub hc: usize,
    pub hc_lowrank: usize,
    /// Zero-indexed decoder layers with PLE, in `ple_layer_ids` order (their PLE index).
    pub ple_layers: Vec<usize>,
    pub ple_embed_dim: usize,
    pub ple_conv_kernel: usize,
    pub ngram: NGramSpec,
    pub ngram_pad_to: u64,
    pub qsa: Qsa,
    pub sigmoid_gate: bool,
    pub norm_topk_prob: bool,
}

fn get<'a>(m: &'a Map<String, Value>, k: &str) -> Option<&'a Value> {
    m.get(k).filter(|v| !v.is_null())
}

fn num(m: &Map<String, Value>, k: &str, default: Option<u64>) -> Result<u64> {
    match get(m, k) {
        Some(v) => v.as_u64().ok_or_else(|| Error::Unsupported(format!("{k} = {v} (expected a positive integer)"))),
        None => default.ok_or_else(|| Error::Unsupported(format!("qwen4_exp config lacks {k}"))),
    }
}

impl Params {
    /// Reads and checks the fields (defaults as transformers 5.23.0 gives them).
    pub(crate) fn from_config(c: &TextConfig) -> Result<Self> {
        let m = &c.extra;
        let kinds = match &c.layer_types {
            Some(t) => t
                .iter()
                .map(|k| match k.as_str() {
                    "linear_attention" => Ok(Kind::Linear),
                    "indexed_attention" | "full_attention" => Ok(Kind::Indexed),
                    other => Err(Error::Unsupported(format!("qwen4_exp layer type {other:?}"))),
                })
                .collect::<Result<Vec<_>>>()?,
            None => {
                let every = c.full_attention_interval.unwrap_or(4);
                (0..c.num_hidden_layers)
                    .map(|i| if (i + 1) % every == 0 { Kind::Indexed } else { Kind::Linear })
                    .collect()
            }
        };
        if kinds.len() != c.num_hidden_layers {
            return Err(Error::Unsupported(format!("{} layer types for {} layers", kinds.len(), c.num_hidden_layers)));
        }
        let mut ple_ids: Vec<usize> = match get(m, "ple_layer_ids") {
            Some(Value::Array(a)) => a.iter().filter_map(Value::as_u64).map(|v| v as usize).collect(),
            _ => Vec::new(),
        };
        ple_ids.sort_unstable();
        ple_ids.dedup();
        if ple_ids.iter().any(|&i| i == 0 || i > c.num_hidden_layers) {
            return Err(Error::Unsupported(format!("ple_layer_ids {ple_ids:?} (one-indexed layers)")));
        }
        let gate = get(m, "output_gate_type").and_then(Value::as_str).unwrap_or(&c.hidden_act).to_string();
        if gate != "silu" && gate != "sigmoid" {
            return Err(Error::Unsupported(format!("output_gate_type {gate:?} (silu or sigmoid)")));
        }
        let hc = num(m, "hc_count", Some(4))? as usize;
        if hc < 2 {
            return Err(Error::Unsupported(format!("hc_count {hc} (qwen4_exp needs at least 2 streams)")));
        }
        let eos = c.eos_token_id.as_ref().and_then(|e| e.to_vec().first().copied()).unwrap_or(0);
        let ngram = NGramSpec {
            vocab_size: c.vocab_size,
            ngram_size: num(m, "ngram_size", Some(3))? as usize,
            heads_per_ngram: num(m, "heads_per_ngram", Some(8))? as usize,
            vocab_base: num(m, "ngram_vocab_size_base", Some(20_000_000))?,
            seed: num(m, "seed", Some(1234))?,
            eos,
        };
        if ngram.ngram_size < 2 || ngram.heads_per_ngram == 0 {
            return Err(Error::Unsupported("ngram_size must be >= 2 and heads_per_ngram >= 1".into()));
        }
        let budget = num(m, "indexer_budget", None)? as usize;
        let ratio = num(m, "indexer_compress_ratio", None)? as usize;
        if num(m, "indexer_kv_heads", None)? != 1 || ratio == 0 || !budget.is_multiple_of(ratio) {
            return Err(Error::Unsupported("QSA needs indexer_kv_heads = 1 and a budget in whole blocks".into()));
        }
        let qsa = Qsa {
            heads: num(m, "indexer_n_heads", None)? as usize,
            head_dim: num(m, "indexer_head_dim", None)? as usize,
            top_blocks: budget / ratio,
            ratio,
        };
        if qsa.head_dim < c.rot_dim() {
            return Err(Error::Unsupported("indexer_head_dim is smaller than the rotary dims".into()));
        }
        Ok(Params {
            kinds,
            hc,
            hc_lowrank: num(m, "hc_lowrank", Some(320))? as usize,
            ple_layers: ple_ids.iter().map(|i| i - 1).collect(),
            ple_embed_dim: num(m, "ple_embed_dim", Some(c.hidden_size as u64))? as usize,
            ple_conv_kernel: num(m, "ple_conv_kernel_size", Some(4))? as usize,
            ngram,
            ngram_pad_to: num(m, "make_ngram_vocab_size_divisible_by", Some(128))?.max(1),
            qsa,
            sigmoid_gate: gate == "sigmoid",
            norm_topk_prob: get(m, "norm_topk_prob").and_then(Value::as_bool).unwrap_or(true),
        })
    }
}
