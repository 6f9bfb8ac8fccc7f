//! Wrapping an answer up inside its token budget.
//!
//! A grammar says what may come next, not when the answer ends. So a matcher with a budget measures,
//! from where the answer stands, the shortest way to close it: the tokens a closing walk takes, choosing
//! at each step the token that closes the innermost open construct (below), and the end token once the
//! grammar allows it. When the budget left comes within a margin of that distance, the matcher wraps
//! up: from then on it keeps, among the allowed tokens, only the best class that has one:
//!
//! 1. the end-of-answer tokens;
//! 2. the `<` of a closing tag right after a line break, then a line break followed by `<`, then a lone
//!    line break unless one just ended (tool-call tags start a line; a second one is blank space);
//! 3. inside a JSON string, a token that starts with its closing `"` (a `}` or `]` there is only a
//!    character; once counted as a closer, it ran `{"description": "...red}}}}}}` to the limit);
//!    outside one, a token made only of `}` and `]`;
//! 4. a comma (it ends a number or a value; the grammar then forces the keys still required).
//!
//! When no class has an allowed token, the walk takes, where the grammar forces text (a required key, a
//! tag name), the longest allowed token of that text; else (a value must start: a digit, `"`, `[`; a
//! number's next digit) the first of the [`LOOKAHEAD`] lowest allowed ids after which a closing token
//! is allowed, else the lowest allowed id, which in a byte-level vocabulary is a one-byte token. While
//! wrapping up, the model keeps its choice among the tokens that do to the structure what the walk's
//! token does ([`Tiers::wrap`]), so its answer is no longer than the walk.

use llguidance::Matcher;
use osprey_protocol::constraint::GrammarError;
use toktrie::TokTrie;

/// Where the answer's text stands, tracked over the bytes of its tokens: inside a JSON string (and
/// after its escape character), after a line break. A raw line break ends any string: osprey's JSON
/// layout writes none, so one only appears in tool-call text, where quotes mean nothing.
#[derive(Clone, Debug, Default)]
pub(crate) struct Lex {
    in_string: bool,
    escaped: bool,
    after_nl: bool,
    /// The last token and how many times in a row it came (the walk avoids a third repeat where it
    /// chooses freely: `0.000…` never exceeds an exclusive minimum of 0).
    last: Option<u32>,
    repeats: u32,
}

impl Lex {
    /// Advances over token `t` of bytes `bytes`.
    pub(crate) fn feed_token(&mut self, t: u32, bytes: &[u8]) {
        self.repeats = if self.last == Some(t) { self.repeats + 1 } else { 1 };
        self.last = Some(t);
        self.feed(bytes);
    }

    /// Advances over `bytes`.
    pub(crate) fn feed(&mut self, bytes: &[u8]) {
        for &b in bytes {
            if b == b'\n' {
                self.in_string = false;
                self.escaped = false;
            } else if self.in_string {
                if self.escaped {
                    self.escaped = false;
                } else if b == b'\\' {
                    self.escaped = true;
                } else if b == b'"' {
                    self.in_string = false;
                }
            } else if b == b'"' {
                self.in_string = true;
            }
        }
        if let Some(&last) = bytes.last() {
            self.after_nl = last == b'\n';
        }
    }
}

/// Token classes of the wrap-up, one bit per token, and each token's bytes.
#[derive(Debug)]
pub(crate) struct Tiers {
    words: Vec<Vec<u8>>,
    eos: Vec<u32>,
    /// Tokens that start with `<` (a closing tag, once a line has ended).
    lt: Vec<u32>,
    /// Tokens that start with a line break and `<`.
    nl_lt: Vec<u32>,
    /// A lone line break.
    nl: Vec<u32>,
    /// Tokens that start with `"` followed only by `"`, `}`, `]`, `,` and spaces: they close a string.
    quote: Vec<u32>,
    /// Tokens made only of `}` and `]`: they close objects and arrays.
    brace: Vec<u32>,
    /// Tokens with a byte that can change the structure ([`STRUCTURAL`]).
    structural: Vec<u32>,
    /// A comma, perhaps with the layout's space.
    comma: Vec<u32>,
    /// One-byte tokens that close something, by byte: `"`, `}`, `]`, `,` and a line break (what the
    /// walk's lookahead tries after a candidate).
    closers: Vec<(u8, u32)>,
}

/// Most allowed tokens at which a choice is a fork in fixed text (a tag name, an enum value, a number's
/// digits, text the grammar forces); past it the choice is free content, such as a string's text.
pub(crate) const FEW_CHOICES: usize = 64;

/// Allowed tokens, lowest ids first, that the walk tries for one that lets the answer close next, where
/// no class has a token. Ten covers the digits, one of which always ends a number's step.
const LOOKAHEAD: usize = 10;

/// Bytes that can change what must follow: JSON's brackets, commas, colons and quotes, and the line
/// breaks and `<` of tool-call tags (a line break after a call can start another call).
const STRUCTURAL: &[u8] = b"\"{}[],:\n<";

/// What token `w` does to the structure when written from `lex`: its string-boundary quotes and, outside
/// strings, its brackets, commas and colons, in order (empty for plain content).
pub(crate) fn structure(lex: &Lex, w: &[u8]) -> Vec<u8> {
    let mut l = lex.clone();
    let mut out = Vec::new();
    for &b in w {
        let was = l.in_string;
        l.feed(&[b]);
        if was != l.in_string || (!was && STRUCTURAL.contains(&b)) {
            out.push(b);
        }
    }
    out
}

/// The ids of the set bits of `words`, lowest first.
pub(crate) fn ids(words: impl IntoIterator<Item = u32>) -> impl Iterator<Item = u32> {
    words.into_iter().enumerate().flat_map(|(i, mut w)| {
        std::iter::from_fn(move || {
            (w != 0).then(|| {
                let b = w.trailing_zeros();
                w &= w - 1;
                i as u32 * 32 + b
            })
        })
    })
}

pub(crate) fn has(bits: &[u32], t: u32) -> bool {
    bits.get(t as usize / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

impl Tiers {
    pub(crate) fn new(words: &[Vec<u8>], eos: &[u32]) -> Self {
        let n = words.len().div_ceil(32);
        let set = |pick: &dyn Fn(&[u8]) -> bool| {
            let mut bits = vec![0u32; n];
            for (t, w) in words.iter().enumerate() {
                if w.first() != Some(&TokTrie::SPECIAL_TOKEN_MARKER) && pick(w) {
                    bits[t / 32] |= 1 << (t % 32);
                }
            }
            bits
        };
        let mut eos_bits = vec![0u32; n];
        eos.iter().filter(|&&t| (t as usize) < words.len()).for_each(|&t| eos_bits[t as usize / 32] |= 1 << (t % 32));
        Tiers {
            words: words.to_vec(),
            eos: eos_bits,
            lt: set(&|w| w.first() == Some(&b'<')),
            nl_lt: set(&|w| w.starts_with(b"\n<")),
            nl: set(&|w| w == b"\n"),
            quote: set(&|w| {
                w.first() == Some(&b'"') && w[1..].iter().all(|b| matches!(b, b'"' | b'}' | b']' | b',' | b' '))
            }),
            brace: set(&|w| !w.is_empty() && w.iter().all(|b| matches!(b, b'}' | b']'))),
            comma: set(&|w| w.first() == Some(&b',') && w[1..].iter().all(|b| *b == b' ')),
            structural: set(&|w| w.iter().any(|b| STRUCTURAL.contains(b))),
            closers: b"\"}],\n"
                .iter()
                .filter_map(|&b| words.iter().position(|w| w.as_slice() == [b]).map(|t| (b, t as u32)))
                .collect(),
        }
    }

    /// Whether token `t` has a structural byte.
    pub(crate) fn is_structural(&self, t: u32) -> bool {
        has(&self.structural, t)
    }

    /// The bytes of token `t` (empty for ids past the vocabulary).
    pub(crate) fn word(&self, t: u32) -> &[u8] {
        self.words.get(t as usize).map_or(&[], Vec::as_slice)
    }

    /// `allowed` narrowed to the best class that keeps a token (see the module docs); unchanged when
    /// none does.
    pub(crate) fn narrow(&self, allowed: &mut [u32], lex: &Lex) -> bool {
        // Right after a line break a tag may start; another line break would only be blank space.
        let (lt, nl): (&[u32], &[u32]) = if lex.after_nl { (&self.lt, &[]) } else { (&[], &self.nl) };
        let close: &[u32] = if lex.in_string { &self.quote } else { &self.brace };
        for tier in [&self.eos[..], lt, &self.nl_lt, nl, close, &self.comma] {
            if allowed.iter().zip(tier).any(|(a, t)| a & t != 0) {
                allowed.iter_mut().enumerate().for_each(|(i, a)| *a &= tier.get(i).copied().unwrap_or(0));
                return true;
            }
        }
        false
    }

    /// What a wrapping-up matcher allows: the tokens of the best class that do to the structure exactly
    /// what the closing walk's own token does ([`structure`]), so the answer stays on the measured path:
    /// `",` or `"}` in place of `"` could open an optional property. Where no class has a token, the
    /// walk's own token only (a free choice there, `["` for `[` or one more digit, could lengthen it).
    pub(crate) fn wrap(&self, m: &mut Matcher, allowed: &mut [u32], lex: &Lex) {
        let Some((pick, classed)) = self.pick(m, allowed, lex) else { return };
        if !classed {
            allowed.iter_mut().for_each(|w| *w = 0);
            allowed[pick as usize / 32] |= 1 << (pick % 32);
            return;
        }
        let want = structure(lex, self.word(pick));
        for (i, w) in allowed.iter_mut().enumerate() {
            let mut bits = *w;
            while bits != 0 {
                let b = bits.trailing_zeros();
                bits &= bits - 1;
                let t = i as u32 * 32 + b;
                if t != pick && structure(lex, self.word(t)) != want {
                    *w &= !(1 << b);
                }
            }
        }
    }

    /// The closing walk's token, and whether a class had it: the lowest id of the best class; where no
    /// class has a token, the first of the lowest [`LOOKAHEAD`] allowed ids after which a closing token
    /// is allowed (a number under `multipleOf: 7` ends with the digit that makes a multiple, where the
    /// lowest digit wrote `2001001…` forever), else the lowest, skipping a token that came twice in a
    /// row already when there is another.
    fn pick(&self, m: &mut Matcher, allowed: &mut [u32], lex: &Lex) -> Option<(u32, bool)> {
        let classed = self.narrow(allowed, lex);
        if !classed {
            // Text the grammar forces (a tag name, a key) is written in the longest allowed tokens that
            // it starts with. Forced text allows few tokens (its prefixes); where many are allowed, none
            // is forced.
            if ids(allowed.iter().copied()).nth(FEW_CHOICES).is_none() {
                let forced = m.compute_ff_bytes();
                let longest = ids(allowed.iter().copied())
                    .filter(|&t| !self.word(t).is_empty() && forced.starts_with(self.word(t)))
                    .max_by_key(|&t| (self.word(t).len(), std::cmp::Reverse(t)));
                if let Some(t) = longest {
                    return Some((t, false));
                }
            }
            if let Some(t) = ids(allowed.iter().copied()).take(LOOKAHEAD).find(|&t| self.closes_after(m, t, lex)) {
                return Some((t, false));
            }
        }
        let mut ids = ids(allowed.iter().copied());
        let first = ids.next()?;
        if lex.repeats >= 2 && lex.last == Some(first) {
            if let Some(other) = ids.next() {
                return Some((other, classed));
            }
        }
        Some((first, classed))
    }

    /// Whether, after token `t`, the grammar allows a token that closes something from where the text
    /// then stands (the end of the answer; a closing quote inside a string; else a bracket, a comma or
    /// a line break). `m` is left as it was.
    fn closes_after(&self, m: &mut Matcher, t: u32, lex: &Lex) -> bool {
        let mut after = lex.clone();
        after.feed(self.word(t));
        let wanted: &[u8] = if after.in_string { b"\"" } else { b"}],\n" };
        let closer = self.closers.iter().filter(|(b, _)| wanted.contains(b));
        if closer.into_iter().any(|&(_, c)| m.validate_tokens(&[t, c]).is_ok_and(|n| n == 2)) {
            return true;
        }
        if m.consume_token(t).is_err() {
            return false;
        }
        let accepting = m.is_accepting().unwrap_or(false);
        m.rollback(1).is_ok() && accepting
    }

    fn is_eos(&self, t: u32) -> bool {
        has(&self.eos, t)
    }
}

/// Tokens the closing walk takes from `m`'s state to the end token included, at most `cap` (a walk
/// that does not end by then, or fails, counts as `cap`). `m` is left as it was (the walk's tokens are
/// rolled back).
pub(crate) fn distance(m: &mut Matcher, tiers: &Tiers, lex: &Lex, cap: usize) -> Result<usize, GrammarError> {
    distance_until(m, tiers, lex, cap, &|| false)
}

/// [`distance`] that also ends when `enough()` says so (checked before each step, each of which computes
/// one token mask): then the steps walked so far, a lower bound of the distance.
pub(crate) fn distance_until(
    m: &mut Matcher,
    tiers: &Tiers,
    lex: &Lex,
    cap: usize,
    enough: &dyn Fn() -> bool,
) -> Result<usize, GrammarError> {
    let mut lex = lex.clone();
    let mut consumed = 0;
    let mut steps = 0;
    let result = loop {
        if steps >= cap {
            break cap;
        }
        if enough() {
            break steps;
        }
        let Ok(mask) = m.compute_mask_or_eos() else { break cap };
        let mut bits = mask.as_slice().to_vec();
        let Some((t, _)) = tiers.pick(m, &mut bits, &lex) else { break cap };
        steps += 1;
        if tiers.is_eos(t) || m.is_stopped() {
            break steps;
        }
        if m.consume_token(t).is_err() {
            break cap;
        }
        consumed += 1;
        lex.feed_token(t, tiers.word(t));
    };
    m.rollback(consumed).map_err(|e| GrammarError(e.to_string()))?;
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lexer_knows_when_a_quote_closes_a_string() {
        let mut l = Lex::default();
        l.feed(br#"{"a": "x}]\"y"#);
        assert!(l.in_string, "an escaped quote and braces inside do not close it");
        l.feed(b"\"");
        assert!(!l.in_string);
        l.feed(b", \"b\\\\");
        assert!(l.in_string && !l.escaped, "an escaped backslash");
        l.feed(b"\n");
        assert!(!l.in_string && l.after_nl, "a raw line break ends any string");
    }
}
