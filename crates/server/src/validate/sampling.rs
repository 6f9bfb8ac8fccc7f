//! The generation settings every front end shares: token limit, sampling, stop strings, deadline.

use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::ErrorCode;

use super::{bad, Common, GenParams, Stop};
use crate::config::ServerConfig;
use crate::error::ApiError;

fn range(v: Option<f32>, lo: f32, hi: f32, default: f32, name: &str) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x),
        Some(x) => Err(bad(ErrorCode::InvalidRequest, format!("{name} must be in [{lo}, {hi}], got {x}"), name)),
    }
}

/// Most entries `logit_bias` may have (OpenAI's limit is 300; a bias per entry costs one add per
/// sampled token).
pub const MAX_LOGIT_BIAS: usize = 1024;

/// `logit_bias` checked: token ids below the vocabulary, biases finite in [-100, 100] (OpenAI's range),
/// at most [`MAX_LOGIT_BIAS`] of them.
fn logit_bias(
    m: Option<&serde_json::Map<String, serde_json::Value>>,
    vocab: usize,
) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(m) = m else { return Ok(Vec::new()) };
    let p = "logit_bias";
    if m.len() > MAX_LOGIT_BIAS {
        return Err(bad(
            ErrorCode::InvalidRequest,
            format!("logit_bias has {} entries; at most {MAX_LOGIT_BIAS}", m.len()),
            p,
        ));
    }
    let mut out = Vec::with_capacity(m.len());
    for (k, v) in m {
        let id = k.parse::<u32>().ok().filter(|&id| (id as usize) < vocab).ok_or_else(|| {
            bad(
                ErrorCode::InvalidRequest,
                format!(
                    "logit_bias key {} is not a token id below the vocabulary size {vocab}",
                    crate::error::shown(Some(k))
                ),
                p,
            )
        })?;
        let b = v.as_f64().filter(|b| b.is_finite() && (-100.0..=100.0).contains(b)).ok_or_else(|| {
            bad(ErrorCode::InvalidRequest, format!("logit_bias for token {id} must be a number in [-100, 100]"), p)
        })?;
        out.push((id, b as f32));
    }
    // "1" and "01" name one token: the first given counts.
    out.sort_by_key(|&(id, _)| id);
    out.dedup_by_key(|e| e.0);
    Ok(out)
}

pub(super) fn common(c: &Common, cfg: &ServerConfig, logprobs: Option<usize>) -> Result<GenParams, ApiError> {
    if let Some(m) = &c.model {
        if m != &cfg.model_id {
            return Err(ApiError::new(
                ErrorCode::ModelNotFound,
                format!("the model `{m}` does not exist; this server serves `{}`", cfg.model_id),
            )
            .param("model"));
        }
    }
    if c.n.unwrap_or(1) != 1 {
        return Err(bad(ErrorCode::UnsupportedParameter, "only n = 1 is supported", "n"));
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => None,
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => {
            return Err(bad(ErrorCode::InvalidRequest, format!("max_tokens must be at least 1, got {n}"), "max_tokens"))
        }
    };
    // Bounded by the context and the KV pool once the prompt is known (`Limits::budget`).
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(bad(ErrorCode::InvalidRequest, format!("top_k must be -1, 0 or positive, got {k}"), "top_k"))
        }
    };
    let top_p = range(c.top_p, 0.0, 1.0, 1.0, "top_p")?;
    if top_p == 0.0 {
        return Err(bad(ErrorCode::InvalidRequest, "top_p must be greater than 0", "top_p"));
    }
    let sampling = SamplingParams {
        temperature: range(c.temperature, 0.0, 2.0, 1.0, "temperature")?,
        top_p,
        top_k,
        min_p: range(c.min_p, 0.0, 1.0, 0.0, "min_p")?,
        seed: c.seed,
        repetition_penalty: range(c.repetition_penalty, 0.01, 10.0, 1.0, "repetition_penalty")?,
        presence_penalty: range(c.presence_penalty, -2.0, 2.0, 0.0, "presence_penalty")?,
        frequency_penalty: range(c.frequency_penalty, -2.0, 2.0, 0.0, "frequency_penalty")?,
        logit_bias: logit_bias(c.logit_bias.as_ref(), cfg.vocab_size)?,
        logprobs,
        constraint: None,
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(bad(ErrorCode::InvalidRequest, "stop takes up to 4 non-empty strings", "stop"));
    }
    let deadline = match c.deadline_secs {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            return Err(bad(
                ErrorCode::InvalidRequest,
                format!("deadline_secs must be positive, got {d}"),
                "deadline_secs",
            ))
        }
        own => match (own, cfg.request_deadline_secs) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
    }
    .map(|s| std::time::Duration::from_secs_f64(s.min(1e9)));
    Ok(GenParams {
        sampling,
        max_tokens,
        stop,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        ignore_eos: c.ignore_eos,
        deadline,
        tools: None,
    })
}
