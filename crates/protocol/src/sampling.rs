//! A request's sampling settings: what the scheduler receives and the runner samples with.

use crate::constraint::Constraint;

/// Sampling settings of a request (OpenAI / vLLM semantics).
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 → greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1].
    pub top_p: f32,
    /// 0 → off.
    pub top_k: usize,
    /// Minimum probability relative to the best token; 0 → off.
    pub min_p: f32,
    /// RNG seed (None: from the clock).
    pub seed: Option<u64>,
    /// > 1 discourages tokens already in the prompt or output (multiplicative, as HF/vLLM).
    pub repetition_penalty: f32,
    /// Subtracted once from the logit of every token already generated.
    pub presence_penalty: f32,
    /// Subtracted per occurrence in the generated text.
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before sampling (OpenAI's `logit_bias`; ids below the
    /// vocabulary, biases in [-100, 100], each id once).
    pub logit_bias: Vec<(u32, f32)>,
    /// Return logprobs with this many alternatives (None: no logprobs).
    pub logprobs: Option<usize>,
    /// Tokens outside this grammar are never sampled (structured output, forced tool calls).
    pub constraint: Option<Constraint>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            logprobs: None,
            constraint: None,
        }
    }
}
