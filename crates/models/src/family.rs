//! The model-family seam: all the runtime (runner, `osprey run`, the bench, the binary) sees of a
//! causal-LM family. A family is a directory of this crate plus one entry in [`crate::registry`]; it is
//! built from a model directory, forwards a batch of segments (prefill chunks and decode tokens of several
//! sequences) with per-sequence state, and describes its KV geometry. Nothing outside the family's
//! directory names its structs or its tensor names.

use std::fmt::Debug;

use osprey_backend::{BackendRef, RowSampling, Tensor};
use osprey_protocol::runner::ExpertSlots;

use crate::error::Result;
pub use crate::kv::KvLayout;
use crate::kv::{PageGeometry, PageTable};
use crate::state::SeqState;

/// Tokens per KV page unless the runtime says otherwise (`--page-size`).
pub const DEFAULT_PAGE_SIZE: usize = 16;

/// Positions of a chunk's tokens.
#[derive(Clone, Copy, Debug)]
pub enum Positions<'a> {
    /// Text tokens: token index `t` gets `t + rope_delta` on all three mRoPE axes.
    Text,
    /// Explicit `[t, h, w]` per token (media spans; computed by the mRoPE position builder).
    Explicit(&'a [[i64; 3]]),
}

/// Which logits a sequence wants back.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LogitsWanted<'a> {
    /// None (a prefill chunk that does not end the prompt).
    None,
    /// The last token's.
    Last,
    /// Every new token's (teacher forcing, prompt logprobs).
    All,
    /// The last token's sampled id, drawn where the logits are under these settings
    /// ([`osprey_backend::CoreOps::sample_rows`]): on a device one id comes back instead of the vocabulary's
    /// logits ([`ForwardOutput::sampled`]), the ids of every such sequence of the batch in one download.
    Sample(&'a RowSampling),
}

/// Embedding rows that replace the token embeddings of a span of the chunk (vision rows).
#[derive(Clone, Copy, Debug)]
pub struct InjectedRows<'a> {
    /// First row of the chunk to replace.
    pub offset: usize,
    /// `[n, hidden]` rows.
    pub rows: &'a [f32],
}

/// One sequence's new tokens for a forward.
#[derive(Clone, Copy, Debug)]
pub struct SeqInput<'a> {
    /// Token ids (placeholders included where rows are injected).
    pub tokens: &'a [u32],
    /// Their positions.
    pub positions: Positions<'a>,
    /// Rows that replace token embeddings.
    pub injected: &'a [InjectedRows<'a>],
    /// Logits to return.
    pub logits: LogitsWanted<'a>,
}

impl<'a> SeqInput<'a> {
    /// Text tokens, wanting the last logits.
    pub fn text(tokens: &'a [u32]) -> Self {
        SeqInput { tokens, positions: Positions::Text, injected: &[], logits: LogitsWanted::Last }
    }
}

/// A sequence's state with its new tokens.
#[derive(Debug)]
pub struct SeqStep<'s, 'a> {
    /// The sequence's state (advanced by the forward).
    pub state: &'s mut SeqState,
    /// The new tokens.
    pub input: SeqInput<'a>,
}

/// Options of [`CausalLm::forward_with`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ForwardOptions<'a> {
    /// Return transformers' `hidden_states` list in [`ForwardOutput::hidden`].
    pub capture_hidden: bool,
    /// Per-layer teacher forcing (parity tests): layer `i` reads `teacher_inputs[i]` (`[T, hidden]`, the
    /// reference's `hidden_states[i]`) instead of the previous layer's output, so each captured hidden
    /// state measures one layer's own error. Implies `capture_hidden`.
    pub teacher_inputs: Option<&'a [Vec<f32>]>,
    /// Keep the final normed hidden rows of the batch on the backend ([`ForwardOutput::last_hidden`]):
    /// what the draft head reads.
    pub keep_hidden: bool,
    /// Per sequence (in batch order; missing: `false`): a speculative verification. Its tokens run with
    /// the numerics of single-token steps (the recurrent rule, token by token) and the recurrent state
    /// after each token is kept, so [`SeqState::rewind`] can cut it back to any accepted length.
    pub verify: &'a [bool],
}

/// Results of a forward.
#[derive(Clone, Debug, Default)]
pub struct ForwardOutput {
    /// Per sequence: `[vocab]` (Last), `[n, vocab]` (All) or empty (None, Sample).
    pub logits: Vec<Vec<f32>>,
    /// Per sequence: its drawn id with `Sample`, else `None`.
    pub sampled: Vec<Option<u32>>,
    /// With `capture_hidden`: transformers' `hidden_states` for the whole batch `[T, hidden]`: the input
    /// embeddings, the output of every layer but the last, then the final normed output.
    pub hidden: Vec<Vec<f32>>,
    /// With `keep_hidden`: the final normed hidden rows `[T, hidden]` of the whole batch, on the backend.
    pub last_hidden: Option<Tensor>,
}

/// One sequence's entries for the draft head (multi-token prediction): entry `i` pairs `tokens[i]` with
/// row `i` of `hidden` (the main model's final normed hidden state of the token before it, or the draft
/// head's own output when drafting ahead), at KV slot and position `start + i`. Its K/V rows land in the
/// head's own plane of the sequence's page table, which must cover `start + tokens.len()` slots.
#[derive(Debug)]
pub struct DraftStep<'s, 'a> {
    /// The sequence's state (its page table; its length does not change).
    pub state: &'s mut SeqState,
    /// Tokens of the entries.
    pub tokens: &'a [u32],
    /// `[tokens.len(), hidden]` rows on the backend.
    pub hidden: Tensor,
    /// Slot of the first entry.
    pub start: usize,
    /// Positions of the entries (`Text`: slot + the state's rope delta).
    pub positions: Positions<'a>,
}

/// What the draft head returned.
#[derive(Debug, Default)]
pub struct DraftOutput {
    /// Per sequence: the last entry's logits `[vocab]`.
    pub logits: Vec<Vec<f32>>,
    /// Per sequence: the last entry's normed output `[1, hidden]` on the backend (the next entry's
    /// hidden when drafting ahead).
    pub hidden: Vec<Tensor>,
    /// With `capture`: per stage (`fc`, layer output, normed output, logits), every entry's rows.
    pub captured: Vec<Vec<f32>>,
}

/// Shape facts the runtime needs about a loaded decoder.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LmInfo {
    /// Registry name of the family (`qwen3_5`).
    pub family: &'static str,
    /// Residual width (rows injected by the vision tower have this width).
    pub hidden_size: usize,
    /// Vocabulary rows of the embedding and lm_head.
    pub vocab_size: usize,
    /// Decoder layers.
    pub num_layers: usize,
    /// Layers with routed experts (0 for a dense model).
    pub moe_layers: usize,
    /// Routed experts per token (0 for a dense model).
    pub experts_per_token: usize,
    /// End-of-sequence ids from the config.
    pub eos_token_ids: Vec<u32>,
    /// Longest context the config declares.
    pub max_position_embeddings: usize,
}

/// A loaded causal-LM family, as the runtime drives it.
pub trait CausalLm: Send + Sync + Debug {
    /// Shape facts.
    fn info(&self) -> &LmInfo;

    /// KV geometry.
    fn kv_layout(&self) -> KvLayout;

    /// A fresh state for a new sequence whose KV lives in `kv` (from [`crate::KvPool::table`], or an
    /// unpooled table); its recurrent states are allocated on the backend (which may be out of memory).
    fn new_state_with(&self, kv: PageTable) -> Result<SeqState>;

    /// The backend its weights live on and its forward runs on (KV pools for it allocate there).
    fn backend(&self) -> &BackendRef;

    /// A fresh state whose KV pages are allocated as it grows, outside any pool (tests, one-off runs,
    /// where running out of memory for one sequence's state is fatal: the serving path uses
    /// [`CausalLm::new_state_with`] and answers that request 503).
    fn new_state(&self) -> SeqState {
        self.new_state_with(PageTable::unpooled(PageGeometry::new(self.kv_layout(), DEFAULT_PAGE_SIZE)))
            .expect("memory for a new sequence's state")
    }

    /// Runs one step for a batch of sequences, with options (hidden-state capture, per-layer teacher
    /// forcing). Each state advances by its tokens.
    fn forward_with(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput>;

    /// [`CausalLm::forward_with`] with default options.
    fn forward(&self, steps: &mut [SeqStep<'_, '_>], capture_hidden: bool) -> Result<ForwardOutput> {
        self.forward_with(steps, &ForwardOptions { capture_hidden, ..ForwardOptions::default() })
    }

    /// Bytes of weights read per token excluding routed experts (the dense part), and per routed expert.
    fn weight_bytes(&self) -> (usize, usize);

    /// Expert slot counters summed over the MoE layers (zero for a dense model).
    fn slot_stats(&self) -> ExpertSlots {
        ExpertSlots::default()
    }

    /// Whether a draft head (`mtp.*`) was loaded ([`crate::LoadOptions::draft_head`]).
    fn has_draft_head(&self) -> bool {
        false
    }

    /// Runs the draft head over each sequence's entries; `capture` also returns every stage's rows
    /// (parity tests).
    fn draft(&self, steps: &mut [DraftStep<'_, '_>], capture: bool) -> Result<DraftOutput> {
        let _ = (steps, capture);
        Err(crate::Error::Unsupported(format!("{} has no draft head loaded", self.info().family)))
    }

    /// The family's own counters and gauges for `/metrics` (`qwen4_exp`: its PLE row caches), read now.
    /// The runtime passes them through by name, so a family's internals never reach the protocol.
    fn family_stats(&self) -> Vec<FamilyStat> {
        Vec::new()
    }
}

/// One of a family's own metrics ([`CausalLm::family_stats`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FamilyStat {
    /// Prometheus name (`osprey_…`, `_total` for counters).
    pub name: &'static str,
    /// Help text.
    pub help: &'static str,
    /// A counter (else a gauge).
    pub counter: bool,
    /// The value now.
    pub value: f64,
}

/// A loaded model behind the seam.
pub type Model = Box<dyn CausalLm>;

/// A boxed model is a model (so `&Model` passes where `&dyn CausalLm` is asked for).
impl<T: CausalLm + ?Sized> CausalLm for Box<T> {
    fn info(&self) -> &LmInfo {
        (**self).info()
    }
    fn kv_layout(&self) -> KvLayout {
        (**self).kv_layout()
    }
    fn new_state_with(&self, kv: PageTable) -> Result<SeqState> {
        (**self).new_state_with(kv)
    }
    fn backend(&self) -> &BackendRef {
        (**self).backend()
    }
    fn forward_with(&self, steps: &mut [SeqStep<'_, '_>], opts: &ForwardOptions<'_>) -> Result<ForwardOutput> {
        (**self).forward_with(steps, opts)
    }
    fn weight_bytes(&self) -> (usize, usize) {
        (**self).weight_bytes()
    }
    fn slot_stats(&self) -> ExpertSlots {
        (**self).slot_stats()
    }
    fn family_stats(&self) -> Vec<FamilyStat> {
        (**self).family_stats()
    }
    fn has_draft_head(&self) -> bool {
        (**self).has_draft_head()
    }
    fn draft(&self, steps: &mut [DraftStep<'_, '_>], capture: bool) -> Result<DraftOutput> {
        (**self).draft(steps, capture)
    }
}
