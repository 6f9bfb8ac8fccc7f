//! One request's generation as seen from HTTP: submit to the scheduler, turn engine events into text
//! deltas (with stop strings, reasoning split, logprobs), record latency metrics. Dropping a
//! `Generation` drops its event receiver, which cancels the sequence at the engine's next step.

use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Instant;

use osprey_protocol::runner::TokenLogprobs;
use osprey_protocol::scheduler::{EngineEvent, FinishReason, GenerateRequest, SchedulerCommand, TokenBudget};
use osprey_protocol::tokenizer::{DecodeState, PreparedPrompt, TokenizerCommand};
use osprey_protocol::{ErrorCode, SeqId};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::error::ApiError;
use crate::text::{ReasoningSplit, TextState};
use crate::validate::GenParams;
use crate::AppState;

/// Why an answer ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// End token or stop string.
    Stop,
    /// `max_tokens` or the context.
    Length,
    /// It called tools.
    ToolCalls,
    /// The request's deadline.
    Timeout,
}

impl Finish {
    /// The OpenAI `finish_reason`.
    pub fn openai(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ToolCalls => "tool_calls",
            Finish::Timeout => "timeout",
        }
    }
}

/// Token counts of a finished request.
#[derive(Clone, Copy, Debug, Default)]
pub struct Usage {
    /// Prompt tokens.
    pub prompt: usize,
    /// Of which served from the prefix cache.
    pub cached: usize,
    /// Generated tokens.
    pub completion: usize,
    /// When the first token came (Ollama's prompt and answer durations split there).
    pub first_token_at: Option<Instant>,
}

impl Usage {
    /// The OpenAI `usage` object.
    pub fn json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached},
        })
    }
}

/// One token's logprobs with token texts.
#[derive(Clone, Debug)]
pub struct LogprobEntry {
    /// Token text.
    pub token: String,
    /// log p.
    pub logprob: f32,
    /// Alternatives `(text, logprob)`.
    pub top: Vec<(String, f32)>,
}

/// A piece of output.
#[derive(Debug)]
pub enum Piece {
    /// New text (either part may be empty) and the logprobs of the tokens it came from.
    Delta {
        /// Reasoning text.
        reasoning: String,
        /// Answer text.
        content: String,
        /// Per token.
        logprobs: Vec<LogprobEntry>,
    },
    /// The end.
    Done {
        /// Why (never `ToolCalls`: calls are found above this level).
        finish: Finish,
        /// Counts.
        usage: Usage,
        /// The stop string that ended the answer, if one did.
        stop: Option<String>,
    },
}

/// Who a request is across the engine: its id (the sequence id, and the number in the response id) and
/// its `tracing` span, carried in every message about it so one request can be followed through the log.
#[derive(Debug)]
pub struct RequestCtx {
    /// The id.
    pub id: SeqId,
    /// `request{id=…}`.
    pub span: tracing::Span,
    /// When the HTTP request arrived.
    pub started: Instant,
}

impl RequestCtx {
    /// A new request of `state`.
    pub fn new(state: &AppState) -> Self {
        let id = state.next_id.fetch_add(1, Ordering::Relaxed);
        RequestCtx { id, span: tracing::info_span!("request", id), started: Instant::now() }
    }
}

/// A running generation.
#[derive(Debug)]
pub struct Generation {
    state: Arc<AppState>,
    id: SeqId,
    rx: mpsc::UnboundedReceiver<EngineEvent>,
    gen: GenParams,
    detok: DecodeState,
    text: TextState,
    split: ReasoningSplit,
    started: Instant,
    last_token: Option<Instant>,
    usage: Usage,
    done: bool,
    queue: VecDeque<Piece>,
    /// When the request's deadline passes (from its arrival), if it has one.
    deadline: Option<tokio::time::Instant>,
}

async fn ask<T>(state: &AppState, make: impl FnOnce(oneshot::Sender<T>) -> TokenizerCommand) -> Result<T, ApiError> {
    let (tx, rx) = oneshot::channel();
    if state.engine.tokenizer.send(make(tx)).is_err() {
        return Err(ApiError::new(ErrorCode::Unavailable, "the tokenizer is gone"));
    }
    rx.await.map_err(|_| {
        ApiError::new(ErrorCode::EngineError, "the tokenizer failed on this request (a bug: see the server log)")
    })
}

impl Generation {
    /// Submits `prompt` as request `req` for at most `budget` tokens;
    /// `reasoning` enables the `<think>` split (chat only).
    pub async fn start(
        state: Arc<AppState>,
        prompt: PreparedPrompt,
        gen: GenParams,
        budget: TokenBudget,
        req: &RequestCtx,
        reasoning: bool,
    ) -> Result<Self, ApiError> {
        let (id, started) = (req.id, req.started);
        let deadline = gen.deadline.map(|d| tokio::time::Instant::from_std(started + d));
        let prompt_len = prompt.input_ids.len();
        let (tx, rx) = mpsc::unbounded_channel();
        let open = reasoning && prompt.thinking_open;
        let request = GenerateRequest {
            id,
            prompt: Arc::new(prompt),
            sampling: gen.sampling.clone(),
            budget,
            stop_token_ids: if gen.ignore_eos { Vec::new() } else { state.cfg.eos_token_ids.clone() },
            span: req.span.clone(),
        };
        let (accepted, answer) = oneshot::channel();
        if state
            .engine
            .scheduler
            .send(SchedulerCommand::Submit { request: Box::new(request), events: tx, accepted })
            .is_err()
        {
            return Err(ApiError::new(ErrorCode::Unavailable, "the scheduler is gone"));
        }
        // Refusals (queue full, can never fit) come back before anything streams, as a real HTTP status.
        answer.await.map_err(|_| ApiError::new(ErrorCode::Unavailable, "the scheduler dropped the request"))??;
        Ok(Generation {
            state,
            id,
            rx,
            gen,
            detok: DecodeState { skip_special: true, ..DecodeState::default() },
            text: TextState::default(),
            split: ReasoningSplit::new(open),
            started,
            last_token: None,
            usage: Usage { prompt: prompt_len, ..Usage::default() },
            done: false,
            queue: VecDeque::new(),
            deadline,
        })
    }

    /// Feeds new ids to the incremental detokenizer (the state travels with the request).
    async fn detokenize(&mut self, ids: Vec<u32>, finish: bool) -> Result<String, ApiError> {
        let state = std::mem::take(&mut self.detok);
        let (state, text) =
            ask(&self.state, |reply| TokenizerCommand::DecodeStep { state, ids, finish, reply }).await?;
        self.detok = state;
        Ok(text)
    }

    async fn entries(&self, lp: TokenLogprobs, token: u32) -> Result<LogprobEntry, ApiError> {
        let mut ids = vec![token];
        ids.extend(lp.top.iter().map(|(t, _)| *t));
        let texts = ask(&self.state, |reply| TokenizerCommand::TokenTexts { ids, reply }).await?;
        Ok(LogprobEntry {
            token: texts[0].clone(),
            logprob: lp.logprob,
            top: lp.top.iter().zip(&texts[1..]).map(|((_, l), t)| (t.clone(), *l)).collect(),
        })
    }

    /// The last text (a held-back stop prefix that never matched, a pending tag) as a delta, with
    /// `Done { finish }` queued after it.
    async fn finish(&mut self, finish: Finish) -> Piece {
        let rest = self.detokenize(Vec::new(), true).await;
        let delta = rest.map(|f| self.text.advance(&f, &self.gen.stop, true)).unwrap_or_default();
        let (mut r, mut c) = self.split.feed(&delta);
        let (r2, c2) = self.split.flush();
        r.push_str(&r2);
        c.push_str(&c2);
        self.queue.push_back(Piece::Done { finish, usage: self.usage, stop: None });
        Piece::Delta { reasoning: r, content: c, logprobs: Vec::new() }
    }

    /// The deadline passed: stop the sequence, then end with `finish_reason: "timeout"` and the text so
    /// far, or with `deadline_exceeded` when no token came yet.
    async fn past_deadline(&mut self) -> Result<Piece, ApiError> {
        let _ = self.state.engine.scheduler.send(SchedulerCommand::Cancel { id: self.id });
        self.rx.close();
        self.done = true;
        self.state.metrics.deadline();
        tracing::info!(id = self.id, tokens = self.usage.completion, "deadline passed");
        if self.usage.completion == 0 {
            let secs = self.gen.deadline.unwrap_or_default().as_secs_f64();
            return Err(ApiError::new(
                ErrorCode::DeadlineExceeded,
                format!("the request's deadline of {secs:.1} s passed before its first token"),
            )
            .param("deadline_secs"));
        }
        Ok(self.finish(Finish::Timeout).await)
    }

    /// The next piece; `None` after `Done`.
    pub async fn next(&mut self) -> Option<Result<Piece, ApiError>> {
        if let Some(p) = self.queue.pop_front() {
            return Some(Ok(p));
        }
        if self.done {
            return None;
        }
        loop {
            let deadline = async {
                match self.deadline {
                    Some(at) => tokio::time::sleep_until(at).await,
                    None => std::future::pending().await,
                }
            };
            let ev = tokio::select! {
                ev = self.rx.recv() => ev,
                () = deadline => return Some(self.past_deadline().await),
            };
            let Some(ev) = ev else {
                self.done = true;
                return Some(Err(ApiError::new(ErrorCode::Unavailable, "the engine stopped")));
            };
            match ev {
                EngineEvent::Token { token, logprobs } => {
                    let now = Instant::now();
                    match self.last_token {
                        None => {
                            self.state.metrics.observe_ttft((now - self.started).as_secs_f64());
                            self.usage.first_token_at = Some(now);
                        }
                        Some(t) => self.state.metrics.observe_itl((now - t).as_secs_f64()),
                    }
                    self.last_token = Some(now);
                    self.usage.completion += 1;
                    let text = match self.detokenize(vec![token], false).await {
                        Ok(t) => t,
                        Err(e) => return Some(Err(e)),
                    };
                    let delta = self.text.advance(&text, &self.gen.stop, false);
                    let logprobs = match logprobs {
                        Some(lp) => match self.entries(lp, token).await {
                            Ok(e) => vec![e],
                            Err(e) => return Some(Err(e)),
                        },
                        None => Vec::new(),
                    };
                    let (mut reasoning, mut content) = self.split.feed(&delta);
                    if self.text.stopped() {
                        // A stop string ended the text: stop the engine and finish here.
                        let _ = self.state.engine.scheduler.send(SchedulerCommand::Cancel { id: self.id });
                        let (r, c) = self.split.flush();
                        reasoning.push_str(&r);
                        content.push_str(&c);
                        self.rx.close();
                        self.done = true;
                        let stop = self.text.matched().map(str::to_string);
                        self.queue.push_back(Piece::Done { finish: Finish::Stop, usage: self.usage, stop });
                        return Some(Ok(Piece::Delta { reasoning, content, logprobs }));
                    }
                    if reasoning.is_empty() && content.is_empty() && logprobs.is_empty() {
                        continue;
                    }
                    return Some(Ok(Piece::Delta { reasoning, content, logprobs }));
                }
                EngineEvent::Finished { reason, prompt_tokens, cached_tokens, completion_tokens } => {
                    self.usage = Usage {
                        prompt: prompt_tokens,
                        cached: cached_tokens,
                        completion: completion_tokens,
                        first_token_at: self.usage.first_token_at,
                    };
                    self.done = true;
                    let finish = match reason {
                        FinishReason::Stop => Finish::Stop,
                        FinishReason::Length => Finish::Length,
                    };
                    return Some(Ok(self.finish(finish).await));
                }
                EngineEvent::Failed(e) => {
                    self.done = true;
                    return Some(Err(ApiError(e)));
                }
            }
        }
    }
}
