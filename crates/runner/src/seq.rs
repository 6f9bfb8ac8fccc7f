//! A running sequence's record (its state, tokens, sampling, grammar position, media rows and draft-head
//! rows), and what the driver and the speculative path both do with one: its grammar mask and a chunk's
//! mRoPE positions.

use std::sync::Arc;
use std::time::Instant;

use osprey_models::backend::Tensor;
use osprey_models::SeqState;
use osprey_protocol::constraint::TokenMatcher;
use osprey_protocol::runner::GrammarCounters;
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_protocol::RequestError;

use crate::error::{engine_error, grammar_error};
use crate::sampler::Rng;

/// Vision rows of a prompt's media items (shared; `None` until fetched).
pub(crate) type MediaRows = Vec<Option<Arc<Vec<f32>>>>;

#[derive(Debug)]
pub(crate) struct SeqRec {
    pub(crate) state: SeqState,
    pub(crate) prompt: Arc<PreparedPrompt>,
    /// Prompt tokens followed by generated ones.
    pub(crate) tokens: Vec<u32>,
    pub(crate) sampling: SamplingParams,
    pub(crate) rng: Rng,
    /// Where the sequence stands in its grammar (constrained requests).
    pub(crate) matcher: Option<Box<dyn TokenMatcher>>,
    /// The grammar's allowed-token bits (reused between steps).
    pub(crate) allowed: Vec<u32>,
    /// Vision rows per media item, fetched on first need, dropped when the prefill ends.
    pub(crate) rows: MediaRows,
    /// With speculation: hidden rows waiting for the draft head.
    pub(crate) pending: Option<Pending>,
    /// Pages `[0, pages_reported)` are in the prefix cache or were sent with an earlier snapshot.
    pub(crate) pages_reported: usize,
    /// Masks computed for this sequence since the driver last collected them.
    pub(crate) masks: GrammarCounters,
}

/// The main model's hidden rows for slots `[pos, pos + rows)` whose head entries wait for the token
/// after each.
#[derive(Debug)]
pub(crate) struct Pending {
    pub(crate) pos: usize,
    pub(crate) rows: Tensor,
}

/// Fills `rec.allowed` from its grammar (counted and timed in `rec.masks`); `false` when unconstrained.
pub(crate) fn grammar_mask(rec: &mut SeqRec) -> Result<bool, RequestError> {
    let Some(m) = rec.matcher.as_mut() else { return Ok(false) };
    let t = Instant::now();
    m.allowed(&mut rec.allowed).map_err(|e| grammar_error(&e))?;
    rec.masks.nanos += t.elapsed().as_nanos() as u64;
    rec.masks.masks += 1;
    if rec.allowed.iter().all(|&w| w == 0) {
        return Err(engine_error("the output format allows no token here"));
    }
    Ok(true)
}

/// Explicit mRoPE positions of tokens `[start, end)` of a prompt with media, `None` for plain text ones.
/// A preempted sequence is recomputed from its prompt and the tokens it had generated, so a chunk can
/// cross the prompt's end: the generated tokens after it are text at `t + rope_delta` on all three axes,
/// exactly as they were fed the first time, one decode step each.
pub(crate) fn chunk_positions(prompt: &PreparedPrompt, start: usize, end: usize) -> Option<Vec<[i64; 3]>> {
    let p = prompt.positions.as_ref()?;
    if start >= p.len() {
        return None;
    }
    let text = (p.len().max(start)..end).map(|t| [t as i64 + prompt.rope_delta; 3]);
    Some(p[start..end.min(p.len())].iter().copied().chain(text).collect())
}
