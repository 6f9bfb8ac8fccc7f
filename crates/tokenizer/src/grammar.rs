//! Grammars for constrained decoding, compiled with llguidance (the engine vLLM, SGLang and llama.cpp
//! use) against this tokenizer's vocabulary. The tokenizer actor compiles; the runner's sampler drives a
//! [`TokenMatcher`] per sequence through the protocol's traits, so no llguidance type leaves this crate.
//!
//! JSON is written in one fixed layout (`", "` and `": "` as Python's `json.dumps`, no free whitespace):
//! a model, even a random one, cannot spend its tokens on blank space, and the output stays parseable.

use std::sync::{Arc, Mutex};

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use osprey_protocol::constraint::{CompiledGrammar, Constraint, Grammar, TokenMatcher};
use serde_json::{json, Value};
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

/// Compiles grammars for one vocabulary (built once per server, on the first constrained request).
pub struct GrammarCompiler {
    factory: Arc<ParserFactory>,
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
        let env: TokEnv = Arc::new(Env { trie, tok });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(GrammarCompiler { factory: Arc::new(factory) })
    }

    /// Compiles `g`; a schema or grammar llguidance refuses gives its message.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, String> {
        let top = match g {
            Grammar::JsonObject => TopLevelGrammar::from_json_schema(layout(json!({"type": "object"}), false)),
            Grammar::JsonSchema { schema, strict } => {
                TopLevelGrammar::from_json_schema(layout(schema.clone(), *strict))
            }
            Grammar::Lark(src) => TopLevelGrammar::from_lark(src.clone()),
        };
        let parser = self.factory.create_parser(top).map_err(|e| e.to_string())?;
        let proto = Matcher::new(Ok(parser));
        if let Some(e) = proto.get_error() {
            return Err(e);
        }
        Ok(Constraint(Arc::new(Compiled { proto: Mutex::new(proto) })))
    }
}

/// A JSON schema with osprey's fixed layout; `strict` keeps llguidance's refusal of keywords it cannot
/// enforce (else they are ignored, as OpenAI does for non-strict schemas).
pub fn layout(mut schema: Value, strict: bool) -> Value {
    if let Value::Object(m) = &mut schema {
        m.insert(
            "x-guidance".into(),
            json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": ", "lenient": !strict}),
        );
    } else if schema == Value::Bool(true) {
        return layout(json!({}), strict);
    }
    schema
}

/// A compiled grammar: a matcher at the start, cloned for each sequence.
struct Compiled {
    proto: Mutex<Matcher>,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Compiled").finish_non_exhaustive()
    }
}

impl CompiledGrammar for Compiled {
    fn start(&self) -> Box<dyn TokenMatcher> {
        let m = self.proto.lock().unwrap_or_else(std::sync::PoisonError::into_inner).deep_clone();
        Box::new(Seq(m))
    }
}

/// One sequence's matcher.
struct Seq(Matcher);

impl std::fmt::Debug for Seq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Seq").finish_non_exhaustive()
    }
}

impl TokenMatcher for Seq {
    fn allowed(&mut self, allowed: &mut Vec<u32>) -> Result<(), String> {
        let mask = self.0.compute_mask_or_eos().map_err(|e| e.to_string())?;
        allowed.clear();
        allowed.extend_from_slice(mask.as_slice());
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.0.is_stopped() {
            return Ok(()); // the end-of-answer token after a complete grammar
        }
        self.0.consume_token(token).map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn compiler() -> (GrammarCompiler, tokenizers::Tokenizer) {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/osprey-default");
        let text = std::fs::read_to_string(dir.join("tokenizer.json")).expect("tokenizer.json");
        let tok = tokenizers::Tokenizer::from_bytes(text.as_bytes()).expect("tokenizer");
        (GrammarCompiler::new(&text, tok.clone(), 1024, &[994]).expect("compiler"), tok)
    }

    /// Follows the lowest allowed token at each step (a worst case for termination: no model steers it).
    fn walk(c: &Constraint, tok: &tokenizers::Tokenizer, budget: usize) -> Option<String> {
        let mut m = c.0.start();
        let mut ids = Vec::new();
        let mut bits = Vec::new();
        for _ in 0..budget {
            m.allowed(&mut bits).expect("mask");
            let allowed: Vec<u32> =
                (0..1024u32).filter(|t| bits.get(*t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)).collect();
            // Prefer the end token, then the longest-text token among the first few allowed.
            if allowed.contains(&994) {
                return Some(tok.decode(&ids, false).expect("decode"));
            }
            let t = *allowed.first()?;
            m.commit(t).expect("commit");
            ids.push(t);
        }
        None
    }

    #[test]
    fn schemas_compile_and_masks_lead_to_valid_json() {
        let (c, tok) = compiler();
        let g = c
            .compile(&Grammar::JsonSchema { schema: json!({"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2]}}, "required": ["ok", "n"], "additionalProperties": false}), strict: true })
            .expect("compile");
        let out = walk(&g, &tok, 200).expect("terminates");
        let v: Value = serde_json::from_str(&out).expect("json");
        assert!(v["ok"].is_boolean() && (v["n"] == 1 || v["n"] == 2), "{out}");
        assert!(c.compile(&Grammar::JsonSchema { schema: json!({"type": "nonsense"}), strict: true }).is_err());
        let lark =
            c.compile(&Grammar::Lark("start: \"<tool_call>\" /[a-z]{1,3}/ \"</tool_call>\"".into())).expect("lark");
        let out = walk(&lark, &tok, 50).expect("terminates");
        assert!(out.starts_with("<tool_call>") && out.ends_with("</tool_call>"), "{out}");
    }
}
