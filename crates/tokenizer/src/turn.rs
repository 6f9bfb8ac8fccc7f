//! Where a conversation's next turn stops matching this turn's prompt (issue 53). A chat prompt ends
//! with the generation prompt (`<|im_start|>assistant\n<think>\n`); the next turn renders the same
//! history, then the reply as a past assistant turn, which templates render differently (without the
//! open `<think>`), so the two prompts part a few tokens before this one's end. Rendering this history
//! with a reply and a new question in place of the generation prompt shows where; the scheduler
//! snapshots the page at or below that point, and the next turn resumes there instead of at an earlier
//! snapshot.

use serde_json::{json, Map, Value};

use crate::{ChatTemplate, TextTokenizer};

/// Tokens of `ids` (the tokens of `text`, `messages` rendered with the generation prompt) that the next
/// turn's prompt shares with them, or `None` where the split between the two renderings does not fall
/// between tokens (then there is no safe point to promise). The split is taken at the first differing
/// byte, or at the line or tag start before it when the tail from there does not tokenize alone into
/// `ids`' tail.
pub(crate) fn turn_end(
    template: &ChatTemplate,
    tok: &TextTokenizer,
    messages: &Value,
    kwargs: &Map<String, Value>,
    text: &str,
    ids: &[u32],
) -> Option<usize> {
    let mut next = messages.as_array()?.clone();
    next.push(json!({"role": "assistant", "content": "."}));
    next.push(json!({"role": "user", "content": "."}));
    let rendered = template.render(&Value::Array(next), false, kwargs).ok()?;
    let mut at = text.bytes().zip(rendered.bytes()).take_while(|(a, b)| a == b).count();
    for _ in 0..4 {
        while !text.is_char_boundary(at) {
            at -= 1;
        }
        let tail = tok.encode(&text[at..]).ok()?;
        if ids.ends_with(&tail) && tail.len() <= ids.len() {
            return Some(ids.len() - tail.len());
        }
        // Back to the start of the line or tag holding the split, and try again.
        at = text[..at].rfind(['\n', '<'])?;
    }
    None
}
