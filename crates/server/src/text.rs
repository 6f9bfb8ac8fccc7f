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

/// Routes text to `reasoning_content` until `</think>`, then to `content`.
#[derive(Debug)]
pub struct ReasoningSplit {
    in_reasoning: bool,
    pending: String,
    content_started: bool,
}

impl ReasoningSplit {
    /// `open`: the prompt ended inside `<think>`.
    pub fn new(open: bool) -> Self {
        ReasoningSplit { in_reasoning: open, pending: String::new(), content_started: false }
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

    /// Splits a delta into (reasoning, content).
    pub fn feed(&mut self, s: &str) -> (String, String) {
        if !self.in_reasoning {
            return (String::new(), self.content(s));
        }
        self.pending.push_str(s);
        if let Some(i) = self.pending.find(THINK_END) {
            let reasoning = self.pending[..i].to_string();
            let rest = self.pending[i + THINK_END.len()..].to_string();
            self.pending.clear();
            self.in_reasoning = false;
            return (reasoning, self.content(&rest));
        }
        let keep = held_suffix(&self.pending, &[THINK_END]);
        let out = self.pending[..self.pending.len() - keep].to_string();
        self.pending.drain(..self.pending.len() - keep);
        (out, String::new())
    }

    /// What is still held at the end.
    pub fn flush(&mut self) -> (String, String) {
        let p = std::mem::take(&mut self.pending);
        if self.in_reasoning {
            (p, String::new())
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
        let mut plain = ReasoningSplit::new(false);
        assert_eq!(plain.feed("hi"), (String::new(), "hi".into()));
    }
}
