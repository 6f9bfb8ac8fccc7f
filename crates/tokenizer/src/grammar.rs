//! Grammars for constrained decoding, compiled with llguidance (the engine vLLM, SGLang and llama.cpp
//! use) against this tokenizer's vocabulary. The tokenizer actor compiles; the runner's sampler drives a
//! [`TokenMatcher`] per sequence through the protocol's traits, so no llguidance type leaves this crate.
//!
//! The server builds the grammars (JSON Schemas in its one JSON layout, Lark for forced calls); this
//! module compiles them.
//!
//! A grammar only says what may come next, not that the answer ends: a number's digits or a string's
//! characters can go on until `max_tokens` cuts the answer mid-value. So a matcher with a token budget
//! *wraps up* when what is left of the budget comes near the shortest way to close the answer from where
//! it stands (`wrapup.rs`).

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use osprey_protocol::constraint::{CompiledGrammar, Constraint, Grammar, GrammarError, TokenMatcher};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

use crate::wrapup::{Lex, Tiers};

/// The vocabulary as llguidance sees it: token bytes in a trie, tokenization by our tokenizer.
struct Env {
    trie: TokTrie,
    tok: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // Grammar literals are text; a literal split inside a character is re-tokenized by the trie.
        match std::str::from_utf8(s) {
            Ok(text) => self.tok.encode(text, false).map(|e| e.get_ids().to_vec()).unwrap_or_default(),
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars for one vocabulary (built once per server, on the first constrained request).
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
    tiers: Arc<Tiers>,
}

impl std::fmt::Debug for GrammarCompiler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GrammarCompiler").finish_non_exhaustive()
    }
}

impl GrammarCompiler {
    /// From `tokenizer.json`'s text and tokenizer, for a model whose logits have `vocab` entries; `eos`
    /// are the tokens that end an answer (allowed once the grammar is complete).
    pub fn new(
        tokenizer_json: &str,
        tok: tokenizers::Tokenizer,
        vocab: usize,
        eos: &[u32],
    ) -> Result<Self, crate::Error> {
        let setup = |e: &dyn std::fmt::Display| crate::Error::Grammar(e.to_string());
        let json: Value = serde_json::from_str(tokenizer_json).map_err(|e| setup(&e))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| setup(&e))?;
        let vocab = vocab.max(words.len());
        // Ids the model has but the tokenizer lacks (padding) are special tokens nobody can write.
        while words.len() < vocab {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let first = *eos.first().ok_or_else(|| setup(&"the model declares no end-of-answer token"))?;
        let info = TokRxInfo::new(vocab as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let tiers = Arc::new(Tiers::new(&words, eos));
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| setup(&e))?;
        factory.quiet();
        *factory.limits_mut() = limits();
        Ok(GrammarCompiler { factory: Arc::new(factory), tiers })
    }

    /// Compiles `g`; a schema or grammar llguidance refuses is [`CompileError::Refused`] with its message.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, CompileError> {
        self.compile_until(g, &[], &|| false)
    }

    /// [`GrammarCompiler::compile`] that gives up as soon as `stop()` says so (the request was cancelled
    /// or is past its deadline), checked between the compile's phases and before every token mask of the
    /// closing walk. What one compile can cost is bounded whatever the grammar (docs/reliability.md):
    /// building the parser by llguidance's limits ([`limits`]: lexer fuel and grammar size), each token
    /// mask by its per-mask fuel, and the closing walk by [`WALK_BUDGET`].
    ///
    /// `prefix`: tokens the answer already has (an assistant message the request continues, its prefill):
    /// the grammar starts after them, so prefill and continuation are one valid answer; a prefill the
    /// grammar does not allow is refused.
    pub fn compile_until(
        &self,
        g: &Grammar,
        prefix: &[u32],
        stop: &dyn Fn() -> bool,
    ) -> Result<Constraint, CompileError> {
        let top = match g {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| CompileError::Refused(e.to_string()))?;
        let mut proto = Matcher::new(Ok(parser));
        if let Some(e) = proto.get_error() {
            return Err(CompileError::Refused(e));
        }
        if !prefix.is_empty() && proto.consume_tokens(prefix).is_err() {
            return Err(CompileError::Prefill);
        }
        if stop() {
            return Err(CompileError::Stopped);
        }
        // Some grammars compile and then fail on their first mask (a recursive required `$ref` has no
        // finite value: "too many items"). Computing that mask here makes it a refusal of the request,
        // not an engine error after admission; the mask is computed again per sequence.
        let mut trial = proto.deep_clone();
        trial.compute_mask_or_eos().map_err(|e| CompileError::Refused(e.to_string()))?;
        if let Some(e) = trial.get_error() {
            return Err(CompileError::Refused(e));
        }
        // The closing walk computes a mask per token of the shortest answer: up to MAX_SHORTEST masks. Cut
        // at WALK_BUDGET it gives a lower bound, which only makes the max_tokens check more lenient (the
        // runtime wrap-up measures its own distances).
        let until = std::time::Instant::now() + WALK_BUDGET;
        let enough = || stop() || std::time::Instant::now() >= until;
        let shortest = crate::wrapup::distance_until(&mut trial, &self.tiers, &Lex::default(), MAX_SHORTEST, &enough)
            .map_err(|e| CompileError::Refused(e.0))?;
        if stop() {
            return Err(CompileError::Stopped);
        }
        let grammar = Arc::new(Compiled { proto: Mutex::new(proto), tiers: self.tiers.clone(), shortest });
        Ok(Constraint { grammar, budget: None })
    }
}

/// Why a compile gave no grammar.
#[derive(Debug, PartialEq, thiserror::Error)]
pub enum CompileError {
    /// The schema or grammar is refused (its message; may hold the compiler's internal state).
    #[error("{0}")]
    Refused(String),
    /// The caller's `stop()` said to give up.
    #[error("stopped")]
    Stopped,
    /// The prefilled text is not the start of an answer the grammar allows.
    #[error("the prefill does not fit")]
    Prefill,
}

/// Longest closing walk measured at compile time (a grammar whose shortest answer is longer counts as
/// this long).
const MAX_SHORTEST: usize = 4096;

/// Longest the compile-time closing walk may run. Each of its steps computes one token mask (a mask is
/// bounded by [`limits`]' per-mask fuel, about 15 ms at llguidance's measured rates, and usually takes
/// tens of microseconds), so without this bound a grammar with a long shortest answer and costly masks
/// could keep a worker for a minute (4096 × 15 ms).
pub const WALK_BUDGET: std::time::Duration = std::time::Duration::from_millis(250);

/// llguidance's limits, set here rather than left to its defaults so that the bound is ours and written
/// down (docs/reliability.md). At llguidance's measured rates: building the lexer ≤ 1,000,000 fuel
/// (≈ 20 ms), a grammar of at most 500,000 symbols, a token mask ≤ 200,000 lexer fuel (≈ 15 ms) and
/// 50,000 Earley items (≈ 2.5 ms), 250,000 lexer states (≈ 0.5 GB at the very most).
pub fn limits() -> llguidance::api::ParserLimits {
    llguidance::api::ParserLimits {
        max_items_in_row: 2000,
        initial_lexer_fuel: 1_000_000,
        step_lexer_fuel: 200_000,
        step_max_items: 50_000,
        max_lexer_states: 250_000,
        max_grammar_size: 500_000,
        precompute_large_lexemes: true,
        verbose_errors: true, // refusals are cut to their first line before a client sees them
    }
}

/// A compiled grammar: a matcher at the start, cloned for each sequence.
struct Compiled {
    proto: Mutex<Matcher>,
    tiers: Arc<Tiers>,
    /// Tokens of the shortest answer (the closing walk from the start).
    shortest: usize,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled").finish_non_exhaustive()
    }
}

impl CompiledGrammar for Compiled {
    fn start(&self, budget: Option<usize>) -> Box<dyn TokenMatcher> {
        let m = self.proto.lock().unwrap_or_else(std::sync::PoisonError::into_inner).deep_clone();
        Box::new(Seq {
            m,
            tiers: self.tiers.clone(),
            committed: 0,
            budget,
            wrapping: false,
            next_check: 0,
            lex: Lex::default(),
            last_distance: 0,
        })
    }

    fn shortest_answer(&self) -> usize {
        self.shortest
    }
}

/// One sequence's matcher.
struct Seq {
    m: Matcher,
    tiers: Arc<Tiers>,
    committed: usize,
    /// Most tokens the answer may have, its end token included.
    budget: Option<usize>,
    /// The answer is being closed: only closing tokens from now on.
    wrapping: bool,
    /// Tokens committed when the distance to the end is measured next.
    next_check: usize,
    /// Where the answer's text stands (in a JSON string, after a line break).
    lex: Lex,
    /// The closing path's length at the last measure.
    last_distance: usize,
}

impl std::fmt::Debug for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seq").finish_non_exhaustive()
    }
}

/// Tokens of slack kept when deciding to wrap up: the model may pick another closing token of the same
/// class than the measured path does.
const WRAP_MARGIN: usize = 3;

/// Slack under which the closing path is measured at every token.
const CHECK_EVERY_TOKEN: usize = 64;

/// What a group of guarded tokens has in common: whether they are structural, and their structure
/// ([`crate::wrapup::structure`]) or first byte.
type Fork = (bool, Vec<u8>);

/// Tokens of slack under which structural tokens are guarded (a structure a token can open, such as an
/// array item with its required keys, is shorter than this).
const GUARD_SLACK: usize = 48;

impl Seq {
    /// Decides whether to start wrapping up: measures the shortest closing path when due, and wraps up
    /// once the budget left is within [`WRAP_MARGIN`] of it. A single token can lengthen the path by
    /// a whole structure (`, {` opens an array item with its required keys), so the path is measured at
    /// every token once the slack is under [`CHECK_EVERY_TOKEN`], and after a sixteenth of the slack
    /// before that.
    fn check_wrap(&mut self) -> Result<(), GrammarError> {
        let Some(budget) = self.budget else { return Ok(()) };
        if self.wrapping || self.committed < self.next_check {
            return Ok(());
        }
        let left = budget.saturating_sub(self.committed);
        let d = crate::wrapup::distance(&mut self.m, &self.tiers, &self.lex, left + 1)?;
        self.last_distance = d;
        if d + WRAP_MARGIN >= left {
            self.wrapping = true;
        } else {
            let slack = left - d - WRAP_MARGIN;
            self.next_check = self.committed + if slack < CHECK_EVERY_TOKEN { 1 } else { slack / 16 };
        }
        Ok(())
    }

    /// Near the end of the budget (but not yet wrapping up), forbids the allowed tokens after which the
    /// closing path would no longer fit: a `,` that opens another array item or property, a `"` that
    /// starts an optional key. Tokens are grouped by what they do to the structure
    /// ([`crate::wrapup::structure`]); one representative per group is tried (consumed, measured, rolled
    /// back). Plain content is left alone where it is free (a string's text never lengthens the path),
    /// and guarded by its first byte where few tokens are allowed (a fork in fixed text).
    fn guard(&mut self, allowed: &mut [u32]) -> Result<(), GrammarError> {
        let Some(budget) = self.budget else { return Ok(()) };
        let left = budget.saturating_sub(self.committed);
        if self.wrapping || left > self.last_distance + GUARD_SLACK {
            return Ok(());
        }
        // A few choices are a fork in fixed text (a tag name, an enum value, a number's digits), where
        // plain letters can lengthen the path: `<p` opens an optional `<parameter=…>`, `</` closes. There
        // plain tokens are grouped by their first byte (`p`, `pa`, `param` take one branch), and the
        // group's lowest id, in a byte-level vocabulary its shortest token, stands for it: the longest
        // path of the group.
        let few = crate::wrapup::ids(allowed.iter().copied()).nth(crate::wrapup::FEW_CHOICES).is_none();
        let mut groups: Vec<(Fork, Vec<u32>)> = Vec::new();
        for t in crate::wrapup::ids(allowed.iter().copied()) {
            let key = if self.tiers.is_structural(t) {
                (true, crate::wrapup::structure(&self.lex, self.tiers.word(t)))
            } else if few {
                (false, self.tiers.word(t).iter().take(1).copied().collect())
            } else {
                continue;
            };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, members)) => members.push(t),
                None => groups.push((key, vec![t])),
            }
        }
        for (_, members) in groups {
            let t = members[0];
            if self.m.consume_token(t).is_err() {
                continue;
            }
            let mut lex = self.lex.clone();
            lex.feed_token(t, self.tiers.word(t));
            let d = crate::wrapup::distance(&mut self.m, &self.tiers, &lex, left);
            self.m.rollback(1).map_err(engine)?;
            // After `t`, `left - 1` tokens remain for a path of `d`.
            if d? + 1 > left.saturating_sub(1) {
                for m in members {
                    allowed[m as usize / 32] &= !(1 << (m % 32));
                }
            }
        }
        Ok(())
    }
}

impl TokenMatcher for Seq {
    fn allowed(&mut self, allowed: &mut Vec<u32>) -> Result<(), GrammarError> {
        self.mask(allowed)
    }

    fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        self.advance(token)
    }
}

impl Seq {
    fn mask(&mut self, allowed: &mut Vec<u32>) -> Result<(), GrammarError> {
        self.check_wrap()?;
        let mask = self.m.compute_mask_or_eos().map_err(engine)?;
        allowed.clear();
        allowed.extend_from_slice(mask.as_slice());
        if self.wrapping {
            self.tiers.wrap(&mut self.m, allowed, &self.lex);
        } else {
            self.guard(allowed)?;
            if allowed.iter().all(|w| *w == 0) {
                // Nothing fits any more (a path measured too short): close from here.
                self.wrapping = true;
                allowed.clear();
                allowed.extend_from_slice(mask.as_slice());
                self.tiers.wrap(&mut self.m, allowed, &self.lex);
            }
        }
        Ok(())
    }

    fn advance(&mut self, token: u32) -> Result<(), GrammarError> {
        self.committed += 1;
        self.lex.feed_token(token, self.tiers.word(token));
        if self.m.is_stopped() {
            return Ok(()); // the end-of-answer token after a complete grammar
        }
        self.m.consume_token(token).map_err(engine)
    }
}

/// llguidance's failure as the protocol's grammar error (its message).
pub(crate) fn engine(e: impl std::fmt::Display) -> GrammarError {
    GrammarError(e.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// `schema` as the server sends it: its JSON layout (no free whitespace) and strictness.
    fn json(mut schema: Value) -> Grammar {
        schema["x-guidance"] =
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": false});
        Grammar::JsonSchema(schema)
    }

    fn compiler() -> (GrammarCompiler, tokenizers::Tokenizer) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/osprey-default");
        let text = std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer.json");
        let tok = tokenizers::Tokenizer::from_bytes(text.as_bytes()).expect("tokenizer");
        (GrammarCompiler::new(&text, tok.clone(), 1024, &[994]).expect("compiler"), tok)
    }

    /// Issue 39: a compile gives up when its request is gone or past its deadline — at once, or in the
    /// middle of the closing walk, which asks before every token mask — and otherwise compiles whole.
    #[test]
    fn a_compile_stops_when_asked_between_phases_and_within_the_closing_walk() {
        let (c, _) = compiler();
        let n = 60;
        let props: serde_json::Map<String, Value> =
            (0..n).map(|i| (format!("p{i}"), json!({"type": "string"}))).collect();
        let schema = json(
            json!({"type": "object", "properties": props, "required": (0..n).map(|i| format!("p{i}")).collect::<Vec<_>>()}),
        );
        assert_eq!(c.compile_until(&schema, &[], &|| true).err(), Some(CompileError::Stopped));
        let asked = std::cell::Cell::new(0usize);
        let whole = c
            .compile_until(&schema, &[], &|| {
                asked.set(asked.get() + 1);
                false
            })
            .expect("compile");
        let shortest = whole.grammar.shortest_answer();
        assert!(shortest > 100 && asked.get() > shortest, "asked {} times over a walk of {shortest}", asked.get());
        // Stopped halfway through the walk: no grammar.
        let asked = std::cell::Cell::new(0usize);
        let stop = || {
            asked.set(asked.get() + 1);
            asked.get() > shortest / 2
        };
        assert_eq!(c.compile_until(&schema, &[], &stop).err(), Some(CompileError::Stopped));
        assert!(asked.get() <= shortest / 2 + 3, "the walk went on after the stop ({} asks)", asked.get());
    }

    /// Follows the grammar for at most `limit` tokens and returns the text once the end token is the only
    /// choice or chosen. `stubborn`: a worst-case model that continues whatever it is writing (a letter
    /// or digit whenever one is allowed, the end token only when nothing else is); otherwise the lowest
    /// allowed token, ending as soon as it may.
    fn walk(
        c: &Constraint,
        tok: &tokenizers::Tokenizer,
        budget: Option<usize>,
        limit: usize,
        stubborn: bool,
    ) -> Result<String, String> {
        walk_with(c, tok, budget, limit, if stubborn { Model::Stubborn } else { Model::Eager })
    }

    /// How a test's stand-in model chooses among the allowed tokens.
    #[derive(Clone, Copy)]
    enum Model {
        /// Continues whatever it is writing (see [`walk`]).
        Stubborn,
        /// The lowest allowed token, ending as soon as it may.
        Eager,
        /// Any allowed token, the end token included, with equal odds (a seeded xorshift): it opens
        /// optional parameters and array items, and picks digits, at random, as a sampled model does.
        Random(u64),
    }

    fn walk_with(
        c: &Constraint,
        tok: &tokenizers::Tokenizer,
        budget: Option<usize>,
        limit: usize,
        model: Model,
    ) -> Result<String, String> {
        let (stubborn, mut rng) = match model {
            Model::Stubborn => (true, None),
            Model::Eager => (false, None),
            Model::Random(seed) => (false, Some(seed.max(1))),
        };
        let mut m = c.grammar.start(budget);
        let mut ids = Vec::new();
        let mut bits = Vec::new();
        for _ in 0..limit {
            m.allowed(&mut bits).expect("mask");
            let allowed: Vec<u32> =
                (0..1024u32).filter(|t| bits.get(*t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)).collect();
            let word = |t: &u32| tok.decode(&[*t], false).unwrap_or_default();
            let pick = if let Some(x) = rng.as_mut() {
                *x ^= *x << 13;
                *x ^= *x >> 7;
                *x ^= *x << 17;
                allowed.get((*x % allowed.len().max(1) as u64) as usize)
            } else if stubborn {
                let going = allowed.iter().find(|t| !word(t).is_empty() && word(t).chars().all(char::is_alphanumeric));
                going.or_else(|| allowed.iter().find(|&&t| t != 994)).or(allowed.first())
            } else if allowed.contains(&994) {
                Some(&994)
            } else {
                allowed.first()
            };
            let text = |ids: &[u32]| tok.decode(ids, false).expect("decode");
            let t = *pick.ok_or_else(|| format!("no token allowed after {:?}", text(&ids)))?;
            if t == 994 {
                return Ok(text(&ids));
            }
            m.commit(t).expect("commit");
            ids.push(t);
        }
        Err(tok.decode(&ids, false).expect("decode"))
    }

    #[test]
    fn a_stubborn_model_is_wrapped_up_inside_its_budget() {
        let (c, tok) = compiler();
        let schema = json!({"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"},
            "xs": {"type": "array", "items": {"type": "integer"}}}, "required": ["x", "s", "xs"], "additionalProperties": false});
        let g = c.compile(&json(schema)).expect("compile");
        // Without a budget it writes digits and letters forever.
        assert!(walk(&g, &tok, None, 300, true).is_err());
        for budget in [32, 64, 120] {
            let out = walk(&g, &tok, Some(budget), budget, true)
                .unwrap_or_else(|e| panic!("ends inside {budget} tokens: {e:?}"));
            let v: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{out:?}: {e}"));
            assert!(v["x"].is_number() && v["s"].is_string() && v["xs"].is_array(), "{v}");
        }
        // A forced tool call's raw string parameter closes its tag.
        let lark = c.compile(&Grammar::Lark(r#"start: /[^<]*\n<\/parameter>\n/ "done""#.into())).expect("lark");
        let out = walk(&lark, &tok, Some(24), 24, true).expect("ends");
        assert!(out.ends_with("</parameter>\ndone"), "{out:?}");
    }

    fn validates(schema: &Value, v: &Value) -> bool {
        jsonschema::validator_for(schema).expect("a valid schema").is_valid(v)
    }

    /// Issue 22: every answer of a stubborn model, for every budget from the shortest answer up, parses
    /// and validates (a string once ran `...red}}}}}}` to the limit: inside it `}` is a character).
    #[test]
    fn every_budget_from_the_shortest_answer_up_ends_in_a_valid_answer() {
        let (c, tok) = compiler();
        let schemas = [
            json!({"type": "object", "properties": {"description": {"type": "string"}}, "required": ["description"], "additionalProperties": false}),
            json!({"type": "object", "properties": {"x": {"type": "number"}, "s": {"type": "string"},
                "xs": {"type": "array", "items": {"type": "integer"}}}, "required": ["x", "s", "xs"], "additionalProperties": false}),
            json!({"type": "object", "properties": {"shapes": {"type": "array", "minItems": 1, "items": {"type": "object",
                "properties": {"color": {"enum": ["red", "green"]}, "name": {"type": "string", "minLength": 2}},
                "required": ["color", "name"], "additionalProperties": false}}}, "required": ["shapes"], "additionalProperties": false}),
            json!({"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"type": "object",
                "properties": {"c": {"type": "string"}, "n": {"type": "integer", "minimum": 3, "maximum": 70}},
                "required": ["c", "n"], "additionalProperties": false}}, "required": ["b"], "additionalProperties": false}},
                "required": ["a"], "additionalProperties": false}),
            json!({"type": "array", "items": {"type": "string"}, "minItems": 2}),
            json!({"type": "string", "maxLength": 40}),
        ];
        for schema in &schemas {
            let g = c.compile(&json(schema.clone())).expect("compile");
            let shortest = g.grammar.shortest_answer();
            assert!(shortest > 1 && shortest < 60, "{schema}: {shortest}");
            for budget in shortest..shortest + 32 {
                for stubborn in [true, false] {
                    let out = walk(&g, &tok, Some(budget), budget, stubborn)
                        .unwrap_or_else(|e| panic!("{schema} at {budget}: did not end: {e:?}"));
                    let v: Value =
                        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{schema} at {budget}: {out:?}: {e}"));
                    assert!(validates(schema, &v), "{schema} at {budget}: {out}");
                }
            }
        }
        // A forced call of three parameters (the server's call grammar: raw strings and JSON values).
        let call = r#"start: "<tool_call>\n<function=f>\n" p0 p1 p2 "</function>\n</tool_call>"
p0: "<parameter=city>\n" /[^<]*\n<\/parameter>\n/
p1: "<parameter=days>\n" v1 "\n</parameter>\n"
v1: %json {"type": "integer", "minimum": 1, "maximum": 14, "x-guidance": {"whitespace_flexible": false}}
p2: "<parameter=tags>\n" v2 "\n</parameter>\n"
v2: %json {"type": "array", "items": {"type": "string"}, "minItems": 1, "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}
"#;
        let g = c.compile(&Grammar::Lark(call.into())).expect("lark");
        let shortest = g.grammar.shortest_answer();
        for budget in shortest..shortest + 48 {
            let out = walk(&g, &tok, Some(budget), budget, true).unwrap_or_else(|e| panic!("call at {budget}: {e:?}"));
            assert!(out.ends_with("</function>\n</tool_call>"), "call at {budget}: {out:?}");
        }
    }

    /// Issue 40, item 2: the server's grammar for a forced call of `get_shape` (an enum, an integer 0–9
    /// and an optional array of at most two short strings) as `call_grammar` writes it. A sampled model
    /// chooses among tag names (`<parameter=tags>` or `</function>`) through letters, which change no
    /// JSON structure: every budget from the shortest call up ends in a whole call.
    #[test]
    fn a_sampled_model_closes_a_forced_call_with_an_optional_array_at_every_budget() {
        let (c, tok) = compiler();
        let call = r#"start: call
call: c0
c0_p0: "<parameter=color>\n" ("red" | "green" | "blue") "\n</parameter>\n"
c0_v1: %json {"type": "integer", "minimum": 0, "maximum": 9, "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}}
c0_p1: "<parameter=n>\n" c0_v1 "\n</parameter>\n"
c0_v2: %json {"type": "array", "maxItems": 2, "items": {"type": "string", "maxLength": 5}, "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": true}}
c0_p2: "<parameter=tags>\n" c0_v2 "\n</parameter>\n"
c0: "<tool_call>\n<function=get_shape>\n" c0_p0 c0_p1 c0_p2? "</function>\n</tool_call>"
"#;
        let g = c.compile(&Grammar::Lark(call.into())).expect("lark");
        let shortest = g.grammar.shortest_answer();
        let mut failed = Vec::new();
        for budget in shortest..shortest + 60 {
            for seed in 1..=4u64 {
                match walk_with(&g, &tok, Some(budget), budget, Model::Random(seed * 7919 + budget as u64)) {
                    Ok(out) if out.ends_with("</function>\n</tool_call>") => {}
                    other => failed.push(format!("{budget}/{seed}: {other:?}")),
                }
            }
        }
        assert!(
            failed.is_empty(),
            "{} of 240 did not close (shortest {shortest}): {:#?}",
            failed.len(),
            &failed[..failed.len().min(5)]
        );
    }

    /// Issue 40, item 3: a number the closing walk cannot end by taking the lowest digit: after `2`,
    /// `0` and `1` never make a multiple of 7 (the walk wrote `2001001001001001`). Every model ends
    /// inside every budget with a valid number.
    #[test]
    fn numbers_with_a_step_close_inside_the_budget() {
        let (c, tok) = compiler();
        // (schema, its step as a fraction p/q). The validator checks `multipleOf` in f64, which a sampled
        // model's 21-digit multiple of 7 defeats, so the step is checked exactly on the number's text and
        // the rest of the schema by the validator.
        let schemas = [
            (json!({"type": "integer", "multipleOf": 7, "minimum": 1}), 7, 1),
            (
                json!({"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 13, "minimum": 20}},
                "required": ["n"], "additionalProperties": false}),
                13,
                1,
            ),
            (json!({"type": "number", "multipleOf": 0.25, "exclusiveMinimum": 0}), 1, 4),
        ];
        let stepless = |s: &Value| {
            let mut s = s.clone();
            match s.get_mut("properties") {
                Some(p) => p["n"].as_object_mut().map(|n| n.remove("multipleOf")),
                None => s.as_object_mut().map(|n| n.remove("multipleOf")),
            };
            s
        };
        for (schema, p, q) in &schemas {
            let g = c.compile(&json(schema.clone())).expect("compile");
            let shortest = g.grammar.shortest_answer();
            assert!(shortest < 12, "{schema}: the shortest answer is {shortest} tokens");
            for budget in (shortest..shortest + 24).chain([32, 200]) {
                for (i, model) in [Model::Stubborn, Model::Eager, Model::Random(budget as u64), Model::Random(99)]
                    .into_iter()
                    .enumerate()
                {
                    let out = walk_with(&g, &tok, Some(budget), budget, model)
                        .unwrap_or_else(|e| panic!("{schema} at {budget}, model {i}: did not end: {e:?}"));
                    let v: Value =
                        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{schema} at {budget}: {out:?}: {e}"));
                    assert!(validates(&stepless(schema), &v), "{schema} at {budget}, model {i}: {out}");
                    assert!(multiple_of(&out, *p, *q), "{schema} at {budget}, model {i}: {out}");
                }
            }
        }
    }

    /// Whether the first number written in `text` is a multiple of `p / q`, exactly: the number is
    /// `digits / 10^k`, a multiple when `digits · q` is one of `p · 10^k`.
    fn multiple_of(text: &str, p: u128, q: u128) -> bool {
        let start = text.find(|c: char| c.is_ascii_digit()).expect("a number");
        let num: String = text[start..].chars().take_while(|c| c.is_ascii_digit() || *c == '.').collect();
        let k = num.split_once('.').map_or(0, |(_, f)| f.len() as u32);
        let modulus = p * 10u128.pow(k);
        let digits =
            num.bytes().filter(u8::is_ascii_digit).fold(0u128, |r, d| (r * 10 + u128::from(d - b'0')) % modulus);
        (digits * q).is_multiple_of(modulus)
    }

    #[test]
    fn schemas_compile_and_masks_lead_to_valid_json() {
        let (c, tok) = compiler();
        let g = c
            .compile(&json(json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}}, "required": ["ok", "n"], "additionalProperties": false})))
            .expect("compile");
        let out = walk(&g, &tok, None, 200, false).expect("terminates");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert!(v["ok"].is_boolean() && (v["n"] == 1 || v["n"] == 2), "{out}");
        assert!(c.compile(&json(json!({"type": "nonsense"}))).is_err());
        let lark =
            c.compile(&Grammar::Lark("start: \"<tool_call>\" /[a-z]{1,3}/ \"</tool_call>\"".into())).expect("lark");
        let out = walk(&lark, &tok, None, 50, false).expect("terminates");
        assert!(out.starts_with("<tool_call>") && out.ends_with("</tool_call>"), "{out}");
    }
}
