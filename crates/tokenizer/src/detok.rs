//! Incremental detokenization: constant work per generated token.
//!
//! Decoding the whole answer again for every new token is quadratic in its length. Instead only a small
//! window of ids is decoded: the ids of the text emitted last (kept as context, because byte-level merges
//! and leading-space rules of a token depend on its neighbour) followed by the new ones; the new text is
//! the window's text minus the context's. This is the algorithm of `tokenizers`' `DecodeStream` (also
//! used by TGI and vLLM), written over plain state ([`DecodeState`]) so the state can travel with the
//! request instead of living in the tokenizer actor.
//!
//! Invariant: the concatenation of every [`Detokenizer::step`] output and the final [`Detokenizer::flush`]
//! equals `decode(all ids)`. Text ending in U+FFFD (a multi-byte character still incomplete) is held until
//! a later token completes it or the answer ends; only while every new token keeps the text incomplete
//! does the window grow (a degenerate answer of stray bytes), and `flush` then emits the replacement
//! characters exactly as a full decode would.

use osprey_protocol::tokenizer::DecodeState;

const REPLACEMENT: char = '\u{FFFD}';

/// Stateless stepping over a [`DecodeState`], with a decode function (the tokenizer's) and a count of
/// the ids it decoded (how the tests check that the work is linear in the answer).
#[derive(Debug, Default)]
pub struct Detokenizer {
    /// Ids passed to the decode function so far.
    pub decoded_ids: u64,
}

impl Detokenizer {
    fn decode(&mut self, f: &mut dyn FnMut(&[u32]) -> String, ids: &[u32]) -> String {
        self.decoded_ids += ids.len() as u64;
        f(ids)
    }

    /// Appends `ids` and returns the text that is now settled (possibly empty).
    pub fn step(&mut self, st: &mut DecodeState, ids: &[u32], f: &mut dyn FnMut(&[u32]) -> String) -> String {
        st.window.extend_from_slice(ids);
        let text = self.decode(f, &st.window);
        if text.len() <= st.prefix.len() || text.ends_with(REPLACEMENT) {
            return String::new();
        }
        let new = new_text(&text, &st.prefix);
        // The ids just settled become the context of the next step.
        st.window.drain(..st.context);
        st.context = st.window.len();
        st.prefix = self.decode(f, &st.window);
        new
    }

    /// The text still held (an incomplete character becomes U+FFFD, as in a full decode); the state is
    /// spent afterwards.
    pub fn flush(&mut self, st: &mut DecodeState, f: &mut dyn FnMut(&[u32]) -> String) -> String {
        if st.window.len() == st.context {
            return String::new();
        }
        let text = self.decode(f, &st.window);
        let new = if text.len() > st.prefix.len() { new_text(&text, &st.prefix) } else { String::new() };
        st.window.clear();
        st.context = 0;
        st.prefix.clear();
        new
    }
}

/// `text` past `prefix`. A tokenizer whose decode is not prefix-stable (none of the byte-level ones we
/// serve) falls back to the text after the longest common prefix.
fn new_text(text: &str, prefix: &str) -> String {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = text.char_indices().zip(prefix.chars()).take_while(|((_, a), b)| a == b).count();
    let at = text.char_indices().nth(common).map_or(text.len(), |(i, _)| i);
    text[at..].to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A toy byte-level decoder: each id is one byte; invalid UTF-8 is replaced like `from_utf8_lossy`.
    fn bytes(ids: &[u32]) -> String {
        String::from_utf8_lossy(&ids.iter().map(|&i| i as u8).collect::<Vec<u8>>()).into_owned()
    }

    fn stream(ids: &[u32], det: &mut Detokenizer) -> (Vec<String>, String) {
        let mut st = DecodeState::default();
        let mut f = bytes;
        let mut parts: Vec<String> = ids.iter().map(|&i| det.step(&mut st, &[i], &mut f)).collect();
        parts.push(det.flush(&mut st, &mut f));
        let whole = parts.concat();
        (parts, whole)
    }

    #[test]
    fn multi_byte_characters_are_held_until_complete() {
        let ids: Vec<u32> = "aé中😀b".bytes().map(u32::from).collect();
        let (parts, whole) = stream(&ids, &mut Detokenizer::default());
        assert_eq!(whole, "aé中😀b");
        assert!(parts.iter().all(|p| !p.contains(REPLACEMENT)), "{parts:?}");
        assert_eq!(parts.iter().filter(|p| !p.is_empty()).count(), 5, "one delta per character: {parts:?}");
    }

    #[test]
    fn stray_bytes_come_out_as_a_full_decode_has_them() {
        // An invalid lead byte followed by text, and an answer ending inside a character.
        let mut ids: Vec<u32> = vec![0xE4, b'x' as u32];
        ids.extend([0xF0, 0x9F]);
        let (_, whole) = stream(&ids, &mut Detokenizer::default());
        assert_eq!(whole, bytes(&ids));
    }
}

#[cfg(test)]
mod real_tokenizer {
    use std::path::Path;

    use super::*;
    use crate::TextTokenizer;

    fn tokenizer() -> TextTokenizer {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/qwen3_5_moe-tiny");
        TextTokenizer::from_dir(&dir).expect("fixture tokenizer")
    }

    /// A 4,000-token answer streams to exactly its full decode, and the detokenizer decodes a bounded
    /// number of ids per token. Re-decoding the whole answer per token (what the server did before) would
    /// pass 4,000 · 4,001 / 2 ≈ 8.0 M ids to the tokenizer; the incremental windows pass a few per token.
    #[test]
    fn a_4000_token_answer_is_detokenized_with_linear_work() {
        let tok = tokenizer();
        let text = "The café served 中文 text, emoji 😀🦀 and ünïcödé; numbers 12345. ".repeat(400);
        let mut ids = tok.encode(&text).expect("encode");
        ids.truncate(4000);
        assert_eq!(ids.len(), 4000, "the answer is long enough");
        let mut det = Detokenizer::default();
        let mut st = DecodeState::default();
        let mut f = |w: &[u32]| tok.decode(w, true).expect("decode");
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&det.step(&mut st, &[id], &mut f));
            assert!(st.window.len() <= 16, "the window stays small ({} ids)", st.window.len());
        }
        streamed.push_str(&det.flush(&mut st, &mut f));
        assert_eq!(streamed, tok.decode(&ids, true).expect("decode"));
        let per_token = det.decoded_ids as f64 / ids.len() as f64;
        assert!(per_token <= 8.0, "{per_token} ids decoded per token: not constant work");
    }

    /// Arbitrary ids, as a random-weight model emits them (stray bytes, special tokens, broken
    /// characters): the stream still concatenates to the full decode, with and without special tokens.
    #[test]
    fn random_ids_stream_to_the_full_decode() {
        let tok = tokenizer();
        let vocab = tok.vocab_size() as u64;
        let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
        for skip in [true, false] {
            for _ in 0..20 {
                let ids: Vec<u32> = (0..64)
                    .map(|_| {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        (x % vocab) as u32
                    })
                    .collect();
                let mut det = Detokenizer::default();
                let mut st = DecodeState { skip_special: skip, ..DecodeState::default() };
                let mut f = |w: &[u32]| tok.decode(w, skip).expect("decode");
                let mut streamed: String = ids.iter().map(|&id| det.step(&mut st, &[id], &mut f)).collect();
                streamed.push_str(&det.flush(&mut st, &mut f));
                assert_eq!(streamed, tok.decode(&ids, skip).expect("decode"), "ids {ids:?}");
            }
        }
    }
}
