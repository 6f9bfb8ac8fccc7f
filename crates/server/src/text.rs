//! Turning a growing list of generated ids into text deltas: UTF-8-safe incremental detokenization, stop
//! strings (held back while they might still match), and the split of `<think>…</think>` reasoning.

/// Longest suffix of `text` (on a char boundary) that is a proper prefix of one of `pats`.
fn held_suffix(text: &str, pats: &[&str]) -> usize {
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

/// Text emitted so far for one choice.
#[derive(Debug, Default)]
pub struct TextState {
    /// Bytes of the decoded text already emitted.
    emitted: usize,
    /// Final text once a stop string matched.
    stopped: Option<String>,
}

impl TextState {
    /// Given the full decoded text of all generated ids, returns the new safe delta; a stop string
    /// truncates the text and ends the choice (`stopped()` becomes true).
    pub fn advance(&mut self, full: &str, stops: &[String], finished: bool) -> String {
        if self.stopped.is_some() {
            return String::new();
        }
        let stop_at = stops.iter().filter_map(|s| full.find(s.as_str())).min();
        if let Some(i) = stop_at {
            let delta = full[self.emitted.min(i)..i].to_string();
            self.emitted = i;
            self.stopped = Some(full[..i].to_string());
            return delta;
        }
        // A trailing replacement char means a multi-byte character is still incomplete.
        let mut end =
            if !finished && full.ends_with('\u{FFFD}') { full.trim_end_matches('\u{FFFD}').len() } else { full.len() };
        if !finished {
            let pats: Vec<&str> = stops.iter().map(String::as_str).collect();
            end -= held_suffix(&full[..end], &pats);
        }
        if end <= self.emitted {
            return String::new();
        }
        let delta = full[self.emitted..end].to_string();
        self.emitted = end;
        delta
    }

    /// Whether a stop string ended the text.
    pub fn stopped(&self) -> bool {
        self.stopped.is_some()
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
        assert_eq!(t.advance("hello EN", &stops, false), "");
        assert_eq!(t.advance("hello ENDx", &stops, false), "");
        assert!(t.stopped());
        let mut u = TextState::default();
        assert_eq!(u.advance("hello E", &stops, false), "hello ");
        assert_eq!(u.advance("hello Ex", &stops, false), "Ex");
        assert_eq!(u.advance("hello Ex\u{FFFD}", &stops, false), "");
        assert_eq!(u.advance("hello Exé", &stops, true), "é");
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
