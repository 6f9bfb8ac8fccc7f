//! Turning a growing list of generated ids into text deltas: UTF-8-safe incremental detokenization, stop
//! strings (held back while they might still match), and the split of `<think>…</think>` reasoning.

/// Longest suffix of `text` (on a char boundary) that is a proper prefix of one of `pats`.
pub(crate) fn held_suffix(text: &str, pats: &[&str]) -> usize {
    let mut best = 0;
    for p in pats {
        for (i, _) in p.char_indices().skip(1) {
            if text.ends_with(&p[..i]) {
                best = best.max(i);
            }
        }
    }
    best
}

/// Stop-string state of one choice. It sees the answer as deltas (from the incremental detokenizer, which
/// already holds incomplete characters back) and keeps only the text it may still have to cut, so the work
/// per delta is bounded by the stop strings' lengths, not the answer's.
///
/// Invariant: no suffix of the emitted text is a proper prefix of a stop string (such a suffix is held in
/// `pending`), so a stop string can only start inside `pending`.
#[derive(Debug, Default)]
pub struct TextState {
    /// Text received but not emitted: a suffix that may still begin a stop string.
    pending: String,
    /// A stop string ended the text.
    stopped: bool,
    /// Which one.
    matched: Option<String>,
}

impl TextState {
    /// Takes the next delta of the answer and returns the text now safe to emit; a stop string truncates
    /// the text and ends the choice (`stopped()` becomes true). `finished`: the answer ended, release
    /// what is held.
    pub fn advance(&mut self, delta: &str, stops: &[String], finished: bool) -> String {
        if self.stopped {
            return String::new();
        }
        self.pending.push_str(delta);
        if let Some((i, s)) =
            stops.iter().filter_map(|s| self.pending.find(s.as_str()).map(|i| (i, s))).min_by_key(|x| x.0)
        {
            self.pending.truncate(i);
            self.stopped = true;
            self.matched = Some(s.clone());
            return std::mem::take(&mut self.pending);
        }
        let held = if finished {
            0
        } else {
            let pats: Vec<&str> = stops.iter().map(String::as_str).collect();
            held_suffix(&self.pending, &pats)
        };
        let out: String = self.pending.drain(..self.pending.len() - held).collect();
        out
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped
    }

    /// The stop string that ended the text.
    pub fn matched(&self) -> Option<&str> {
        self.matched.as_deref()
    }
}

const THINK_END: &str = "</think>";

/// Routes text to `reasoning_content` until `</think>`, then to `content`. Reasoning is streamed
/// trimmed like the non-streaming `reasoning_content` (`str::trim`): leading whitespace is dropped and
/// trailing whitespace held back until more reasoning text follows, so the deltas concatenate to exactly
/// the non-streaming field.
#[derive(Debug)]
pub struct ReasoningSplit {
    in_reasoning: bool,
    pending: String,
    reasoning_started: bool,
    content_started: bool,
}

impl ReasoningSplit {
    /// `open`: the prompt ended inside `<think>`.
    pub fn new(open: bool) -> Self {
        ReasoningSplit { in_reasoning: open, pending: String::new(), reasoning_started: false, content_started: false }
    }

    fn content(&mut self, s: &str) -> String {
        if self.content_started {
            return s.to_string();
        }
        let t = s.trim_start_matches('\n');
        if !t.is_empty() {
            self.content_started = true;
        }
        t.to_string()
    }

    /// Reasoning text that ends before anything held back (leading whitespace dropped).
    fn reasoning(&mut self, s: &str) -> String {
        let t = if self.reasoning_started { s } else { s.trim_start() };
        if !t.is_empty() {
            self.reasoning_started = true;
        }
        t.to_string()
    }

    /// Splits a delta into (reasoning, content).
    pub fn feed(&mut self, s: &str) -> (String, String) {
        if !self.in_reasoning {
            return (String::new(), self.content(s));
        }
        self.pending.push_str(s);
        if let Some(i) = self.pending.find(THINK_END) {
            let before = self.pending[..i].trim_end().to_string();
            let rest = self.pending[i + THINK_END.len()..].to_string();
            self.pending.clear();
            self.in_reasoning = false;
            return (self.reasoning(&before), self.content(&rest));
        }
        let tag = held_suffix(&self.pending, &[THINK_END]);
        let body = &self.pending[..self.pending.len() - tag];
        let keep = self.pending.len() - body.trim_end().len();
        let out = self.pending[..self.pending.len() - keep].to_string();
        self.pending.drain(..self.pending.len() - keep);
        (self.reasoning(&out), String::new())
    }

    /// What is still held at the end (trailing whitespace of unfinished reasoning is dropped).
    pub fn flush(&mut self) -> (String, String) {
        let p = std::mem::take(&mut self.pending);
        if self.in_reasoning {
            (self.reasoning(p.trim_end()), String::new())
        } else {
            (String::new(), p)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_held_back_then_cut() {
        let stops = vec!["END".to_string()];
        let mut t = TextState::default();
        assert_eq!(t.advance("hello E", &stops, false), "hello ");
        assert_eq!(t.advance("N", &stops, false), "");
        assert_eq!(t.advance("Dx", &stops, false), "");
        assert!(t.stopped());
        assert_eq!(t.advance("more", &stops, false), "", "nothing after a stop");
        let mut u = TextState::default();
        assert_eq!(u.advance("hello E", &stops, false), "hello ");
        assert_eq!(u.advance("x", &stops, false), "Ex");
        assert_eq!(u.advance("E", &stops, false), "");
        assert_eq!(u.advance("", &stops, true), "E", "the end releases a held prefix");
        // A stop string split over three deltas, with text before it in the same delta.
        let mut v = TextState::default();
        let stops = vec!["<stop>".to_string(), "zz".to_string()];
        let out: String = ["ab<s", "to", "p>cd"].iter().map(|d| v.advance(d, &stops, false)).collect();
        assert_eq!(out, "ab");
        assert!(v.stopped());
        assert_eq!(v.matched(), Some("<stop>"));
    }

    #[test]
    fn reasoning_is_split_at_the_closing_tag_even_across_deltas() {
        let mut s = ReasoningSplit::new(true);
        assert_eq!(s.feed("I think</th"), ("I think".into(), String::new()));
        assert_eq!(s.feed("ink>\n\nAnswer"), (String::new(), "Answer".into()));
        assert_eq!(s.feed(" more"), (String::new(), " more".into()));
        let mut ws = ReasoningSplit::new(true);
        let deltas = ["\n", " a", "b \n", " c\n", "\n</think>\n\nok"];
        let streamed: String = deltas.iter().map(|d| ws.feed(d).0).collect();
        let whole = deltas.concat();
        assert_eq!(
            streamed,
            whole[..whole.find(THINK_END).expect("the deltas close </think>")].trim(),
            "streamed = non-streaming trim()"
        );
        assert_eq!(streamed, "ab \n c");
        let mut unfinished = ReasoningSplit::new(true);
        assert_eq!(unfinished.feed("\nx \n"), ("x".into(), String::new()));
        assert_eq!(unfinished.flush(), (String::new(), String::new()));
        let mut plain = ReasoningSplit::new(false);
        assert_eq!(plain.feed("hi"), (String::new(), "hi".into()));
    }
}
