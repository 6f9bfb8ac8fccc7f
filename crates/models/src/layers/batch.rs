//! The batch plumbing every family's forward shares: checking the steps' inputs, laying the sequences
//! out as segments of one flat batch (ids, positions, the token embeddings with injected media rows),
//! and handing back the logits each step asked for while advancing its length.

use osprey_backend::{Backend, Tensor};

use super::Segment;
use crate::error::{Error, Result};
use crate::family::{LogitsWanted, Positions, SeqStep};

/// Rejects token ids outside the vocabulary, position lists of the wrong length and injected rows that
/// do not fit their chunk (user input reaches here: an error, not a panic).
pub(crate) fn check_inputs(steps: &[SeqStep<'_, '_>], vocab: usize, hidden: usize) -> Result<()> {
    for s in steps {
        let n = s.input.tokens.len();
        check_tokens(s.input.tokens, vocab)?;
        check_positions(s.input.positions, n)?;
        for inj in s.input.injected {
            if inj.rows.len() % hidden != 0 || inj.offset + inj.rows.len() / hidden > n {
                return Err(Error::InvalidInput("injected rows do not fit the chunk".into()));
            }
        }
    }
    Ok(())
}

/// Rejects a token id outside the vocabulary.
pub(crate) fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(Error::InvalidInput(format!("token id {t} is outside the vocabulary ({vocab})"))),
        None => Ok(()),
    }
}

/// Rejects an explicit position list whose length is not `n`.
pub(crate) fn check_positions(positions: Positions<'_>, n: usize) -> Result<()> {
    match positions {
        Positions::Explicit(p) if p.len() != n => {
            Err(Error::InvalidInput(format!("{} positions for {n} tokens", p.len())))
        }
        _ => Ok(()),
    }
}

/// Appends the mRoPE positions of `n` tokens at slots `past..`: text ones at `slot + rope_delta` on all
/// three axes, or the explicit list (checked by [`check_positions`]).
pub(crate) fn extend_positions(out: &mut Vec<[i64; 3]>, positions: Positions<'_>, past: usize, n: usize, delta: i64) {
    match positions {
        Positions::Text => out.extend((0..n).map(|i| [(past + i) as i64 + delta; 3])),
        Positions::Explicit(p) => out.extend_from_slice(p),
    }
}

/// A batch laid out flat: each step's segment, every token id and mRoPE position in batch order.
pub(crate) struct Layout {
    pub(crate) segs: Vec<Segment>,
    pub(crate) ids: Vec<u32>,
    pub(crate) positions: Vec<[i64; 3]>,
}

pub(crate) fn layout(steps: &[SeqStep<'_, '_>]) -> Layout {
    let mut l = Layout { segs: Vec::with_capacity(steps.len()), ids: Vec::new(), positions: Vec::new() };
    for s in steps {
        let (past, n) = (s.state.len, s.input.tokens.len());
        l.segs.push(Segment { row: l.ids.len(), len: n, past });
        l.ids.extend_from_slice(s.input.tokens);
        extend_positions(&mut l.positions, s.input.positions, past, n, s.state.rope_delta);
    }
    l
}

/// The token embeddings of the batch `[T, hidden]` with each step's injected media rows in place.
pub(crate) fn embed(
    b: &dyn Backend,
    table: &Tensor,
    steps: &[SeqStep<'_, '_>],
    l: &Layout,
    hidden: usize,
) -> Result<Tensor> {
    let mut x = b.embed(table, &l.ids)?;
    for (s, seg) in steps.iter().zip(&l.segs) {
        for inj in s.input.injected {
            let n = inj.rows.len() / hidden;
            b.write_rows(&mut x, (seg.row + inj.offset) * hidden, &b.upload_f32(inj.rows, &[n, hidden])?, 0..n);
        }
    }
    Ok(x)
}

/// Rows of one head call for sampled rows: a device's decode GEMV takes up to 8 rows, each computed as it
/// would be alone (`linear_gemv`), so batching them changes no bit.
const HEAD_ROWS: usize = 8;

/// Per step: its downloaded logits, and its drawn id when it asked for one.
pub(crate) type Heads = (Vec<Vec<f32>>, Vec<Option<u32>>);

/// Advances every step's length by its tokens and returns, per step, the logits `head(rows)` computes
/// on the backend for the rows it wants, downloaded (an empty vector when none), and with
/// [`LogitsWanted::Sample`] the last row's id drawn on the backend instead: every such step's in one
/// `sample_rows` and one download (each head is still computed for its own rows, so its numerics do
/// not depend on the batch).
pub(crate) fn logits(
    b: &dyn Backend,
    steps: &mut [SeqStep<'_, '_>],
    segs: &[Segment],
    head: impl Fn(&[usize]) -> Result<Tensor>,
) -> Result<Heads> {
    let mut out: Heads = (Vec::with_capacity(steps.len()), vec![None; steps.len()]);
    let (mut sampled_rows, mut settings, mut which) = (Vec::new(), Vec::new(), Vec::new());
    for (i, (s, seg)) in steps.iter_mut().zip(segs).enumerate() {
        let last = seg.row + seg.len.saturating_sub(1)..seg.row + seg.len;
        let rows: Vec<usize> = match s.input.logits {
            LogitsWanted::None => Vec::new(),
            LogitsWanted::Last | LogitsWanted::Sample(_) => last.collect(),
            LogitsWanted::All => (seg.row..seg.row + seg.len).collect(),
        };
        s.state.len += seg.len;
        out.0.push(match (s.input.logits, rows.is_empty()) {
            (_, true) => Vec::new(),
            (LogitsWanted::Sample(r), false) => {
                sampled_rows.extend_from_slice(&rows);
                settings.push(r);
                which.push(i);
                Vec::new()
            }
            (_, false) => b.download_f32(&head(&rows)?)?,
        });
    }
    if !sampled_rows.is_empty() {
        // The sampled rows' head in calls of at most `HEAD_ROWS`: a device's decode GEMV reads the head's
        // weights once for them (not once per sequence: 1 GB a read at Qwen3.5's vocabulary), and each
        // row's logits are those it gets alone.
        let heads = sampled_rows.chunks(HEAD_ROWS).map(&head).collect::<Result<Vec<_>>>()?;
        let heads: Vec<&Tensor> = heads.iter().collect();
        match b.download(&b.sample_rows(&heads, &settings)?)? {
            osprey_backend::HostVec::I32(ids) => which.iter().zip(ids).for_each(|(&i, id)| out.1[i] = Some(id as u32)),
            _ => return Err(crate::Error::Engine("sample_rows returned no i32 ids".into())),
        }
    }
    Ok(out)
}
