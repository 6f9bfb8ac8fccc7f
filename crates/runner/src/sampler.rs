//! Sampling: penalties, temperature, top-k, top-p, min-p, seeded randomness, logprobs.
//!
//! The rule is `osprey_backend::sampling`'s, the one a device's `sample_rows` follows (order as vLLM:
//! repetition penalty over prompt + output tokens, presence/frequency penalties over output tokens, the
//! bias, then temperature (0 = greedy), top-k, top-p, min-p, and a draw); this module turns a request's
//! settings into a row's ([`row_settings`]) and draws on the host. A draw takes one number from the
//! request's generator, on the host or the device alike, so a seeded request draws the same stream
//! wherever it samples. Reported logprobs are the log-softmax of the model's raw logits (vLLM's default
//! `raw_logprobs`), so they do not depend on the sampling settings.

use osprey_models::backend::sampling::{self as rule, RowSampling};

use osprey_protocol::runner::TokenLogprobs;
use osprey_protocol::scheduler::SamplingParams;

/// A small seeded generator (splitmix64): reproducible draws per request seed.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// From a seed.
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    }
}

fn log_softmax(logits: &[f32]) -> Vec<f32> {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = max + logits.iter().map(|l| (l - max).exp()).sum::<f32>().ln();
    logits.iter().map(|l| l - lse).collect()
}

/// Whether a device can draw for `p` where the logits are (one id back instead of the logits): always,
/// but when the request wants logprobs, which the host computes from the logits.
pub(crate) fn device_can_draw(p: &SamplingParams) -> bool {
    p.logprobs.is_none()
}

/// A request's settings for the next token as the rule takes them: its penalties as edits over `prompt`
/// and `output`, the grammar's mask, and the draw `uniform` (in [0, 1); unused when greedy).
pub(crate) fn row_settings(
    p: &SamplingParams,
    (prompt, output): (&[u32], &[u32]),
    allowed: Option<&[u32]>,
    uniform: f64,
) -> RowSampling {
    let penalties = (p.repetition_penalty, p.presence_penalty, p.frequency_penalty);
    RowSampling {
        temperature: p.temperature,
        top_k: u32::try_from(p.top_k).unwrap_or(u32::MAX),
        top_p: p.top_p,
        min_p: p.min_p,
        repetition_penalty: p.repetition_penalty,
        edits: rule::edits(prompt.iter().chain(output).copied(), output, penalties, &p.logit_bias),
        allowed: allowed.map(<[u32]>::to_vec),
        uniform,
    }
}

/// The draw's uniform number for `p`: one from the generator when sampling, none when greedy.
pub(crate) fn uniform_for(p: &SamplingParams, rng: &mut Rng) -> f64 {
    if p.temperature > 0.0 {
        rng.uniform()
    } else {
        0.0
    }
}

pub(crate) fn argmax(v: &[f32]) -> usize {
    // First index of the maximum (torch.argmax's tie rule).
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best
}

/// Samples one token from `logits` (raw model output for the last position); with `allowed` (one bit
/// per token, from a grammar), only allowed tokens can be drawn. Reported logprobs stay the model's.
pub fn sample(
    logits: &[f32],
    p: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    rng: &mut Rng,
    allowed: Option<&[u32]>,
) -> (u32, Option<TokenLogprobs>) {
    let s = row_settings(p, (prompt, output), allowed, uniform_for(p, rng));
    let token = rule::sample_row(logits, &s);
    (token, logprobs(logits, p, token as usize))
}

/// Verifies a drafted token against the model's logits at its position (speculative decoding): the
/// token to emit there and whether it is the draft. Greedy: the argmax, accepted when it is the draft.
/// Sampling, with the standard rejection rule for a draft proposed with certainty (the draft head's
/// argmax): the draft is kept with probability p(draft) under the request's processed distribution p
/// (penalties, grammar, temperature, top-k, top-p, min-p), else a token is drawn from p with the draft
/// removed, renormalised. Either way the emitted token is distributed exactly as p.
#[allow(clippy::too_many_arguments)]
pub fn verify(
    logits: &[f32],
    p: &SamplingParams,
    prompt: &[u32],
    output: &[u32],
    rng: &mut Rng,
    allowed: Option<&[u32]>,
    draft: u32,
) -> (u32, bool, Option<TokenLogprobs>) {
    let s = row_settings(p, (prompt, output), allowed, 0.0);
    let l = rule::processed(logits, &s);
    let token = if p.temperature <= 0.0 {
        rule::first_max(&l)
    } else {
        let (cand, probs) = rule::distribution(&l, &s);
        let total: f64 = probs.iter().sum();
        let pd = cand.iter().zip(&probs).find(|(&c, _)| c == draft as usize).map_or(0.0, |(_, &q)| q / total);
        if rng.uniform() < pd {
            draft as usize
        } else {
            let (cand, probs): (Vec<usize>, Vec<f64>) =
                cand.into_iter().zip(probs).filter(|&(c, _)| c != draft as usize).unzip();
            // Nothing else can be drawn: p(draft) was 1 up to rounding.
            if cand.is_empty() {
                draft as usize
            } else {
                rule::pick(&cand, &probs, rng.uniform())
            }
        }
    };
    (token as u32, token == draft as usize, logprobs(logits, p, token))
}

/// The reported logprobs of `token` (the model's raw log-softmax), when asked for.
fn logprobs(logits: &[f32], p: &SamplingParams, token: usize) -> Option<TokenLogprobs> {
    let n = p.logprobs?.min(logits.len());
    let lp = log_softmax(logits);
    let mut idx: Vec<usize> = (0..lp.len()).collect();
    idx.sort_by(|&a, &b| lp[b].total_cmp(&lp[a]).then(a.cmp(&b)));
    Some(TokenLogprobs { logprob: lp[token], top: idx[..n].iter().map(|&i| (i as u32, lp[i])).collect() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_penalties_and_logprobs() {
        let logits = [1.0f32, 3.0, 2.0, -1.0];
        let greedy = SamplingParams { temperature: 0.0, logprobs: Some(2), ..SamplingParams::default() };
        let (t, lp) = sample(&logits, &greedy, &[], &[], &mut Rng::new(1), None);
        assert_eq!(t, 1);
        let lp = lp.expect("logprobs");
        let lse = (1f32.exp() + 3f32.exp() + 2f32.exp() + (-1f32).exp()).ln();
        assert!((lp.logprob - (3.0 - lse)).abs() < 1e-6);
        assert_eq!(lp.top.iter().map(|x| x.0).collect::<Vec<_>>(), vec![1, 2]);
        // Presence penalty 1.5 on token 1 (already generated) makes token 2 the argmax.
        let pen = SamplingParams { temperature: 0.0, presence_penalty: 1.5, ..SamplingParams::default() };
        assert_eq!(sample(&logits, &pen, &[], &[1], &mut Rng::new(1), None).0, 2);
        // Repetition penalty 4 on prompt token 1: 3/4 < 2.
        let rep = SamplingParams { temperature: 0.0, repetition_penalty: 4.0, ..SamplingParams::default() };
        assert_eq!(sample(&logits, &rep, &[1], &[], &mut Rng::new(1), None).0, 2);
        // A grammar mask allowing tokens 0 and 3 only: greedy takes 0, sampling never leaves {0, 3}, and
        // logprobs stay the model's.
        let mask = [0b1001u32];
        let (t, lp) = sample(&logits, &greedy, &[], &[], &mut Rng::new(1), Some(&mask));
        assert_eq!(t, 0);
        assert!((lp.expect("logprobs").logprob - (1.0 - lse)).abs() < 1e-6);
        let hot = SamplingParams { temperature: 2.0, ..SamplingParams::default() };
        assert!((0..50).all(|s| [0, 3].contains(&sample(&logits, &hot, &[], &[], &mut Rng::new(s), Some(&mask)).0)));
        // logit_bias (issue 49: it was accepted and ignored): +5 on token 3 makes it the argmax; -100 on
        // token 1 keeps it out of hot draws; a biased token the grammar forbids stays forbidden.
        let bias = SamplingParams { temperature: 0.0, logit_bias: vec![(3, 5.0)], ..SamplingParams::default() };
        assert_eq!(sample(&logits, &bias, &[], &[], &mut Rng::new(1), None).0, 3);
        let ban = SamplingParams { temperature: 2.0, logit_bias: vec![(1, -100.0)], ..SamplingParams::default() };
        assert!((0..50).all(|s| sample(&logits, &ban, &[], &[], &mut Rng::new(s), None).0 != 1));
        let forbidden = SamplingParams { temperature: 0.0, logit_bias: vec![(1, 100.0)], ..SamplingParams::default() };
        assert_eq!(sample(&logits, &forbidden, &[], &[], &mut Rng::new(1), Some(&mask)).0, 0);
    }

    /// The rejection rule keeps the request's distribution whatever the draft: on a six-token vocabulary
    /// with top-k cutting one token, for every draft (the cut one included), 60,000 verifications are
    /// compared with the processed distribution by a chi-square test at p = 1e-4 (critical value 23.51 for
    /// the four degrees of freedom of five possible tokens). Accepting every draft, or never, fails it.
    #[test]
    fn verification_keeps_the_sampling_distribution_for_any_draft() {
        let logits = [1.2f32, 0.3, -0.5, 2.0, 0.9, -2.5];
        let p = SamplingParams { temperature: 0.9, top_k: 5, ..SamplingParams::default() };
        let s = row_settings(&p, (&[], &[]), None, 0.0);
        let (cand, probs) = rule::distribution(&rule::processed(&logits, &s), &s);
        let total: f64 = probs.iter().sum();
        let n = 60_000;
        for draft in 0..logits.len() as u32 {
            let mut rng = Rng::new(99 + u64::from(draft));
            let mut counts = [0usize; 6];
            let mut kept = 0;
            for _ in 0..n {
                let (t, accepted, _) = verify(&logits, &p, &[], &[], &mut rng, None, draft);
                counts[t as usize] += 1;
                kept += usize::from(accepted);
                assert_eq!(accepted, t == draft);
            }
            let mut chi2 = 0.0;
            for (c, q) in cand.iter().zip(&probs) {
                let expected = n as f64 * q / total;
                chi2 += (counts[*c] as f64 - expected).powi(2) / expected;
            }
            let outside: usize = (0..6).filter(|t| !cand.contains(t)).map(|t| counts[t]).sum();
            assert_eq!(outside, 0, "draft {draft}: a token top-k cut was emitted");
            assert!(chi2 < 23.51, "draft {draft}: chi-square {chi2:.1} (counts {counts:?}, kept {kept})");
        }
        // Greedy: the argmax, accepted exactly when it is the draft.
        let g = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
        assert_eq!(verify(&logits, &g, &[], &[], &mut Rng::new(1), None, 3), (3, true, None));
        assert_eq!(verify(&logits, &g, &[], &[], &mut Rng::new(1), None, 0), (3, false, None));
        // A grammar that forbids the draft rejects it.
        let mask = [0b0001u32];
        assert_eq!(verify(&logits, &p, &[], &[], &mut Rng::new(5), Some(&mask), 3).0, 0);
    }

    #[test]
    fn seeded_sampling_is_reproducible_and_truncation_works() {
        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.37).sin()).collect();
        let p = SamplingParams { temperature: 0.8, top_p: 0.9, seed: Some(3), ..SamplingParams::default() };
        let a: Vec<u32> = (0..20).scan(Rng::new(3), |r, _| Some(sample(&logits, &p, &[], &[], r, None).0)).collect();
        let b: Vec<u32> = (0..20).scan(Rng::new(3), |r, _| Some(sample(&logits, &p, &[], &[], r, None).0)).collect();
        assert_eq!(a, b);
        let k1 = SamplingParams { temperature: 1.0, top_k: 1, ..SamplingParams::default() };
        let best = argmax(&logits) as u32;
        assert!((0..20).all(|s| sample(&logits, &k1, &[], &[], &mut Rng::new(s), None).0 == best));
        let minp = SamplingParams { temperature: 1.0, min_p: 1.0, ..SamplingParams::default() };
        assert!((0..20).all(|s| sample(&logits, &minp, &[], &[], &mut Rng::new(s), None).0 == best));
    }
}
