//! Speculative decoding with the model's own draft head (multi-token prediction, `mtp.*`): the head
//! drafts `K` tokens autoregressively, one forward of the main model verifies them all, and the longest
//! agreeing prefix plus the main model's own next token are emitted, so a decode step can yield up to
//! `K + 1` tokens per pass over the main weights. It runs inside [`crate::Driver::step`], so the server
//! and `generate` share it: a decode item of a sequence the head can draft for gets up to `K` drafts
//! (fewer when the KV pool has no pages to spare for them), the drafts of all such items are batched
//! through the head, and their verifications ride in the step's one batched forward beside prefill
//! chunks and plain decode items. A decode item that asks for a prefix snapshot runs plain (the state
//! would move past the snapshot point).
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
use osprey_models::{CausalLm, DraftStep, Positions};
use osprey_protocol::runner::{SpecCounters, TokenLogprobs};
use osprey_protocol::RequestError;

use crate::error::{backend_error, engine_error, grammar_error, model_error};
use crate::sampler::{argmax, sample, verify};
use crate::seq::{chunk_positions, grammar_mask, Pending, SeqRec};

/// See [`crate::Driver::override_drafts`].
pub(crate) struct DraftOverride(pub(crate) Box<DraftFn>);

/// Picks a draft from the tokens so far (see [`crate::Driver::override_drafts`]).
pub(crate) type DraftFn = dyn FnMut(&[u32]) -> Option<u32> + Send;

impl std::fmt::Debug for DraftOverride {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DraftOverride")
    }
}

/// The first KV slot the head may write for `rec`: past its last page that another holder (the prefix
/// cache, another sequence) shares. The head never writes a shared page: a private copy would cost a
/// page the scheduler did not plan for, and the page's other holders keep what they had. The entries
/// it skips (the last slot of a page that was cached before the token after it came) only make the
/// next drafts a little worse.
fn first_private_slot(rec: &SeqRec) -> usize {
    let t = rec.state.pages();
    let ps = t.geometry().page_size;
    t.pages().iter().rposition(|p| std::sync::Arc::strong_count(p) > 1).map_or(0, |i| (i + 1) * ps)
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
    // Entries in pages another holder shares are not written (see `first_private_slot`).
    let lo = first_private_slot(rec).max(first);
    if end - 1 > lo {
        let mut rows = stack_rows(b, &parts.iter().collect::<Vec<_>>(), h).map_err(model_error)?;
        if lo > first {
            rows = b.gather_rows(&rows, &(lo - first..rows.rows()).collect::<Vec<_>>()).map_err(backend_error)?;
        }
        let first = lo;
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

/// Drafts for the speculative items of a step, batched: `recs[i]` (its last token sampled, not yet
/// fed) gets `ks[i]` drafts from the head, its pending entries first, then one entry per draft. Returns
/// per item the tokens to verify: the sampled token, then the drafts.
pub(crate) fn draft(
    m: &dyn CausalLm,
    recs: &mut [&mut SeqRec],
    ks: &[usize],
    mut choose: Option<&mut DraftOverride>,
) -> Result<Vec<Vec<u32>>, RequestError> {
    let mut verify: Vec<Vec<u32>> = recs.iter().map(|r| vec![r.tokens[r.state.len()]]).collect();
    let mut steps = Vec::with_capacity(recs.len());
    for r in recs.iter_mut() {
        let n = r.state.len();
        let Pending { mut pos, mut rows } =
            r.pending.take().ok_or_else(|| engine_error("no hidden rows to draft from"))?;
        // `eligible` saw slot n - 1 private; earlier pending slots may sit in a shared page.
        let lo = first_private_slot(r);
        if pos < lo {
            let keep: Vec<usize> = (lo - pos..rows.rows()).collect();
            rows = m.backend().gather_rows(&rows, &keep).map_err(backend_error)?;
            pos = lo;
        }
        let tokens = &r.tokens[pos + 1..=n];
        steps.push(DraftStep { state: &mut r.state, tokens, hidden: rows, start: pos, positions: Positions::Text });
    }
    let mut out = m.draft(&mut steps, false).map_err(model_error)?;
    drop(steps);
    for j in 0..ks.iter().copied().max().unwrap_or(0) {
        // Pick draft j + 1 of every item that wants it, then run one more entry for those that want more.
        let mut hidden = out.hidden.into_iter();
        let mut next = Vec::new();
        for (i, (r, &k)) in recs.iter().zip(ks).enumerate().filter(|(_, (_, &k))| k > j) {
            let mut d = argmax(&out.logits[next.len()]) as u32;
            let h = hidden.next().ok_or_else(|| engine_error("a draft without its hidden row: this is a bug"))?;
            if let Some(DraftOverride(f)) = choose.as_deref_mut() {
                let ctx: Vec<u32> = r.tokens.iter().chain(&verify[i][1..]).copied().collect();
                d = f(&ctx).unwrap_or(d);
            }
            verify[i].push(d);
            next.push((i, k, h));
        }
        let mut steps = Vec::new();
        let more: Vec<(usize, Tensor)> =
            next.into_iter().filter(|&(_, k, _)| k > j + 1).map(|(i, _, h)| (i, h)).collect();
        if more.is_empty() {
            break;
        }
        let mut it = more.into_iter().peekable();
        for (i, r) in recs.iter_mut().enumerate() {
            if it.peek().is_some_and(|(mi, _)| *mi == i) {
                let (_, h) = it.next().expect("peeked");
                let start = r.state.len() + j;
                let tokens = std::slice::from_ref(verify[i].last().expect("a draft"));
                steps.push(DraftStep { state: &mut r.state, tokens, hidden: h, start, positions: Positions::Text });
            }
        }
        out = m.draft(&mut steps, false).map_err(model_error)?;
    }
    Ok(verify)
}

/// Accepts a verified item: `logits` are the verification's rows for `tokens` (the sampled token and
/// the drafts), `hidden` its final normed rows from `row0`. Emits the accepted drafts and one token of
/// the main model's, rewinds the state to them and keeps their hidden rows pending for the head.
pub(crate) fn accept(
    m: &dyn CausalLm,
    rec: &mut SeqRec,
    (logits, tokens): (&[f32], &[u32]),
    (hidden, row0): (&Tensor, usize),
    counters: &mut SpecCounters,
) -> Result<Vec<(u32, Option<TokenLogprobs>)>, RequestError> {
    let k = tokens.len() - 1;
    let n = rec.state.len() - tokens.len();
    let v = logits.len() / tokens.len();
    let plen = rec.prompt.input_ids.len();
    let (mut emitted, mut accepted) = (Vec::new(), 0);
    for j in 0..=k {
        let row = &logits[j * v..(j + 1) * v];
        let allowed = grammar_mask(rec)?;
        let mask = allowed.then_some(&rec.allowed[..]);
        let (prompt, output) = rec.tokens.split_at(plen);
        let (token, ok, lp) = if j < k {
            verify(row, &rec.sampling, prompt, output, &mut rec.rng, mask, tokens[j + 1])
        } else {
            let (t, lp) = sample(row, &rec.sampling, prompt, output, &mut rec.rng, mask);
            (t, false, lp)
        };
        if let Some(mt) = rec.matcher.as_mut() {
            mt.commit(token).map_err(|e| grammar_error(&e))?;
        }
        rec.tokens.push(token);
        emitted.push((token, lp));
        if !ok {
            break;
        }
        accepted += 1;
    }
    // Keep the state of the accepted tokens; their hidden rows wait for the head.
    rec.state.rewind(n + 1 + accepted, k + 1).map_err(model_error)?;
    let b = m.backend().as_ref();
    let rows = b.gather_rows(hidden, &(row0..=row0 + accepted).collect::<Vec<_>>()).map_err(backend_error)?;
    rec.pending = Some(Pending { pos: n, rows });
    let c = counters;
    c.drafted += k as u64;
    c.accepted += accepted as u64;
    c.drafted_at[..k].iter_mut().for_each(|x| *x += 1);
    c.accepted_at[..accepted].iter_mut().for_each(|x| *x += 1);
    c.forwards += 1;
    c.emitted += emitted.len() as u64;
    Ok(emitted)
}

/// Whether `rec`'s work item `[start, end)` may be speculated: a decode step of its last sampled token
/// whose hidden rows the head has pending, the slot of the last of them in a page of its own (the first
/// draft's entry is written there), and no prefix snapshot asked after it (the state moves past `end`).
pub(crate) fn eligible(rec: &SeqRec, (start, end): (usize, usize), sample: bool, snapshot: bool) -> bool {
    sample
        && !snapshot
        && end == start + 1
        && end == rec.tokens.len()
        && rec.pending.as_ref().is_some_and(|p| p.pos + p.rows.rows() == start)
        && first_private_slot(rec) < start
}
