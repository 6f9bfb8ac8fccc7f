//! One answer as every front end sees it (chat completions, Responses, Messages): reasoning, text and
//! tool calls in order, then how it ended. It wraps a [`Generation`] and, when the request has tools,
//! parses calls out of the answer text. Each front end only formats these events.

use std::collections::VecDeque;

use crate::error::ApiError;
pub use crate::generate::Finish;
use crate::generate::{Generation, LogprobEntry, Piece, Usage};
use crate::tools::{Call, ToolEvent, ToolParser};
use crate::validate::ToolSetup;

/// A step of the answer.
#[derive(Debug)]
pub enum Out {
    /// Reasoning text.
    Reasoning(String),
    /// Answer text, with the logprobs of the tokens it came from.
    Text(String, Vec<LogprobEntry>),
    /// A tool call begins.
    CallStart {
        /// Index among the answer's calls.
        index: usize,
        /// `call_…`.
        id: String,
        /// Function.
        name: String,
    },
    /// More arguments of call `index`.
    CallArgs {
        /// Index.
        index: usize,
        /// Fragment of the arguments' JSON.
        fragment: String,
    },
    /// The call being written is complete (one that never ends was cut off and is also answered as text).
    CallEnd,
    /// The end.
    Done {
        /// Why.
        finish: Finish,
        /// Counts.
        usage: Usage,
        /// The stop string that ended it.
        stop: Option<String>,
    },
}

/// A running answer.
#[derive(Debug)]
pub struct Answer {
    g: Generation,
    tools: Option<ToolParser>,
    queue: VecDeque<Out>,
    /// Text beside tool calls leaves trimmed (see [`Answer::push_text`]): whether text was sent yet, and the
    /// whitespace held until text follows it.
    text_started: bool,
    held_ws: String,
    /// The call being written, held until it closes: a call cut off by `max_tokens` is answered as text,
    /// and a stream cannot take back a call it has begun (see [`Answer::push_tool_events`]).
    open_call: Vec<Out>,
}

/// The whole of an answer.
#[derive(Debug, Default)]
pub struct Collected {
    /// Reasoning (trimmed).
    pub reasoning: String,
    /// Text.
    pub text: String,
    /// Calls.
    pub calls: Vec<Call>,
    /// Logprobs of every token.
    pub logprobs: Vec<LogprobEntry>,
}

impl Answer {
    /// Wraps `g`; `tools` turns on call parsing (call ids are `call_{request}_{index}`).
    pub fn new(g: Generation, tools: Option<&ToolSetup>, request: u64) -> Self {
        let tools = tools.map(|t| ToolParser::new(&t.specs, format!("call_{request}_"), t.parallel));
        Answer { g, tools, queue: VecDeque::new(), text_started: false, held_ws: String::new(), open_call: Vec::new() }
    }

    /// Text of an answer with tools, sent as the whole answer gives it: trimmed (a chat message beside
    /// calls has the trimmed text, null when empty). Whitespace is held until text follows it, so the
    /// newlines around `<tool_call>` blocks never stream as content the whole answer does not have; the
    /// logprobs of held tokens go out at once, with no text.
    fn push_text(&mut self, t: String, logprobs: Vec<LogprobEntry>) {
        let t = if self.text_started { t } else { t.trim_start().to_string() };
        if t.trim_end().is_empty() {
            if self.text_started {
                self.held_ws.push_str(&t);
            }
            if !logprobs.is_empty() {
                self.queue.push_back(Out::Text(String::new(), logprobs));
            }
            return;
        }
        let mut text = std::mem::take(&mut self.held_ws);
        text.push_str(t.trim_end());
        self.held_ws = t[t.trim_end().len()..].to_string();
        self.text_started = true;
        self.queue.push_back(Out::Text(text, logprobs));
    }

    fn push_tool_events(&mut self, events: Vec<ToolEvent>, mut logprobs: Vec<LogprobEntry>) {
        // A call's start and arguments wait for its end, then go out together: a stream then says exactly
        // what the whole answer says (a cut-off call is text in both), at the cost of a call's arguments
        // arriving when the call is complete rather than piece by piece.
        for e in events {
            match e {
                ToolEvent::Text(t) => {
                    // Text while a call is open: the parser gave the call up as malformed (its raw text).
                    self.open_call.clear();
                    self.push_text(t, std::mem::take(&mut logprobs));
                }
                ToolEvent::Start { index, id, name } => self.open_call.push(Out::CallStart { index, id, name }),
                ToolEvent::Args { index, fragment } => self.open_call.push(Out::CallArgs { index, fragment }),
                ToolEvent::End { .. } => {
                    self.queue.extend(self.open_call.drain(..));
                    self.queue.push_back(Out::CallEnd);
                }
            }
        }
        if !logprobs.is_empty() {
            self.queue.push_back(Out::Text(String::new(), logprobs));
        }
    }

    /// The next step; `None` after `Done`.
    pub async fn next(&mut self) -> Option<Result<Out, ApiError>> {
        loop {
            if let Some(o) = self.queue.pop_front() {
                return Some(Ok(o));
            }
            match self.g.next().await? {
                Err(e) => return Some(Err(e)),
                Ok(Piece::Delta { reasoning, content, logprobs }) => {
                    if !reasoning.is_empty() {
                        self.queue.push_back(Out::Reasoning(reasoning));
                    }
                    match self.tools.as_mut() {
                        Some(p) => {
                            let ev = p.feed(&content);
                            self.push_tool_events(ev, logprobs);
                        }
                        None if !content.is_empty() || !logprobs.is_empty() => {
                            self.queue.push_back(Out::Text(content, logprobs))
                        }
                        None => {}
                    }
                }
                Ok(Piece::Done { mut finish, usage, stop }) => {
                    if let Some(p) = self.tools.as_mut() {
                        let (ev, _cut) = p.finish();
                        let called = !p.calls().is_empty();
                        self.push_tool_events(ev, Vec::new());
                        // A call still open was cut off: the parser answered it as text.
                        self.open_call.clear();
                        // A cut-off call is answered as text; the finish reason stays what ended it.
                        if called && finish == Finish::Stop {
                            finish = Finish::ToolCalls;
                        }
                    }
                    self.queue.push_back(Out::Done { finish, usage, stop });
                }
            }
        }
    }

    /// Runs the answer to its end: everything it said, why it ended, its counts and stop string.
    pub async fn collect(mut self) -> Result<(Collected, Finish, Usage, Option<String>), ApiError> {
        let mut c = Collected::default();
        let (finish, usage, stop) = self
            .drive(|o| match o {
                Out::Reasoning(r) => c.reasoning.push_str(&r),
                Out::Text(t, lp) => {
                    c.text.push_str(&t);
                    c.logprobs.extend(lp);
                }
                _ => {}
            })
            .await?;
        c.calls = self.tools.as_ref().map(|p| p.calls().to_vec()).unwrap_or_default();
        c.reasoning = c.reasoning.trim().to_string();
        Ok((c, finish, usage, stop))
    }

    /// Runs the answer to its end, handing every step to `f` (`Done` included); returns how it ended.
    pub async fn drive(&mut self, mut f: impl FnMut(Out)) -> Result<(Finish, Usage, Option<String>), ApiError> {
        while let Some(o) = self.next().await {
            let o = o?;
            let end =
                if let Out::Done { finish, usage, stop } = &o { Some((*finish, *usage, stop.clone())) } else { None };
            f(o);
            if let Some(end) = end {
                return Ok(end);
            }
        }
        Err(ApiError::new(osprey_protocol::ErrorCode::EngineError, "the generation ended without finishing"))
    }
}
