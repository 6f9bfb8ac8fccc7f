//! # osprey-tokenizer — text ⇄ token ids
//!
//! Brief overview: owns the checkpoint's `tokenizer.json` (a `tokenizers` pipeline: NFC, the Qwen3.5
//! split regex, byte-level BPE, added special tokens) and its chat template. [`TextTokenizer`] encodes
//! and decodes, [`ChatTemplate`] renders messages like transformers, [`expand_media_placeholders`]
//! expands image/video placeholders to their soft-token counts and [`prepare_prompt`] builds a prompt's
//! ids, mRoPE positions and media spans. The actor ([`spawn_pool`]) prepares prompts with their
//! [`cache_ids`] (media keyed by content hash), detokenizes streams ([`Detokenizer`]) and compiles the
//! grammars of constrained decoding ([`GrammarCompiler`], llguidance), whose matchers wrap an answer up
//! inside its token budget (`wrapup.rs`).

mod actor;
mod chat;
mod detok;
mod grammar;
mod placeholders;
mod prepare;
mod preprocessed;
mod turn;
mod wrapup;

use std::path::{Path, PathBuf};

pub use actor::{cache_ids, spawn, spawn_pool, TokenizerCore, TokenizerHandle};
pub use chat::{py_json_dumps, ChatTemplate};
pub use detok::Detokenizer;
pub use grammar::GrammarCompiler;
pub use placeholders::{expand_media_placeholders, format_seconds, MediaPlaceholder, IMAGE_PAD, VIDEO_PAD};
pub use prepare::{prepare_prompt, Media, Prepared, PreparedItem};

/// Tokenizer errors.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `tokenizer.json` is missing or malformed.
    #[error("cannot load tokenizer {path}: {reason}")]
    Load {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// Encoding or decoding failed.
    #[error("tokenizer error: {0}")]
    Codec(String),
    /// The chat template failed to compile or render (including its own `raise_exception`).
    #[error("chat template error: {0}")]
    Template(String),
    /// The grammar compiler cannot be built for this tokenizer (constrained decoding is unavailable).
    #[error("grammar compiler: {0}")]
    Grammar(String),
    /// Media placeholders and media items disagree.
    #[error("{0}")]
    Media(String),
    /// Media preprocessing or position computation refused the input.
    #[error(transparent)]
    Model(#[from] osprey_models::Error),
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// Opens a special token written by a client ([`TextTokenizer::mark_literal`]): between this mark and
/// [`LITERAL_CLOSE`] a special token's text is text, not the control token. Unicode noncharacters, which
/// no text a client sends keeps (they are replaced first).
pub const LITERAL_OPEN: char = '\u{FDD0}';
/// Closes what [`LITERAL_OPEN`] opened.
pub const LITERAL_CLOSE: char = '\u{FDD1}';

/// A loaded `tokenizer.json`.
#[derive(Debug)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
    /// The same pipeline with special tokens read as text (`encode_special_tokens`).
    literal: tokenizers::Tokenizer,
    /// Special added tokens (`special: true`), longest first, with their ids.
    specials: Vec<(String, u32)>,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let text = osprey_models::files::read_small(&path, osprey_models::files::MAX_TOKENIZER_BYTES)
            .map_err(|e| Error::Load { path: path.clone(), reason: e.to_string() })?;
        let inner = tokenizers::Tokenizer::from_bytes(text.as_bytes())
            .map_err(|e| Error::Load { path, reason: format!("not a tokenizer this build can read: {e}") })?;
        let mut literal = inner.clone();
        literal.set_encode_special_tokens(true);
        let mut specials: Vec<(String, u32)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, t)| t.special && !t.content.is_empty())
            .map(|(id, t)| (t.content, id))
            .collect();
        specials.sort_by(|a, b| b.0.len().cmp(&a.0.len()).then(a.1.cmp(&b.1)));
        Ok(TextTokenizer { inner, literal, specials })
    }

    /// Token ids of `text`; special tokens written literally (`<|im_start|>`) map to their ids, and no
    /// BOS/EOS is added (Qwen adds none). A special token between [`LITERAL_OPEN`] and
    /// [`LITERAL_CLOSE`] is text: the text is cut at the other special tokens, as the tokenizer's added
    /// vocabulary cuts it, and each piece is encoded with special tokens read as text (transformers'
    /// `split_special_tokens=True` for those pieces), so a text without marks encodes exactly as before.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        if !text.contains(LITERAL_OPEN) {
            let enc = self.inner.encode(text, false).map_err(|e| Error::Codec(e.to_string()))?;
            return Ok(enc.get_ids().to_vec());
        }
        let mut ids = Vec::new();
        let mut piece = String::new();
        let mut rest = text;
        let flush = |piece: &mut String, ids: &mut Vec<u32>| -> Result<()> {
            if !piece.is_empty() {
                let enc = self.literal.encode(piece.as_str(), false).map_err(|e| Error::Codec(e.to_string()))?;
                ids.extend_from_slice(enc.get_ids());
                piece.clear();
            }
            Ok(())
        };
        while let Some(c) = rest.chars().next() {
            if c == LITERAL_OPEN {
                let body = &rest[c.len_utf8()..];
                let end = body.find(LITERAL_CLOSE).unwrap_or(body.len());
                piece.push_str(&body[..end]);
                rest = body.get(end + LITERAL_CLOSE.len_utf8()..).unwrap_or("");
            } else if let Some((s, id)) = self.specials.iter().find(|(s, _)| rest.starts_with(s.as_str())) {
                flush(&mut piece, &mut ids)?;
                ids.push(*id);
                rest = &rest[s.len()..];
            } else {
                piece.push(c);
                rest = &rest[c.len_utf8()..];
            }
        }
        flush(&mut piece, &mut ids)?;
        Ok(ids)
    }

    /// `s` with every special token it spells wrapped in [`LITERAL_OPEN`] / [`LITERAL_CLOSE`], so that
    /// [`TextTokenizer::encode`] reads it as text (client content: a user cannot forge a turn with
    /// `<|im_start|>system`). Marks already in `s` become U+FFFD.
    pub fn mark_literal<'a>(&self, s: &'a str) -> std::borrow::Cow<'a, str> {
        let has_mark = s.contains([LITERAL_OPEN, LITERAL_CLOSE]);
        if !has_mark && !self.specials.iter().any(|(t, _)| s.contains(t.as_str())) {
            return std::borrow::Cow::Borrowed(s);
        }
        let mut out = String::with_capacity(s.len() + 8);
        let mut rest = s;
        while let Some(c) = rest.chars().next() {
            if let Some((t, _)) = self.specials.iter().find(|(t, _)| rest.starts_with(t.as_str())) {
                out.push(LITERAL_OPEN);
                out.push_str(t);
                out.push(LITERAL_CLOSE);
                rest = &rest[t.len()..];
                continue;
            }
            out.push(if c == LITERAL_OPEN || c == LITERAL_CLOSE { '\u{FFFD}' } else { c });
            rest = &rest[c.len_utf8()..];
        }
        std::borrow::Cow::Owned(out)
    }

    /// Text of `ids`, keeping special tokens when `skip_special` is false.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Codec(e.to_string()))
    }

    /// Vocabulary size including added tokens.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    /// The highest token id at or beyond `vocab` (the model's vocabulary: its embedding and output
    /// rows), with its token, if the tokenizer has one. A model directory is hostile input: such an id
    /// passed the load and then failed every request (issue 49), so the load refuses it.
    pub fn beyond_vocabulary(&self, vocab: usize) -> Option<(u32, String)> {
        self.inner
            .get_vocab(true)
            .into_iter()
            .filter(|(_, id)| *id as usize >= vocab)
            .max_by_key(|(_, id)| *id)
            .map(|(t, id)| (id, t))
    }

    /// An upper bound of the bytes of text one token stands for: the longest vocabulary entry, in UTF-8
    /// bytes of its stored form (byte-level tokens store one char per byte, SentencePiece's `▁` is longer
    /// stored than decoded). A text of more than `context × this` bytes cannot fit the context.
    pub fn max_token_bytes(&self) -> usize {
        self.inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1)
    }

    /// Id of a token string (e.g. `<|im_end|>`), if it is in the vocabulary.
    pub fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fixture_dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/qwen3_5_moe-tiny")
    }

    #[test]
    fn encodes_the_reference_prompt_exactly_as_transformers() {
        let tok = TextTokenizer::from_dir(&fixture_dir()).expect("tokenizer");
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture_dir().join("../../ref/qwen3_5_moe-tiny/summary.json")).expect("summary"),
        )
        .expect("json");
        for case in ["text", "long"] {
            let prompt = summary["cases"][case]["prompt"].as_str().expect("prompt");
            let ids = tok.encode(prompt).expect("encode");
            let bytes = std::fs::read(fixture_dir().join(format!("../../ref/qwen3_5_moe-tiny/{case}.safetensors")))
                .expect("ref");
            let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
            let want: Vec<u32> = st
                .tensor("input_ids")
                .expect("input_ids")
                .data()
                .chunks_exact(8)
                .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")) as u32)
                .collect();
            assert_eq!(ids, want, "{case}: ids differ from transformers'");
            assert_eq!(tok.decode(&ids, false).expect("decode"), prompt, "{case} round trip");
        }
        assert_eq!(tok.token_id("<|im_end|>"), Some(994));
        assert_eq!(tok.token_id("<|image_pad|>"), Some(1004));
        assert_eq!(tok.token_id("</think>"), Some(1017));
    }

    #[test]
    fn chat_template_renders_exactly_as_transformers() {
        // The messages the fixture generator rendered with transformers (tools/gen_fixtures.py CASES).
        let t = ChatTemplate::from_dir(&fixture_dir()).expect("template");
        let summary: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixture_dir().join("../../ref/qwen3_5_moe-tiny/summary.json")).expect("summary"),
        )
        .expect("json");
        let text = serde_json::json!([
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Describe the weather in Paris in one sentence."}
        ]);
        let long = serde_json::json!([
            {"role": "system", "content": "You are a careful assistant that answers questions about source code."},
            {"role": "user", "content": "What does the function get_rope_index compute for a prompt with images?"},
            {"role": "assistant", "content": "<think>\nThe user asks about positions.\n</think>\n\nIt returns three position rows (temporal, height, width) and a delta per sequence."},
            {"role": "user", "content": "And how are the rotary frequencies split between the three axes when mrope_interleaved is set? Please explain the interleaving with an example of the first twelve frequencies, and say what happens to text tokens."}
        ]);
        let image = serde_json::json!([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}]}]);
        let kw = serde_json::Map::new();
        for (case, m) in [("text", &text), ("long", &long)] {
            let want = summary["cases"][case]["prompt"].as_str().expect("prompt");
            assert_eq!(t.render(m, true, &kw).expect("render"), want, "{case}");
        }
        let rendered = t.render(&image, true, &kw).expect("render");
        assert_eq!(rendered, "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the image?<|im_end|>\n<|im_start|>assistant\n<think>\n");
        let mut off = serde_json::Map::new();
        off.insert("enable_thinking".into(), false.into());
        assert!(t.render(&text, true, &off).expect("render").ends_with("<think>\n\n</think>\n\n"));
        let bad = serde_json::json!([{"role": "narrator", "content": "x"}]);
        assert!(t.render(&bad, true, &kw).is_err());
    }

    #[test]
    fn chat_templates_with_tools_render_exactly_as_transformers() {
        // Cases rendered and tokenized by transformers (tools/gen_template_fixtures.py): tools in the
        // system turn, past calls with string and JSON arguments, grouped tool results, an image result.
        let dir = fixture_dir().join("../osprey-default");
        let t = ChatTemplate::from_dir(&dir).expect("template");
        let tok = TextTokenizer::from_dir(&dir).expect("tokenizer");
        let cases: Vec<serde_json::Value> = serde_json::from_str(
            &std::fs::read_to_string(fixture_dir().join("../../ref/chat_templates.json")).expect("cases"),
        )
        .expect("json");
        assert!(cases.len() >= 8);
        for c in &cases {
            let name = c["name"].as_str().expect("name");
            let mut kw = c["kwargs"].as_object().cloned().unwrap_or_default();
            if !c["tools"].is_null() {
                kw.insert("tools".into(), c["tools"].clone());
            }
            let text = t.render(&c["messages"], true, &kw).expect("render");
            assert_eq!(text, c["text"].as_str().expect("text"), "{name}: text");
            let want: Vec<u32> =
                c["ids"].as_array().expect("ids").iter().map(|v| v.as_u64().expect("id") as u32).collect();
            assert_eq!(tok.encode(&text).expect("encode"), want, "{name}: ids");
        }
    }
}
