//! Speculative decoding with the model's own draft head (multi-token prediction, `mtp.*`): the head
//! drafts `K` tokens autoregressively, one forward of the main model verifies them all, and the longest
//! agreeing prefix plus the main model's own next token are emitted, so a decode step can yield up to
//! `K + 1` tokens per pass over the main weights.
//!
//! - The head's entries: entry `i` pairs token `i + 1` with the main model's final normed hidden state at
//!   `i`, in the head's own plane of the sequence's KV pages at slot `i`. Each main forward keeps its
//!   hidden rows; the entries they complete are fed to the head after it ([`Pending`] holds the rows whose
//!   next token is not known yet). Prefill chunks feed the head too, so drafting starts from a full
//!   context.
//! - Verification runs the `K + 1` tokens with the numerics of single-token steps and keeps the Gated
//!   DeltaNet state after each ([`osprey_models::ForwardOptions::verify`]); the state is then rewound to
//!   the accepted length ([`osprey_models::SeqState::rewind`]): no recomputation.
//! - Acceptance: [`crate::sampler::verify`], row by row, each row's grammar mask and penalties computed
//!   from the tokens accepted before it. Greedy answers are the non-speculative ones; sampled ones keep
//!   the request's distribution (the draws differ, so a seeded request's text differs from a
//!   non-speculative run's).

use osprey_models::backend::Tensor;
use osprey_models::layers::stack_rows;
use osprey_models::{CausalLm, DraftStep, ForwardOptions, LogitsWanted, Positions, SeqInput, SeqStep};
use osprey_protocol::runner::TokenLogprobs;
use osprey_protocol::{RequestError, SeqId};

use crate::driver::{
    backend_error, chunk_positions, engine_error, grammar_error, grammar_mask, model_error, reserve_error, Driver,
    SeqRec,
};
use crate::sampler::{argmax, sample, verify};

/// The most draft tokens per step (`--speculative-tokens`).
pub const MAX_SPECULATIVE_TOKENS: usize = 4;

/// The main model's hidden rows for slots `[pos, pos + rows)` whose head entries wait for the token
/// after each.
#[derive(Debug)]
pub(crate) struct Pending {
    pos: usize,
    rows: Tensor,
}

/// See [`Driver::override_drafts`].
pub(crate) struct DraftOverride(pub(crate) Box<DraftFn>);

/// Picks a draft from the tokens so far (see [`Driver::override_drafts`]).
pub(crate) type DraftFn = dyn FnMut(&[u32]) -> Option<u32> + Send;

impl std::fmt::Debug for DraftOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DraftOverride")
    }
}

/// Speculation counters since start.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpecCounters {
    /// Tokens drafted.
    pub drafted: u64,
    /// Drafts accepted.
    pub accepted: u64,
    /// Per draft position (0 = the first draft of a step): drafts proposed there.
    pub drafted_at: Vec<u64>,
    /// Per draft position: drafts accepted there.
    pub accepted_at: Vec<u64>,
    /// Verification forwards of the main model.
    pub forwards: u64,
    /// Tokens emitted by them.
    pub emitted: u64,
}

impl SpecCounters {
    /// Tokens per main-model forward in the speculative steps.
    pub fn tokens_per_forward(&self) -> f64 {
        self.emitted as f64 / self.forwards.max(1) as f64
    }

    /// Accepted drafts over drafted ones.
    pub fn acceptance(&self) -> f64 {
        self.accepted as f64 / self.drafted.max(1) as f64
    }
}

/// Feeds the head the entries a main forward over tokens `[start, end)` completed (its hidden rows are
/// rows `row0..` of `hidden`), and keeps the last row pending.
pub(crate) fn feed_head(
    m: &dyn CausalLm,
    rec: &mut SeqRec,
    (start, end): (usize, usize),
    hidden: &Tensor,
    row0: usize,
) -> Result<(), RequestError> {
    let b = m.backend().as_ref();
    let h = m.info().hidden_size;
    // A hit or a recomputation starts without the rows before `start`: its entries start there.
    let (first, mut parts) = match rec.pending.take() {
        Some(p) if p.pos + p.rows.rows() == start => (p.pos, vec![p.rows]),
        _ => (start, Vec::new()),
    };
    let n = end - start;
    if n > 1 {
        parts.push(b.gather_rows(hidden, &(row0..row0 + n - 1).collect::<Vec<_>>()).map_err(backend_error)?);
    }
    let last = b.gather_rows(hidden, &[row0 + n - 1]).map_err(backend_error)?;
    if end - 1 > first {
        let rows = stack_rows(b, &parts.iter().collect::<Vec<_>>(), h).map_err(model_error)?;
        let positions = chunk_positions(&rec.prompt, first, end - 1);
        let step = DraftStep {
            state: &mut rec.state,
            tokens: &rec.tokens[first + 1..end],
            hidden: rows,
            start: first,
            positions: positions.as_deref().map_or(Positions::Text, Positions::Explicit),
        };
        m.draft(&mut [step], false).map_err(model_error)?;
    }
    rec.pending = Some(Pending { pos: end - 1, rows: last });
    Ok(())
}

impl Driver {
    /// One speculative step of sequence `seq` (its last token sampled, not yet fed): `k` drafts, one
    /// verification, the rewind. Returns the emitted tokens (at least one); it stops early after a token
    /// of `stop` or at `budget` tokens.
    pub(crate) fn speculate(
        &mut self,
        seq: SeqId,
        k: usize,
        budget: usize,
        stop: &[u32],
    ) -> Result<Vec<(u32, Option<TokenLogprobs>)>, RequestError> {
        let mut rec = self.seqs.remove(&seq).ok_or_else(|| engine_error("unknown sequence: this is a bug"))?;
        let out = self.speculate_rec(&mut rec, k, budget, stop);
        self.seqs.insert(seq, rec);
        out
    }

    fn speculate_rec(
        &mut self,
        rec: &mut SeqRec,
        k: usize,
        budget: usize,
        stop: &[u32],
    ) -> Result<Vec<(u32, Option<TokenLogprobs>)>, RequestError> {
        let m: &dyn CausalLm = &self.model;
        let n = rec.state.len();
        if rec.tokens.len() != n + 1 {
            return Err(engine_error("speculation out of order with the sequence: this is a bug"));
        }
        self.pool.reserve(rec.state.pages_mut(), n + k + 1).map_err(reserve_error)?;
        // 1. Drafts: the pending entries (the last one pairs the sampled token), then one entry per draft.
        let Pending { pos, rows } = rec.pending.take().ok_or_else(|| engine_error("no hidden rows to draft from"))?;
        let step = DraftStep {
            state: &mut rec.state,
            tokens: &rec.tokens[pos + 1..=n],
            hidden: rows,
            start: pos,
            positions: Positions::Text,
        };
        let mut out = m.draft(&mut [step], false).map_err(model_error)?;
        let mut verify_tokens = vec![rec.tokens[n]];
        for j in 0..k {
            let mut d = argmax(&out.logits[0]) as u32;
            if let Some(DraftOverride(f)) = self.draft_override.as_mut() {
                let ctx: Vec<u32> = rec.tokens.iter().chain(&verify_tokens[1..]).copied().collect();
                d = f(&ctx).unwrap_or(d);
            }
            verify_tokens.push(d);
            if j + 1 < k {
                let hidden = out.hidden.remove(0);
                let step =
                    DraftStep { state: &mut rec.state, tokens: &[d], hidden, start: n + j, positions: Positions::Text };
                out = m.draft(&mut [step], false).map_err(model_error)?;
            }
        }
        // 2. One verification forward of the sampled token and the drafts.
        let positions = chunk_positions(&rec.prompt, n, n + k + 1);
        let input = SeqInput {
            tokens: &verify_tokens,
            positions: positions.as_deref().map_or(Positions::Text, Positions::Explicit),
            injected: &[],
            logits: LogitsWanted::All,
        };
        let opts = ForwardOptions { keep_hidden: true, verify: &[true], ..ForwardOptions::default() };
        let fwd = m.forward_with(&mut [SeqStep { state: &mut rec.state, input }], &opts).map_err(model_error)?;
        let logits = &fwd.logits[0];
        let v = logits.len() / (k + 1);
        // 3. Accept row by row.
        let plen = rec.prompt.input_ids.len();
        let (mut emitted, mut accepted) = (Vec::new(), 0);
        for j in 0..=k {
            let row = &logits[j * v..(j + 1) * v];
            let allowed = grammar_mask(rec)?;
            let mask = allowed.then_some(&rec.allowed[..]);
            let (prompt, output) = rec.tokens.split_at(plen);
            let (token, ok, lp) = if j < k {
                verify(row, &rec.sampling, prompt, output, &mut rec.rng, mask, verify_tokens[j + 1])
            } else {
                let (t, lp) = sample(row, &rec.sampling, prompt, output, &mut rec.rng, mask);
                (t, false, lp)
            };
            if let Some(mt) = rec.matcher.as_mut() {
                mt.commit(token).map_err(|e| grammar_error(&e))?;
            }
            rec.tokens.push(token);
            emitted.push((token, lp));
            accepted += usize::from(ok);
            if !ok || stop.contains(&token) || emitted.len() >= budget {
                break;
            }
        }
        // 4. Keep the state of the accepted tokens; their hidden rows wait for the head.
        let len = n + 1 + accepted;
        rec.state.rewind(len, k + 1).map_err(model_error)?;
        let hidden = fwd.last_hidden.ok_or_else(|| engine_error("no hidden rows kept: this is a bug"))?;
        let b = m.backend().as_ref();
        let rows = b.gather_rows(&hidden, &(0..=accepted).collect::<Vec<_>>()).map_err(backend_error)?;
        rec.pending = Some(Pending { pos: n, rows });
        rec.rows.iter_mut().for_each(|r| *r = None);
        let c = &mut self.spec_counters;
        c.drafted += k as u64;
        c.accepted += accepted as u64;
        c.drafted_at.resize(c.drafted_at.len().max(k), 0);
        c.accepted_at.resize(c.drafted_at.len(), 0);
        c.drafted_at[..k].iter_mut().for_each(|x| *x += 1);
        c.accepted_at[..accepted].iter_mut().for_each(|x| *x += 1);
        c.forwards += 1;
        c.emitted += emitted.len() as u64;
        Ok(emitted)
    }
}
