//! Grammars for constrained decoding, compiled with llguidance (the engine vLLM, SGLang and llama.cpp
//! use) against this tokenizer's vocabulary. The tokenizer actor compiles; the runner's sampler drives a
//! [`TokenMatcher`] per sequence through the protocol's traits, so no llguidance type leaves this crate.
//!
//! The server builds the grammars (JSON Schemas in its one JSON layout, Lark for forced calls); this
//! module compiles them.
//!
//! A grammar only says what may come next, not that the answer ends: a number's digits or a string's
//! characters can go on until `max_tokens` cuts the answer mid-value. So in the last quarter of its token
//! budget (16 to 64 tokens, at most half of it) a matcher *wraps up*: among the allowed tokens it keeps, when there are any,
//! first the end-of-answer tokens, then the `<` of a closing tag right after a line break, then a line
//! break (closing tags start a line), then tokens that close strings, objects and arrays (made only of
//! `"`, `}`, `]`), then a comma; the grammar forces what must come in between (required keys, tag
//! names). The answer then ends inside its budget and parses.

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use osprey_protocol::constraint::{CompiledGrammar, Constraint, Grammar, TokenMatcher};
use serde_json::Value;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

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

/// Token classes a wrapping-up matcher prefers, best first (one bit per token).
#[derive(Debug)]
struct Tiers {
    /// End-of-answer tokens.
    eos: Vec<u32>,
    /// Tokens that start with `<` (a closing tag, once a line has ended).
    lt: Vec<u32>,
    /// Tokens that start with a line break and `<`.
    nl_lt: Vec<u32>,
    /// A lone line break (a closing tag starts on its own line).
    nl: Vec<u32>,
    /// Tokens made only of `"`, `}` and `]` (they close strings, objects, arrays).
    close: Vec<u32>,
    /// A comma, perhaps with the layout's space (it ends a number; spaces alone would let a string
    /// run on).
    comma: Vec<u32>,
    /// Tokens that end with a line break.
    ends_nl: Vec<u32>,
}

fn has(bits: &[u32], t: u32) -> bool {
    bits.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

impl Tiers {
    fn new(words: &[Vec<u8>], eos: &[u32]) -> Self {
        let n = words.len().div_ceil(32);
        let set = |pick: &dyn Fn(usize, &[u8]) -> bool| {
            let mut bits = vec![0u32; n];
            for (t, w) in words.iter().enumerate() {
                if w.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) && pick(t, w) {
                    bits[t / 32] |= 1 << (t % 32);
                }
            }
            bits
        };
        Tiers {
            eos: {
                let mut bits = vec![0u32; n];
                eos.iter()
                    .filter(|&&t| (t as usize) < words.len())
                    .for_each(|&t| bits[t as usize / 32] |= 1 << (t % 32));
                bits
            },
            lt: set(&|_, w| w.first() == Some(&b'<')),
            nl_lt: set(&|_, w| w.starts_with(b"\n<")),
            nl: set(&|_, w| w == b"\n"),
            close: set(&|_, w| !w.is_empty() && w.iter().all(|b| matches!(b, b'"' | b'}' | b']'))),
            comma: set(&|_, w| w.first() == Some(&b',') && w[1..].iter().all(|b| *b == b' ')),
            ends_nl: set(&|_, w| w.last() == Some(&b'\n')),
        }
    }

    /// `allowed` narrowed to the best class that keeps a token; `after_nl`: the last token ended a line.
    fn narrow(&self, allowed: &mut [u32], after_nl: bool) {
        let lt: &[u32] = if after_nl { &self.lt } else { &[] };
        for tier in [&self.eos[..], lt, &self.nl_lt, &self.nl, &self.close, &self.comma] {
            if allowed.iter().zip(tier).any(|(a, t)| a & t != 0) {
                allowed.iter_mut().enumerate().for_each(|(i, a)| *a &= tier.get(i).copied().unwrap_or(0));
                return;
            }
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
    pub fn new(tokenizer_json: &str, tok: tokenizers::Tokenizer, vocab: usize, eos: &[u32]) -> Result<Self, String> {
        let json: Value = serde_json::from_str(tokenizer_json).map_err(|e| e.to_string())?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| e.to_string())?;
        let vocab = vocab.max(words.len());
        // Ids the model has but the tokenizer lacks (padding) are special tokens nobody can write.
        while words.len() < vocab {
            let mut w = format!(".<[{}]>", words.len()).into_bytes();
            w[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(w);
        }
        let first = *eos.first().ok_or("the model declares no end-of-answer token")?;
        let info = TokRxInfo::new(vocab as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos);
        let tiers = Arc::new(Tiers::new(&words, eos));
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(GrammarCompiler { factory: Arc::new(factory), tiers })
    }

    /// Compiles `g`; a schema or grammar llguidance refuses gives its message.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, String> {
        let top = match g {
            Grammar::JsonSchema(schema) => TopLevelGrammar::from_json_schema(schema.clone()),
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let proto = Matcher::new(Ok(parser));
        if let Some(e) = proto.get_error() {
            return Err(e);
        }
        // Some grammars compile and then fail on their first mask (a recursive required `$ref` has no
        // finite value: "too many items"). Computing that mask here makes it a refusal of the request,
        // not an engine error after admission; the mask is computed again per sequence.
        let mut trial = proto.deep_clone();
        trial.compute_mask_or_eos().map_err(|e| e.to_string())?;
        if let Some(e) = trial.get_error() {
            return Err(e);
        }
        let grammar = Arc::new(Compiled { proto: Mutex::new(proto), tiers: self.tiers.clone() });
        Ok(Constraint { grammar, budget: None })
    }
}

/// A compiled grammar: a matcher at the start, cloned for each sequence.
struct Compiled {
    proto: Mutex<Matcher>,
    tiers: Arc<Tiers>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled").finish_non_exhaustive()
    }
}

impl CompiledGrammar for Compiled {
    fn start(&self, budget: Option<usize>) -> Box<dyn TokenMatcher> {
        let m = self.proto.lock().unwrap_or_else(std::sync::PoisonError::into_inner).deep_clone();
        // Wrap up over the last quarter of the budget: at least 16 tokens (closing a few levels and
        // writing the required keys left), at most 64, never more than half of it.
        let wrap_at = budget.map(|b| b.saturating_sub((b / 4).clamp(16, 64).min(b / 2)));
        Box::new(Seq { m, tiers: self.tiers.clone(), committed: 0, wrap_at, after_nl: false })
    }
}

/// One sequence's matcher.
struct Seq {
    m: Matcher,
    tiers: Arc<Tiers>,
    committed: usize,
    /// Tokens after which it wraps up.
    wrap_at: Option<usize>,
    /// The last token ended a line.
    after_nl: bool,
}

impl std::fmt::Debug for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seq").finish_non_exhaustive()
    }
}

impl TokenMatcher for Seq {
    fn allowed(&mut self, allowed: &mut Vec<u32>) -> Result<(), String> {
        let mask = self.m.compute_mask_or_eos().map_err(|e| e.to_string())?;
        allowed.clear();
        allowed.extend_from_slice(mask.as_slice());
        if self.wrap_at.is_some_and(|w| self.committed >= w) {
            self.tiers.narrow(allowed, self.after_nl);
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        self.committed += 1;
        self.after_nl = has(&self.tiers.ends_nl, token);
        if self.m.is_stopped() {
            return Ok(()); // the end-of-answer token after a complete grammar
        }
        self.m.consume_token(token).map_err(|e| e.to_string())
    }
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
        let mut m = c.grammar.start(budget);
        let mut ids = Vec::new();
        let mut bits = Vec::new();
        for _ in 0..limit {
            m.allowed(&mut bits).expect("mask");
            let allowed: Vec<u32> =
                (0..1024u32).filter(|t| bits.get(*t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)).collect();
            let word = |t: &u32| tok.decode(&[*t], false).unwrap_or_default();
            let pick = if stubborn {
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
