//! The cost side of speculative decoding on any checkpoint (`osprey bench verify`): the main model's
//! forward over `K + 1` tokens as a verification runs it (single-token numerics, the state after each
//! token kept, then rewound) against one plain decode step, after the same prompt. With acceptance rate
//! `a` per draft, a step emits `(1 − a^(K+1)) / (1 − a)` tokens on average for the verification's cost
//! (plus the draft head's), which is what a trained head buys; random weights accept nothing, so the
//! cost is what can be measured on the speed checkpoint.

use std::time::Instant;

use osprey_models::{CausalLm, ForwardOptions, LogitsWanted, SeqInput, SeqStep};
use serde::Serialize;

use crate::{bench_prompt, median, Result};

/// Settings of [`bench_verify`].
#[derive(Clone, Copy, Debug)]
pub struct VerifyBench {
    /// Prompt tokens before the measured forwards.
    pub prompt_len: usize,
    /// Largest K measured (verifications of 2 ..= K + 1 tokens).
    pub drafts: usize,
    /// Measured repetitions (median reported).
    pub repeats: usize,
}

/// One verification width.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyRow {
    /// Drafts K (the forward runs K + 1 tokens).
    pub drafts: usize,
    /// Seconds of the verification forward (median).
    pub seconds: f64,
    /// Its cost in decode steps.
    pub vs_decode: f64,
}

/// What [`bench_verify`] measured.
#[derive(Clone, Debug, Serialize)]
pub struct VerifyReport {
    /// Prompt tokens before the measured forwards.
    pub prompt_len: usize,
    /// Seconds of one plain decode step (median).
    pub decode_s: f64,
    /// Per K.
    pub verify: Vec<VerifyRow>,
}

/// Measures one decode step and verification forwards of 2 ..= `drafts` + 1 tokens, interleaved, on
/// one sequence (each measured forward leaves it one token longer).
pub fn bench_verify(m: &dyn CausalLm, b: VerifyBench) -> Result<VerifyReport> {
    let vocab = m.info().vocab_size;
    let mut st = m.new_state();
    let prompt = bench_prompt(b.prompt_len.max(1), vocab);
    let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&prompt) };
    m.forward(&mut [SeqStep { state: &mut st, input }], false)?;
    let tokens: Vec<u32> = bench_prompt(b.drafts + 1, vocab);
    let (mut decode, mut verify) = (Vec::new(), vec![Vec::new(); b.drafts]);
    for rep in 0..=b.repeats {
        let t = Instant::now();
        m.forward(&mut [SeqStep { state: &mut st, input: SeqInput::text(&tokens[..1]) }], false)?;
        if rep > 0 {
            decode.push(t.elapsed().as_secs_f64());
        }
        for k in 1..=b.drafts {
            let before = st.len();
            let input = SeqInput { logits: LogitsWanted::All, ..SeqInput::text(&tokens[..k + 1]) };
            let opts = ForwardOptions { keep_hidden: true, verify: &[true], ..ForwardOptions::default() };
            let t = Instant::now();
            m.forward_with(&mut [SeqStep { state: &mut st, input }], &opts)?;
            st.rewind(before + 1, k + 1)?;
            if rep > 0 {
                verify[k - 1].push(t.elapsed().as_secs_f64());
            }
        }
    }
    let decode_s = median(decode);
    let verify = verify
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let seconds = median(v);
            VerifyRow { drafts: i + 1, seconds, vs_decode: seconds / decode_s.max(1e-12) }
        })
        .collect();
    Ok(VerifyReport { prompt_len: b.prompt_len, decode_s, verify })
}
