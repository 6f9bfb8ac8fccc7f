//! Route handlers. They parse, validate, ask actors and format; they only await channels.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use osprey_protocol::constraint::Constraint;
use osprey_protocol::prefix::{PrefixCommand, PrefixStats};
use osprey_protocol::tokenizer::{ChatPrompt, CompletionPrompt, PreparedPrompt, TokenizerCommand};
use osprey_protocol::vision::{VisionCommand, VisionStats};
use osprey_protocol::{scheduler::SchedulerCommand, ErrorCode};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::answer::{Answer, Out};
use crate::body::Endpoint;
use crate::error::ApiError;
use crate::generate::{Finish, Generation, LogprobEntry, RequestCtx};
use crate::tools::Call;
use crate::validate::{self, ChatRequest, CompletionRequest, GenParams};
use crate::{AppState, Phase};

pub(crate) fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

pub(crate) fn check_key(state: &AppState, req: &HttpRequest) -> Result<(), ApiError> {
    let Some(key) = &state.cfg.api_key else { return Ok(()) };
    // `Authorization: Bearer` (OpenAI clients) or `x-api-key` (Anthropic clients).
    let bearer =
        req.headers().get("authorization").and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
    let x_key = req.headers().get("x-api-key").and_then(|h| h.to_str().ok());
    if bearer == Some(key.as_str()) || x_key == Some(key.as_str()) {
        Ok(())
    } else {
        Err(ApiError::new(ErrorCode::InvalidApiKey, "a valid API key is required (Authorization: Bearer <key>)"))
    }
}

pub(crate) fn parse<T: serde::de::DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    // From the borrowed tree: no second copy of the whole body.
    <T as serde::Deserialize>::deserialize(body)
        .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("invalid request body: {e}")))
}

pub(crate) async fn prepare(
    state: &AppState,
    make: impl FnOnce(oneshot::Sender<Result<PreparedPrompt, osprey_protocol::RequestError>>) -> TokenizerCommand,
) -> Result<PreparedPrompt, ApiError> {
    let (tx, rx) = oneshot::channel();
    if state.engine.tokenizer.send(make(tx)).is_err() {
        return Err(ApiError::new(ErrorCode::Unavailable, "the tokenizer is gone"));
    }
    Ok(rx.await.map_err(|_| {
        ApiError::new(ErrorCode::EngineError, "the tokenizer failed on this request (a bug: see the server log)")
    })??)
}

/// What differs between chat and completions in the response format.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Chat,
    Completion,
}

fn logprobs_json(kind: Kind, entries: &[LogprobEntry], offset: usize) -> Value {
    match kind {
        Kind::Chat => json!({"content": entries.iter().map(|e| json!({
            "token": e.token, "logprob": e.logprob, "bytes": e.token.as_bytes(),
            "top_logprobs": e.top.iter().map(|(t, l)| json!({"token": t, "logprob": l, "bytes": t.as_bytes()})).collect::<Vec<_>>(),
        })).collect::<Vec<_>>()}),
        Kind::Completion => {
            let mut off = offset;
            let offsets: Vec<usize> = entries
                .iter()
                .map(|e| {
                    let o = off;
                    off += e.token.len();
                    o
                })
                .collect();
            json!({
                "tokens": entries.iter().map(|e| e.token.clone()).collect::<Vec<_>>(),
                "token_logprobs": entries.iter().map(|e| e.logprob).collect::<Vec<_>>(),
                "top_logprobs": entries.iter().map(|e| e.top.iter().map(|(t, l)| (t.clone(), json!(l))).collect::<serde_json::Map<_, _>>()).collect::<Vec<_>>(),
                "text_offset": offsets,
            })
        }
    }
}

struct Ids {
    id: String,
    created: u64,
    model: String,
    /// The request used the deprecated `functions`: its call is a `function_call` (one, not `tool_calls`)
    /// and the answer ends with `finish_reason: "function_call"`.
    legacy: bool,
}

impl Ids {
    /// The `finish_reason` as this answer names it.
    fn finish(&self, f: Finish) -> &'static str {
        if self.legacy && f == Finish::ToolCalls {
            "function_call"
        } else {
            f.openai()
        }
    }
}

fn chunk(kind: Kind, ids: &Ids, delta: Value, logprobs: Value, finish: Option<&str>) -> Value {
    match kind {
        Kind::Chat => {
            json!({"id": ids.id, "object": "chat.completion.chunk", "created": ids.created, "model": ids.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]})
        }
        Kind::Completion => {
            json!({"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
            "choices": [{"index": 0, "text": delta.get("content").cloned().unwrap_or(json!("")), "logprobs": logprobs, "finish_reason": finish}]})
        }
    }
}

fn sse(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// Resolves when a graceful shutdown's grace period is over (never, when nobody drives the phase).
pub(crate) async fn expired(mut phase: watch::Receiver<Phase>) {
    loop {
        if *phase.borrow_and_update() == Phase::Expired {
            return;
        }
        if phase.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

pub(crate) fn shutting_down() -> ApiError {
    ApiError::new(ErrorCode::Unavailable, "the server is shutting down; the generation was stopped")
}

/// Drives an answer into SSE frames until done, the client leaves (send error) or a shutdown's grace
/// period ends (an error event, then `[DONE]`).
async fn stream_task(
    kind: Kind,
    a: Answer,
    ids: Ids,
    include_usage: bool,
    want_logprobs: bool,
    tx: mpsc::Sender<Bytes>,
    phase: watch::Receiver<Phase>,
) {
    if kind == Kind::Chat {
        let first = chunk(kind, &ids, json!({"role": "assistant", "content": ""}), Value::Null, None);
        if tx.send(sse(&first)).await.is_err() {
            return;
        }
    }
    let mut offset = 0;
    let stayed = pump(a, &tx, phase, |out, frames| {
        let delta = match out {
            Ok(Out::Reasoning(r)) => json!({"reasoning_content": r}),
            Ok(Out::Text(t, logprobs)) => {
                if t.is_empty() && logprobs.is_empty() {
                    return false;
                }
                let lp = if want_logprobs { logprobs_json(kind, &logprobs, offset) } else { Value::Null };
                offset += t.len();
                frames.push(sse(&chunk(kind, &ids, json!({"content": t}), lp, None)));
                return false;
            }
            Ok(Out::CallStart { name, .. }) if ids.legacy => json!({"function_call": {"name": name, "arguments": ""}}),
            Ok(Out::CallArgs { fragment, .. }) if ids.legacy => json!({"function_call": {"arguments": fragment}}),
            Ok(Out::CallStart { index, id, name }) => {
                let call =
                    json!({"index": index, "id": id, "type": "function", "function": {"name": name, "arguments": ""}});
                json!({"tool_calls": [call]})
            }
            Ok(Out::CallArgs { index, fragment }) => {
                json!({"tool_calls": [{"index": index, "function": {"arguments": fragment}}]})
            }
            Ok(Out::CallEnd) => return false,
            Ok(Out::Done { finish, usage, .. }) => {
                frames.push(sse(&chunk(kind, &ids, json!({}), Value::Null, Some(ids.finish(finish)))));
                if include_usage {
                    let obj = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                    let u = json!({"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [], "usage": usage.json()});
                    frames.push(sse(&u));
                }
                return true;
            }
            Err(e) => {
                frames.push(sse(&e.body()));
                return true;
            }
        };
        frames.push(sse(&chunk(kind, &ids, delta, Value::Null, None)));
        false
    })
    .await;
    if stayed {
        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
    }
}

/// Streams an answer: each step (or, once a shutdown's grace period is over, an `unavailable` error)
/// goes to `frames`, which appends the SSE frames it makes and says whether the answer is over. Returns
/// false when the client left: a send failed, or the response body was dropped while the answer had
/// nothing to say (queued, or prefilling), which is noticed at once rather than at the first token.
/// Dropping the answer cancels its sequence. Every streaming front end runs on it.
pub(crate) async fn pump(
    mut a: Answer,
    tx: &mpsc::Sender<Bytes>,
    phase: watch::Receiver<Phase>,
    mut frames: impl FnMut(Result<Out, ApiError>, &mut Vec<Bytes>) -> bool,
) -> bool {
    let expiry = expired(phase);
    tokio::pin!(expiry);
    let mut out = Vec::new();
    loop {
        let next = tokio::select! {
            p = a.next() => p,
            () = &mut expiry => Some(Err(shutting_down())),
            () = tx.closed() => return false,
        };
        let Some(next) = next else { return true };
        let done = frames(next, &mut out);
        for f in out.drain(..) {
            if tx.send(f).await.is_err() {
                return false;
            }
        }
        if done {
            return true;
        }
    }
}

/// A named SSE event (`event:` then `data:`), as the Responses and Messages streams send them.
pub(crate) fn sse_event(kind: &str, v: &Value) -> Bytes {
    Bytes::from(format!("event: {kind}\ndata: {v}\n\n"))
}

/// An SSE response fed by `rx`.
pub(crate) fn sse_response(rx: mpsc::Receiver<Bytes>) -> HttpResponse {
    streamed(rx, "text/event-stream")
}

/// A streamed response of `content_type` whose body is what `rx` delivers (SSE, Ollama's NDJSON).
pub(crate) fn streamed(rx: mpsc::Receiver<Bytes>, content_type: &str) -> HttpResponse {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, actix_web::Error>(b), rx))
    });
    HttpResponse::Ok().content_type(content_type).insert_header(("Cache-Control", "no-cache")).streaming(body)
}

async fn respond(
    state: Arc<AppState>,
    kind: Kind,
    prompt: PreparedPrompt,
    gen: GenParams,
    req: &RequestCtx,
) -> Result<HttpResponse, ApiError> {
    let want_logprobs = gen.sampling.logprobs.is_some();
    let (stream, include_usage) = (gen.stream, gen.include_usage);
    let legacy = gen.tools.as_ref().is_some_and(|t| t.legacy);
    let a = start_answer(state.clone(), prompt, gen, req, kind == Kind::Chat).await?;
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let ids = Ids { id: format!("{prefix}-{}", req.id), created: now(), model: state.cfg.model_id.clone(), legacy };
    if stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let phase = state.phase.clone();
        actix_web::rt::spawn(stream_task(kind, a, ids, include_usage, want_logprobs, tx, phase));
        return Ok(sse_response(rx));
    }
    tokio::select! {
        r = collect(kind, a, ids, want_logprobs) => r,
        () = expired(state.phase.clone()) => Err(shutting_down()),
    }
}

/// Starts the generation of a prepared prompt (its grammar, if any, goes to the sampler) as an answer.
pub(crate) async fn start_answer(
    state: Arc<AppState>,
    mut prompt: PreparedPrompt,
    mut gen: GenParams,
    req: &RequestCtx,
    chat: bool,
) -> Result<Answer, ApiError> {
    // The grammar steers the answer to its end as its budget runs out (`max_tokens`, clamped to the room
    // the context and the KV pool leave); a prompt that leaves none is `context_length_exceeded`, not a
    // budget too small for the format.
    let limits = state.cfg.limits();
    let tokens =
        limits.budget(prompt.input_ids.len(), gen.max_tokens).map_err(|e| ApiError::from(e).param("messages"))?;
    let budget = tokens.max_tokens();
    if let Some(c) = &prompt.constraint {
        let shortest = c.grammar.shortest_answer();
        if budget < shortest {
            return Err(ApiError::new(
                ErrorCode::InvalidRequest,
                format!(
                    "max_tokens {budget} cannot hold the shortest answer the output format allows ({shortest} tokens)"
                ),
            )
            .param("max_tokens"));
        }
    }
    gen.sampling.constraint = prompt.constraint.take().map(|c| Constraint { budget: Some(budget), ..c });
    let tools = gen.tools.clone();
    let g = Generation::start(state, prompt, gen, tokens, req, chat).await?;
    Ok(Answer::new(g, tools.as_ref(), req.id))
}

/// The OpenAI `tool_calls` of an answer.
pub(crate) fn calls_json(calls: &[Call]) -> Value {
    calls
        .iter()
        .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
        .collect()
}

async fn collect(kind: Kind, a: Answer, ids: Ids, want_logprobs: bool) -> Result<HttpResponse, ApiError> {
    let (c, finish, usage, _) = a.collect().await?;
    let lp = if want_logprobs { logprobs_json(kind, &c.logprobs, 0) } else { Value::Null };
    let body = match kind {
        Kind::Chat => {
            let mut message = json!({"role": "assistant", "content": c.text});
            if !c.calls.is_empty() {
                let text = c.text.trim();
                message["content"] = if text.is_empty() { Value::Null } else { text.into() };
                if ids.legacy {
                    message["function_call"] = json!({"name": c.calls[0].name, "arguments": c.calls[0].arguments});
                } else {
                    message["tool_calls"] = calls_json(&c.calls);
                }
            }
            if !c.reasoning.is_empty() {
                message["reasoning_content"] = c.reasoning.into();
            }
            json!({"id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
                "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": ids.finish(finish)}], "usage": usage.json()})
        }
        Kind::Completion => {
            json!({"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
            "choices": [{"index": 0, "text": c.text, "logprobs": lp, "finish_reason": finish.openai()}], "usage": usage.json()})
        }
    };
    Ok(HttpResponse::Ok().json(body))
}

pub(crate) fn counted(state: &AppState, r: Result<HttpResponse, ApiError>) -> Result<HttpResponse, ApiError> {
    if r.is_err() {
        state.metrics.failed();
    }
    r
}

/// `POST /v1/chat/completions`.
pub async fn chat(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    state.metrics.request(crate::metrics::Api::Chat);
    let ctx = RequestCtx::new(&state);
    let r = async {
        let body = read_body(&state, &req, payload, Endpoint::Chat).await?;
        let (prepared, gen) = prepare_chat(&state, &body, &ctx).await?;
        respond(state.clone(), Kind::Chat, prepared, gen, &ctx).await
    }
    .await;
    counted(&state, r)
}

/// A request's JSON body, after the API key and shutdown checks (every generating endpoint).
pub(crate) async fn read_body(
    state: &AppState,
    req: &HttpRequest,
    payload: web::Payload,
    endpoint: Endpoint,
) -> Result<Value, ApiError> {
    read_body_within(state, req, payload, state.body_limits(endpoint)).await
}

async fn read_body_within(
    state: &AppState,
    req: &HttpRequest,
    payload: web::Payload,
    lim: crate::body::BodyLimits,
) -> Result<Value, ApiError> {
    check_key(state, req)?;
    check_serving(state)?;
    crate::body::read_json(req, payload, lim).await
}

/// An Ollama request's JSON body: as [`read_body`], but of any `Content-Type` when no browser sent it
/// (`body::BodyLimits::any_type_without_origin`).
pub(crate) async fn read_ollama_body(
    state: &AppState,
    req: &HttpRequest,
    payload: web::Payload,
) -> Result<Value, ApiError> {
    let lim = crate::body::BodyLimits { any_type_without_origin: true, ..state.body_limits(Endpoint::Chat) };
    read_body_within(state, req, payload, lim).await
}

/// A chat completions body (sent by a client, or built by the Responses or Messages front end)
/// validated off the async threads: the template-ready prompt and the generation settings.
pub(crate) async fn validate_chat(state: &Arc<AppState>, body: &Value) -> Result<(ChatPrompt, GenParams), ApiError> {
    let parsed: ChatRequest = parse(body)?;
    let st = state.clone();
    web::block(move || validate::chat(&parsed, &st.cfg))
        .await
        .map_err(|_| ApiError::new(ErrorCode::Unavailable, "validation worker failed"))?
}

/// A chat body validated, rendered and tokenized (its grammar compiled): what every front end runs.
pub(crate) async fn prepare_chat(
    state: &Arc<AppState>,
    body: &Value,
    ctx: &RequestCtx,
) -> Result<(PreparedPrompt, GenParams), ApiError> {
    // Validation may fetch allow-listed media: bounded by the deadline the body and the server set.
    let (mut prompt, gen) = within(early_deadline(state, body, ctx), validate_chat(state, body)).await?;
    let deadline = gen.deadline.map(|d| ctx.started + d);
    prompt.deadline = deadline;
    let span = ctx.span.clone();
    let prepared = within(
        deadline,
        prepare(state, |reply| TokenizerCommand::PrepareChat { prompt: Box::new(prompt), span, reply }),
    )
    .await?;
    Ok((prepared, gen))
}

/// The deadline a request has before its body is validated: the server's, or the body's own
/// `deadline_secs` when it is a positive number, whichever comes first.
fn early_deadline(state: &AppState, body: &Value, ctx: &RequestCtx) -> Option<std::time::Instant> {
    let own = body.get("deadline_secs").and_then(Value::as_f64).filter(|d| d.is_finite() && *d > 0.0);
    let secs = match (own, state.cfg.request_deadline_secs) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    };
    secs.map(|s| ctx.started + std::time::Duration::from_secs_f64(s.min(1e9)))
}

/// `fut`, or 504 `deadline_exceeded` once `deadline` passes (the work behind it stops at its own next
/// check: the tokenizer checks the same deadline between its steps).
pub(crate) async fn within<T>(
    deadline: Option<std::time::Instant>,
    fut: impl std::future::Future<Output = Result<T, ApiError>>,
) -> Result<T, ApiError> {
    let Some(d) = deadline else { return fut.await };
    match tokio::time::timeout_at(tokio::time::Instant::from_std(d), fut).await {
        Ok(r) => r,
        Err(_) => Err(ApiError::new(
            ErrorCode::DeadlineExceeded,
            "the request's deadline passed before its prompt was prepared",
        )
        .param("deadline_secs")),
    }
}

/// `POST /v1/completions`.
pub async fn completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    state.metrics.request(crate::metrics::Api::Completions);
    let ctx = RequestCtx::new(&state);
    let r = async {
        let body = read_body(&state, &req, payload, Endpoint::Completions).await?;
        let (prepared, gen) = prepare_completion(&state, &body, &ctx).await?;
        respond(state.clone(), Kind::Completion, prepared, gen, &ctx).await
    }
    .await;
    counted(&state, r)
}

/// A completions body validated and tokenized (no template): `/v1/completions` and a raw Ollama
/// `/api/generate`.
pub(crate) async fn prepare_completion(
    state: &Arc<AppState>,
    body: &Value,
    ctx: &RequestCtx,
) -> Result<(PreparedPrompt, GenParams), ApiError> {
    let parsed: CompletionRequest = parse(body)?;
    let (prompt, gen): (CompletionPrompt, GenParams) = validate::completion(&parsed, &state.cfg)?;
    let span = ctx.span.clone();
    let deadline = gen.deadline.map(|d| ctx.started + d);
    let prepared =
        within(deadline, prepare(state, |reply| TokenizerCommand::PrepareCompletion { prompt, span, reply })).await?;
    Ok((prepared, gen))
}

/// `GET /v1/models`.
pub async fn models(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    check_key(&state, &req)?;
    let m = model_object(&state);
    // OpenAI's list, with the fields Anthropic's list adds (`has_more`, `first_id`, `last_id`).
    let id = &state.cfg.model_id;
    Ok(HttpResponse::Ok()
        .json(json!({"object": "list", "data": [m], "has_more": false, "first_id": id, "last_id": id})))
}

/// The served model as both SDKs read it: OpenAI's `{id, object: "model", created, owned_by}` and
/// Anthropic's `{type: "model", id, display_name, created_at}` in one object (each client ignores the
/// other's fields), with the context length and capabilities vLLM and llama.cpp report.
fn model_object(state: &AppState) -> Value {
    let mut caps = vec!["text"];
    if state.cfg.vision {
        caps.extend(["vision", "video"]);
    }
    let created_at = rfc3339(state.created);
    json!({
        "id": state.cfg.model_id, "object": "model", "created": state.created, "owned_by": "osprey",
        "type": "model", "display_name": state.cfg.model_id, "created_at": created_at,
        "max_model_len": state.cfg.context_len, "context_length": state.cfg.context_len, "capabilities": caps,
    })
}

/// `secs` since the epoch as RFC 3339 UTC (`1970-01-01T00:00:00Z`), for Anthropic's and Ollama's times.
pub(crate) fn rfc3339(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem / 60 % 60, rem % 60)
}

/// `GET /v1/models/{id}`: the served model, or 404 `model_not_found`.
pub async fn model(
    state: web::Data<AppState>,
    req: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    check_key(&state, &req)?;
    if id.as_str() != state.cfg.model_id {
        let shown = crate::error::shown_id(&id);
        return Err(ApiError::new(
            ErrorCode::ModelNotFound,
            format!("the model `{shown}` does not exist; this server serves `{}`", state.cfg.model_id),
        )
        .param("model"));
    }
    Ok(HttpResponse::Ok().json(model_object(&state)))
}

/// Refuses new work once a shutdown began or the engine stopped.
pub(crate) fn check_serving(state: &AppState) -> Result<(), ApiError> {
    if *state.phase.borrow() != Phase::Serving {
        return Err(ApiError::new(ErrorCode::Unavailable, "the server is shutting down"));
    }
    if let Some(actor) = state.engine.stopped_actor() {
        return Err(ApiError::new(ErrorCode::Unavailable, format!("the engine stopped (the {actor} is gone)")));
    }
    Ok(())
}

/// `GET /health`: 200 once the weights are loaded and the engine runs; 503 while shutting down, and at once
/// when any actor of the engine has stopped (a panic): a load balancer or service manager must not see a
/// zombie as healthy.
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    if let Some(actor) = state.engine.stopped_actor() {
        HttpResponse::ServiceUnavailable().json(json!({"status": "engine_stopped", "actor": actor}))
    } else if *state.phase.borrow() != Phase::Serving {
        HttpResponse::ServiceUnavailable().json(json!({"status": "draining"}))
    } else if state.ready.load(Ordering::Relaxed) {
        HttpResponse::Ok().json(json!({"status": "ok", "model": state.cfg.model_id}))
    } else {
        HttpResponse::ServiceUnavailable().json(json!({"status": "loading"}))
    }
}

/// What the actors report, asked once each (`/metrics` and `/v1/engine/stats`).
pub(crate) async fn engine_snapshot(state: &AppState) -> Result<crate::metrics::Engine, ApiError> {
    let (tx, rx) = oneshot::channel();
    if state.engine.scheduler.send(SchedulerCommand::Stats { reply: tx }).is_err() {
        return Err(ApiError::new(ErrorCode::Unavailable, "the scheduler is gone"));
    }
    let scheduler = rx.await.map_err(|_| ApiError::new(ErrorCode::Unavailable, "the scheduler is gone"))?;
    let vision = match &state.engine.vision {
        Some(vision) => {
            let (tx, rx) = oneshot::channel();
            let _ = vision.send(VisionCommand::Stats { reply: tx });
            rx.await.unwrap_or_default()
        }
        None => VisionStats::default(),
    };
    let prefix = match &state.engine.prefix {
        Some(prefix) => {
            let (tx, rx) = oneshot::channel();
            let _ = prefix.send(PrefixCommand::Stats { reply: tx });
            rx.await.unwrap_or_default()
        }
        None => PrefixStats::default(),
    };
    let experts = match state.engine.experts.as_ref().and_then(|e| e.query()) {
        Some(rx) => rx.await.ok(),
        None => None,
    };
    let (stored, stored_bytes) = state.responses.usage();
    let responses = (stored as u64, stored_bytes as u64);
    Ok(crate::metrics::Engine { scheduler, vision, prefix, experts, responses })
}

/// `GET /metrics` (Prometheus text).
pub async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let body = state.metrics.render(engine_snapshot(&state).await?);
    Ok(HttpResponse::Ok().content_type(crate::metrics::CONTENT_TYPE).body(body))
}

#[cfg(test)]
mod tests {
    #[test]
    fn rfc3339_dates() {
        assert_eq!(super::rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(super::rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(super::rfc3339(1_796_396_796), "2026-12-04T15:06:36Z");
    }
}
