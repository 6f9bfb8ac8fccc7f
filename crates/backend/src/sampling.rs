//! Drawing one token from a row of logits: the one definition the runner's host sampler and every
//! backend's [`CoreOps::sample_rows`](crate::CoreOps::sample_rows) follow.
//!
//! Order (as vLLM): the grammar's mask, the repetition penalty over prompt and output tokens, presence
//! and frequency penalties over output tokens, the logit bias; then temperature (≤ 0: the first index of
//! the maximum, NaN never winning), top-k, top-p, min-p, and one draw with the row's uniform number.
//! Candidates are ordered by value (`f32::total_cmp`), the lower index first on ties.
//!
//! A device computes the same sets with its own summation order (a tree, not this left-to-right loop),
//! so its draw can differ only where the uniform number lies within rounding of a boundary between two
//! candidates' cumulative probabilities, or a cut lies within rounding of top-p.

/// What the penalties and the bias do to one token's logit, in this order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LogitEdit {
    /// The token.
    pub token: u32,
    /// In the prompt or the output, with a repetition penalty set: a positive logit is divided by the
    /// penalty, any other multiplied.
    pub repeat: bool,
    /// Subtracted: presence + frequency × count, for a generated token when either penalty is set.
    pub subtract: Option<f32>,
    /// Added (`logit_bias`).
    pub bias: Option<f32>,
}

/// One row's sampling: the settings, the token edits, the grammar's mask and the row's random number.
#[derive(Clone, Debug, PartialEq)]
pub struct RowSampling {
    /// ≤ 0: greedy.
    pub temperature: f32,
    /// 0: off.
    pub top_k: u32,
    /// 1: off.
    pub top_p: f32,
    /// 0: off.
    pub min_p: f32,
    /// The repetition penalty of the edits that name it.
    pub repetition_penalty: f32,
    /// Each token at most once (built by [`edits`]).
    pub edits: Vec<LogitEdit>,
    /// One bit per token (bit `t % 32` of word `t / 32`): only allowed tokens can be drawn; a token past
    /// the mask's end is not allowed.
    pub allowed: Option<Vec<u32>>,
    /// Uniform in [0, 1): the draw (unused when greedy).
    pub uniform: f64,
}

impl RowSampling {
    /// Greedy: the first index of the maximum.
    pub fn greedy() -> Self {
        RowSampling {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            edits: Vec::new(),
            allowed: None,
            uniform: 0.0,
        }
    }
}

/// The edits of a request's penalties and bias: `seen` (prompt and output tokens) take the repetition
/// penalty when it is not 1; each output token's count the presence and frequency penalties when either
/// is set; `bias` its amounts. Sorted by token, each token once.
pub fn edits(
    seen: impl IntoIterator<Item = u32>,
    output: &[u32],
    (repetition, presence, frequency): (f32, f32, f32),
    bias: &[(u32, f32)],
) -> Vec<LogitEdit> {
    use std::collections::BTreeMap;
    let mut out: BTreeMap<u32, LogitEdit> = BTreeMap::new();
    fn at(out: &mut BTreeMap<u32, LogitEdit>, t: u32) -> &mut LogitEdit {
        out.entry(t).or_insert(LogitEdit { token: t, repeat: false, subtract: None, bias: None })
    }
    if repetition != 1.0 {
        seen.into_iter().for_each(|t| at(&mut out, t).repeat = true);
    }
    if presence != 0.0 || frequency != 0.0 {
        let mut counts: BTreeMap<u32, usize> = BTreeMap::new();
        for &t in output {
            *counts.entry(t).or_default() += 1;
        }
        for (t, c) in counts {
            at(&mut out, t).subtract = Some(presence + frequency * c as f32);
        }
    }
    for &(t, b) in bias {
        let e = at(&mut out, t);
        e.bias = Some(e.bias.map_or(b, |a| a + b));
    }
    out.into_values().collect()
}

/// `logits` after the grammar's mask and the edits (a token past the row is ignored).
pub fn processed(logits: &[f32], s: &RowSampling) -> Vec<f32> {
    let mut l = logits.to_vec();
    if let Some(bits) = &s.allowed {
        for (t, x) in l.iter_mut().enumerate() {
            if bits.get(t / 32).is_none_or(|w| w >> (t % 32) & 1 == 0) {
                *x = f32::NEG_INFINITY;
            }
        }
    }
    for e in &s.edits {
        let Some(x) = l.get_mut(e.token as usize) else { continue };
        if e.repeat {
            *x = if *x > 0.0 { *x / s.repetition_penalty } else { *x * s.repetition_penalty };
        }
        if let Some(d) = e.subtract {
            *x -= d;
        }
        // After the grammar mask: a biased token the grammar forbids stays impossible (-inf + b).
        if let Some(b) = e.bias {
            *x += b;
        }
    }
    l
}

/// The first index of the maximum; NaN never wins (a row of NaN gives 0).
pub fn first_max(l: &[f32]) -> usize {
    let mut best: Option<usize> = None;
    for (i, v) in l.iter().enumerate() {
        if !v.is_nan() && best.is_none_or(|b| *v > l[b]) {
            best = Some(i);
        }
    }
    best.unwrap_or(0)
}

/// The tokens of processed logits `l` that can be drawn and their probabilities (normalised before the
/// top-p and min-p cuts, so they may sum to less than 1), best first: temperature, top-k, top-p, min-p.
pub fn distribution(l: &[f32], s: &RowSampling) -> (Vec<usize>, Vec<f64>) {
    let mut cand: Vec<(usize, f32)> = l.iter().enumerate().map(|(i, x)| (i, x / s.temperature)).collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    if s.top_k > 0 {
        cand.truncate(s.top_k as usize);
    }
    let max = cand[0].1;
    let mut probs: Vec<f64> = cand.iter().map(|(_, x)| ((x - max) as f64).exp()).collect();
    let sum: f64 = probs.iter().sum();
    probs.iter_mut().for_each(|x| *x /= sum);
    if s.top_p < 1.0 {
        let mut acc = 0.0;
        let mut keep = probs.len();
        for (i, q) in probs.iter().enumerate() {
            acc += q;
            if acc >= s.top_p as f64 {
                keep = i + 1;
                break;
            }
        }
        probs.truncate(keep);
        cand.truncate(keep);
    }
    if s.min_p > 0.0 {
        let floor = probs[0] * s.min_p as f64;
        let keep = probs.iter().take_while(|&&q| q >= floor).count().max(1);
        probs.truncate(keep);
        cand.truncate(keep);
    }
    (cand.into_iter().map(|(i, _)| i).collect(), probs)
}

/// The candidate a uniform number `u` in [0, 1) draws from `probs` (they need not sum to 1): the first
/// whose cumulative probability exceeds `u` × their total, the last when rounding leaves none.
pub fn pick(cand: &[usize], probs: &[f64], u: f64) -> usize {
    let total: f64 = probs.iter().sum();
    let mut u = u * total;
    for (i, q) in probs.iter().enumerate() {
        if u < *q {
            return cand[i];
        }
        u -= q;
    }
    cand[cand.len() - 1]
}

/// The token row `logits` draws under `s`.
pub fn sample_row(logits: &[f32], s: &RowSampling) -> u32 {
    let l = processed(logits, s);
    let token = if s.temperature <= 0.0 {
        first_max(&l)
    } else {
        let (cand, probs) = distribution(&l, s);
        pick(&cand, &probs, s.uniform)
    };
    token as u32
}

/// Refuses `sample_rows` settings that do not name each row of `logits` once (a bug in the caller).
pub fn check_rows(logits: &[&crate::Tensor], rows: &[&RowSampling]) -> crate::Result<()> {
    let n: usize = logits.iter().map(|t| t.rows()).sum();
    if n == rows.len() {
        Ok(())
    } else {
        Err(crate::BackendError::Device(format!(
            "sample_rows: {n} rows of logits, {} settings: this is a bug",
            rows.len()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn edits_merge_penalties_and_bias_per_token() {
        let e = edits([5, 2, 5], &[2, 2, 9], (1.3, 0.5, 0.25), &[(9, 1.0), (4, -2.0)]);
        let tokens: Vec<u32> = e.iter().map(|e| e.token).collect();
        assert_eq!(tokens, vec![2, 4, 5, 9]);
        assert_eq!(e[0], LogitEdit { token: 2, repeat: true, subtract: Some(0.5 + 0.25 * 2.0), bias: None });
        assert_eq!(e[1], LogitEdit { token: 4, repeat: false, subtract: None, bias: Some(-2.0) });
        assert_eq!(e[2], LogitEdit { token: 5, repeat: true, subtract: None, bias: None });
        assert_eq!(e[3], LogitEdit { token: 9, repeat: false, subtract: Some(0.75), bias: Some(1.0) });
        // No penalty set: only the bias.
        assert_eq!(edits([1, 2], &[1], (1.0, 0.0, 0.0), &[]), vec![]);
    }

    #[test]
    fn pick_walks_the_cumulative_probabilities() {
        let (cand, probs) = (vec![7, 3, 1], vec![0.5, 0.25, 0.25]);
        assert_eq!(pick(&cand, &probs, 0.0), 7);
        assert_eq!(pick(&cand, &probs, 0.49), 7);
        assert_eq!(pick(&cand, &probs, 0.5), 3);
        assert_eq!(pick(&cand, &probs, 0.99), 1);
        assert_eq!(first_max(&[f32::NAN, 1.0, 3.0, 3.0]), 2);
        assert_eq!(first_max(&[f32::NAN; 3]), 0);
    }
}
