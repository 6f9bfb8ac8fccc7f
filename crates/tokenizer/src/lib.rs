//! # osprey-tokenizer — text ⇄ token ids
//!
//! Brief overview: owns the checkpoint's `tokenizer.json` (a `tokenizers` pipeline: NFC, the Qwen3.5
//! split regex, byte-level BPE, added special tokens). Today it is the synchronous core: [`TextTokenizer`]
//! encodes and decodes. The actor shell (chat template, media placeholders, `cache_ids`, streaming
//! detokenizer) is added with the serving issue on top of this core.

use std::path::{Path, PathBuf};

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
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// A loaded `tokenizer.json`.
#[derive(Debug)]
pub struct TextTokenizer {
    inner: tokenizers::Tokenizer,
}

impl TextTokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        let inner = tokenizers::Tokenizer::from_file(&path).map_err(|e| Error::Load { path, reason: e.to_string() })?;
        Ok(TextTokenizer { inner })
    }

    /// Token ids of `text`; special tokens written literally (`<|im_start|>`) map to their ids, and no
    /// BOS/EOS is added (Qwen adds none).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let enc = self.inner.encode(text, false).map_err(|e| Error::Codec(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Text of `ids`, keeping special tokens when `skip_special` is false.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| Error::Codec(e.to_string()))
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
}
