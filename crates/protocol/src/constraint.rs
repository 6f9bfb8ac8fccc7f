//! Constrained decoding across actors: the server says what the output must match ([`Grammar`]), the
//! tokenizer actor (which owns the vocabulary) compiles it into a [`Constraint`], and the runner's sampler
//! asks a per-sequence [`TokenMatcher`] which tokens may come next. No grammar engine types cross here.

use std::sync::Arc;

/// What the output must match, as the server built it (layout and strictness included).
#[derive(Clone, Debug, PartialEq)]
pub enum Grammar {
    /// A JSON value valid under this JSON Schema (`response_format` `json_object` / `json_schema`).
    JsonSchema(serde_json::Value),
    /// A Lark grammar (forced tool calls: the call syntax with each parameter's schema inside).
    Lark(String),
}

/// A grammar engine's failure while masking or advancing: its message (the first line is for the
/// client; the engine may append its parser state after it).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct GrammarError(pub String);

/// One sequence's position in a compiled grammar.
pub trait TokenMatcher: Send + std::fmt::Debug {
    /// Sets bit `t % 32` of `allowed[t / 32]` for every token `t` that may come next (the vector is
    /// resized to cover the vocabulary). Stop tokens are allowed once the grammar is complete.
    fn allowed(&mut self, allowed: &mut Vec<u32>) -> Result<(), GrammarError>;
    /// Advances past the sampled token.
    fn commit(&mut self, token: u32) -> Result<(), GrammarError>;
}

/// A compiled grammar: starts a matcher per sequence.
pub trait CompiledGrammar: Send + Sync + std::fmt::Debug {
    /// A matcher at the start of the output; `budget` is the most tokens the answer may have (the
    /// matcher steers the answer to its end as the budget runs out).
    fn start(&self, budget: Option<usize>) -> Box<dyn TokenMatcher>;
    /// Tokens of the shortest answer the grammar allows (its end token included), as the matcher's
    /// closing walk finds it: a budget below this cannot end in a valid answer.
    fn shortest_answer(&self) -> usize;
}

/// A shared compiled grammar and the answer's token budget (equal only to itself).
#[derive(Clone, Debug)]
pub struct Constraint {
    /// The grammar.
    pub grammar: Arc<dyn CompiledGrammar>,
    /// `max_tokens` of the answer, once known.
    pub budget: Option<usize>,
}

impl PartialEq for Constraint {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.grammar, &other.grammar) && self.budget == other.budget
    }
}
