//! Decode steps of several sequences at once (`osprey bench batch`): what a server at concurrency `B`
//! runs once every request is past its prompt, measured without HTTP, the tokenizer or the scheduler,
//! so a change to the batched path is priced by the step itself (issue 54 item 4). Each sequence gets
//! its own prompt (different tokens, so the routed experts differ as requests' do), prefilled alone;
//! then greedy decode steps of all of them together, timed, each token (the prompt's first too) drawn on
//! the backend as the server's runner draws it (`LogitsWanted::Sample`: the batch's head rows in one
//! matmul).

use std::time::Instant;

use osprey_models::backend::RowSampling;
use osprey_models::{CausalLm, LogitsWanted, SeqInput, SeqStep};
use serde::Serialize;

use crate::{bench_prompt, median, Result};

/// Settings of [`bench_batch`].
#[derive(Clone, Debug)]
pub struct BatchBench {
    /// Batch sizes measured, each on fresh sequences.
    pub batches: Vec<usize>,
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Decode steps timed per batch size (after one unmeasured step).
    pub decode_steps: usize,
}

/// One batch size.
#[derive(Clone, Debug, Serialize)]
pub struct BatchRow {
    /// Sequences decoded together.
    pub batch: usize,
    /// Seconds of one decode step of the whole batch (median).
    pub step_s: f64,
    /// Fastest and slowest step.
    pub step_range_s: (f64, f64),
    /// Tokens per second over the batch (`batch / step_s`).
    pub tok_s: f64,
    /// The step's cost in single-sequence steps (of the first row, batch 1 when measured first).
    pub vs_first: f64,
    /// Distinct routed experts a MoE layer ran per step (mean over layers and steps; 0 for a dense model).
    pub experts_per_layer: f64,
}

/// What [`bench_batch`] measured.
#[derive(Clone, Debug, Serialize)]
pub struct BatchReport {
    /// Prompt tokens per sequence.
    pub prompt_len: usize,
    /// Timed steps per batch size.
    pub decode_steps: usize,
    /// Per batch size, in the order asked.
    pub rows: Vec<BatchRow>,
}

/// Sequence `s`'s prompt: the bench prompt shifted by a per-sequence offset (same length, other tokens).
fn prompt_of(s: usize, len: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(64).max(1) as u32;
    bench_prompt(len, vocab).into_iter().map(|t| (t + 104_729 * s as u32) % span).collect()
}

/// Measures a decode step of each batch size in `b.batches`.
pub fn bench_batch(m: &dyn CausalLm, b: &BatchBench) -> Result<BatchReport> {
    let vocab = m.info().vocab_size;
    let moe_layers = m.info().moe_layers.max(1);
    let mut rows: Vec<BatchRow> = Vec::new();
    for &batch in &b.batches {
        let batch = batch.max(1);
        let greedy = RowSampling::greedy();
        let mut states: Vec<_> = (0..batch).map(|_| m.new_state()).collect();
        let mut next = Vec::with_capacity(batch);
        for (s, st) in states.iter_mut().enumerate() {
            let prompt = prompt_of(s, b.prompt_len.max(1), vocab);
            let input = SeqInput { logits: LogitsWanted::Sample(&greedy), ..SeqInput::text(&prompt) };
            let out = m.forward(&mut [SeqStep { state: st, input }], false)?;
            next.push(out.sampled[0].unwrap_or(0));
        }
        let mut times = Vec::new();
        let mut experts = 0u64;
        for step in 0..=b.decode_steps {
            let before = m.slot_stats();
            let t = Instant::now();
            let tokens: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
            let mut steps: Vec<SeqStep<'_, '_>> = states
                .iter_mut()
                .zip(&tokens)
                .map(|(state, tok)| SeqStep {
                    state,
                    input: SeqInput { logits: LogitsWanted::Sample(&greedy), ..SeqInput::text(tok) },
                })
                .collect();
            let out = m.forward(&mut steps, false)?;
            let secs = t.elapsed().as_secs_f64();
            next = out.sampled.iter().map(|s| s.unwrap_or(0)).collect();
            if step > 0 {
                times.push(secs);
                let after = m.slot_stats();
                experts += (after.hits + after.misses).saturating_sub(before.hits + before.misses);
            }
        }
        let (lo, hi) = times.iter().fold((f64::MAX, 0f64), |(lo, hi), &t| (lo.min(t), hi.max(t)));
        let step_s = median(times);
        let first = rows.first().map_or(step_s, |r| r.step_s);
        rows.push(BatchRow {
            batch,
            step_s,
            step_range_s: (lo, hi),
            tok_s: batch as f64 / step_s.max(1e-12),
            vs_first: step_s / first.max(1e-12),
            experts_per_layer: experts as f64 / (moe_layers * b.decode_steps.max(1)) as f64,
        });
    }
    Ok(BatchReport { prompt_len: b.prompt_len, decode_steps: b.decode_steps, rows })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_sequence_gets_its_own_prompt_of_the_asked_length() {
        let (a, b) = (prompt_of(0, 16, 1000), prompt_of(1, 16, 1000));
        assert_eq!(a, bench_prompt(16, 1000));
        assert_eq!(b.len(), 16);
        assert!(a.iter().zip(&b).all(|(x, y)| x != y), "the second sequence repeats the first's tokens");
        assert!(b.iter().all(|&t| t < 1000 - 64));
    }
}
