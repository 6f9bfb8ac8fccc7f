//! Route handlers. They parse, validate, ask actors and format; they only await channels.

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use osprey_protocol::experts::ResidencyCommand;
use osprey_protocol::prefix::{PrefixCommand, PrefixStats};
use osprey_protocol::tokenizer::{CompletionPrompt, PreparedPrompt, TokenizerCommand};
use osprey_protocol::vision::{VisionCommand, VisionStats};
use osprey_protocol::{scheduler::SchedulerCommand, ErrorCode};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot, watch};

use crate::error::ApiError;
use crate::generate::{Generation, LogprobEntry, Piece, RequestCtx, Usage};
use crate::validate::{self, ChatRequest, CompletionRequest, GenParams};
use crate::{AppState, Phase, ServerConfig};

fn now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0)
}

fn check_key(state: &AppState, req: &HttpRequest) -> Result<(), ApiError> {
    let Some(key) = &state.cfg.api_key else { return Ok(()) };
    let given =
        req.headers().get("authorization").and_then(|h| h.to_str().ok()).and_then(|h| h.strip_prefix("Bearer "));
    if given == Some(key.as_str()) {
        Ok(())
    } else {
        Err(ApiError::new(ErrorCode::InvalidApiKey, "a valid API key is required (Authorization: Bearer <key>)"))
    }
}

fn parse<T: serde::de::DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_json::from_value(body.clone())
        .map_err(|e| ApiError::new(ErrorCode::InvalidRequest, format!("invalid request body: {e}")))
}

async fn prepare(
    state: &AppState,
    make: impl FnOnce(oneshot::Sender<Result<PreparedPrompt, osprey_protocol::RequestError>>) -> TokenizerCommand,
) -> Result<PreparedPrompt, ApiError> {
    let (tx, rx) = oneshot::channel();
    if state.tokenizer.send(make(tx)).is_err() {
        return Err(ApiError::new(ErrorCode::Unavailable, "the tokenizer is gone"));
    }
    Ok(rx.await.map_err(|_| ApiError::new(ErrorCode::Unavailable, "the tokenizer dropped the request"))??)
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
async fn expired(mut phase: watch::Receiver<Phase>) {
    loop {
        if *phase.borrow_and_update() == Phase::Expired {
            return;
        }
        if phase.changed().await.is_err() {
            std::future::pending::<()>().await;
        }
    }
}

fn shutting_down() -> ApiError {
    ApiError::new(ErrorCode::Unavailable, "the server is shutting down; the generation was stopped")
}

/// Drives a generation into SSE frames until done, the client leaves (send error) or a shutdown's grace
/// period ends (an error event, then `[DONE]`).
async fn stream_task(
    kind: Kind,
    mut g: Generation,
    ids: Ids,
    include_usage: bool,
    want_logprobs: bool,
    tx: mpsc::Sender<Bytes>,
    phase: watch::Receiver<Phase>,
) {
    let expiry = expired(phase);
    tokio::pin!(expiry);
    if kind == Kind::Chat {
        let first = chunk(kind, &ids, json!({"role": "assistant", "content": ""}), Value::Null, None);
        if tx.send(sse(&first)).await.is_err() {
            return;
        }
    }
    let mut offset = 0;
    loop {
        let piece = tokio::select! {
            p = g.next() => p,
            () = &mut expiry => Some(Err(shutting_down())),
        };
        let Some(piece) = piece else { break };
        let frame = match piece {
            Ok(Piece::Delta { reasoning, content, logprobs }) => {
                let mut delta = serde_json::Map::new();
                if !reasoning.is_empty() {
                    delta.insert("reasoning_content".into(), reasoning.into());
                }
                if !content.is_empty() || kind == Kind::Completion {
                    delta.insert("content".into(), content.clone().into());
                }
                if delta.is_empty() && logprobs.is_empty() {
                    continue;
                }
                let lp = if want_logprobs { logprobs_json(kind, &logprobs, offset) } else { Value::Null };
                offset += content.len();
                chunk(kind, &ids, Value::Object(delta), lp, None)
            }
            Ok(Piece::Done { finish, usage }) => {
                let last = chunk(kind, &ids, json!({}), Value::Null, Some(finish));
                if tx.send(sse(&last)).await.is_err() {
                    return;
                }
                if include_usage {
                    let obj = if kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" };
                    let u = json!({"id": ids.id, "object": obj, "created": ids.created, "model": ids.model, "choices": [], "usage": usage.json()});
                    if tx.send(sse(&u)).await.is_err() {
                        return;
                    }
                }
                break;
            }
            Err(e) => {
                let _ = tx.send(sse(&e.body())).await;
                break;
            }
        };
        if tx.send(sse(&frame)).await.is_err() {
            return; // client left: dropping `g` cancels the sequence
        }
    }
    let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
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
    let g = Generation::start(state.clone(), prompt, gen, req, kind == Kind::Chat).await?;
    let prefix = if kind == Kind::Chat { "chatcmpl" } else { "cmpl" };
    let ids = Ids { id: format!("{prefix}-{}", req.id), created: now(), model: state.cfg.model_id.clone() };
    if stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        let phase = state.phase.clone();
        actix_web::rt::spawn(stream_task(kind, g, ids, include_usage, want_logprobs, tx, phase));
        let body = futures_util::stream::unfold(rx, |mut rx| async move {
            rx.recv().await.map(|b| (Ok::<_, actix_web::Error>(b), rx))
        });
        return Ok(HttpResponse::Ok()
            .content_type("text/event-stream")
            .insert_header(("Cache-Control", "no-cache"))
            .streaming(body));
    }
    tokio::select! {
        r = collect(kind, g, ids, want_logprobs) => r,
        () = expired(state.phase.clone()) => Err(shutting_down()),
    }
}

async fn collect(kind: Kind, mut g: Generation, ids: Ids, want_logprobs: bool) -> Result<HttpResponse, ApiError> {
    let (mut reasoning, mut content, mut entries) = (String::new(), String::new(), Vec::new());
    let mut end: Option<(&str, Usage)> = None;
    while let Some(piece) = g.next().await {
        match piece? {
            Piece::Delta { reasoning: r, content: c, logprobs } => {
                reasoning.push_str(&r);
                content.push_str(&c);
                entries.extend(logprobs);
            }
            Piece::Done { finish, usage } => end = Some((finish, usage)),
        }
    }
    let (finish, usage) =
        end.ok_or_else(|| ApiError::new(ErrorCode::EngineError, "the generation ended without finishing"))?;
    let lp = if want_logprobs { logprobs_json(kind, &entries, 0) } else { Value::Null };
    let body = match kind {
        Kind::Chat => {
            let mut message = json!({"role": "assistant", "content": content});
            if !reasoning.is_empty() {
                message["reasoning_content"] = reasoning.trim().into();
            }
            json!({"id": ids.id, "object": "chat.completion", "created": ids.created, "model": ids.model,
                "choices": [{"index": 0, "message": message, "logprobs": lp, "finish_reason": finish}], "usage": usage.json()})
        }
        Kind::Completion => {
            json!({"id": ids.id, "object": "text_completion", "created": ids.created, "model": ids.model,
            "choices": [{"index": 0, "text": content, "logprobs": lp, "finish_reason": finish}], "usage": usage.json()})
        }
    };
    Ok(HttpResponse::Ok().json(body))
}

fn counted(state: &AppState, r: Result<HttpResponse, ApiError>) -> Result<HttpResponse, ApiError> {
    if r.is_err() {
        state.metrics.failed_requests.fetch_add(1, Ordering::Relaxed);
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
    state.metrics.chat_requests.fetch_add(1, Ordering::Relaxed);
    let ctx = RequestCtx::new(&state);
    let r = async {
        check_key(&state, &req)?;
        check_serving(&state)?;
        let body = crate::body::read_json(&req, payload, state.body_limits()).await?;
        let parsed: ChatRequest = parse(&body)?;
        let st = state.clone();
        let (prompt, gen) = web::block(move || validate::chat(&parsed, &st.cfg))
            .await
            .map_err(|_| ApiError::new(ErrorCode::Unavailable, "validation worker failed"))??;
        let span = ctx.span.clone();
        let prepared = prepare(&state, |reply| TokenizerCommand::PrepareChat { prompt, span, reply }).await?;
        respond(state.clone(), Kind::Chat, prepared, gen, &ctx).await
    }
    .await;
    counted(&state, r)
}

/// `POST /v1/completions`.
pub async fn completions(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    state.metrics.completion_requests.fetch_add(1, Ordering::Relaxed);
    let ctx = RequestCtx::new(&state);
    let r = async {
        check_key(&state, &req)?;
        check_serving(&state)?;
        let body = crate::body::read_json(&req, payload, state.body_limits()).await?;
        let parsed: CompletionRequest = parse(&body)?;
        let (prompt, gen): (CompletionPrompt, GenParams) = validate::completion(&parsed, &state.cfg)?;
        let span = ctx.span.clone();
        let prepared = prepare(&state, |reply| TokenizerCommand::PrepareCompletion { prompt, span, reply }).await?;
        respond(state.clone(), Kind::Completion, prepared, gen, &ctx).await
    }
    .await;
    counted(&state, r)
}

/// What the chat (`chat: true`) or completions endpoint checks in a body before the tokenizer sees it:
/// JSON, request shape, parameters and media URLs (data URLs decoded, remote ones only if allow-listed),
/// ending in the prompt it would send to the tokenizer. The fuzz targets' entry (`crates/fuzz`).
pub fn check_body(chat: bool, body: &[u8], cfg: &ServerConfig) -> Result<(), ApiError> {
    let body = crate::body::parse_json(body)?;
    if chat {
        validate::chat(&parse::<ChatRequest>(&body)?, cfg).map(drop)
    } else {
        validate::completion(&parse::<CompletionRequest>(&body)?, cfg).map(drop)
    }
}

/// `GET /v1/models`.
pub async fn models(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    check_key(&state, &req)?;
    let mut caps = vec!["text"];
    if state.cfg.vision {
        caps.extend(["vision", "video"]);
    }
    Ok(HttpResponse::Ok().json(json!({"object": "list", "data": [{
        "id": state.cfg.model_id, "object": "model", "created": state.created, "owned_by": "osprey",
        "max_model_len": state.cfg.context_len, "context_length": state.cfg.context_len, "capabilities": caps,
    }]})))
}

/// Refuses new work once a shutdown began.
fn check_serving(state: &AppState) -> Result<(), ApiError> {
    if *state.phase.borrow() != Phase::Serving {
        return Err(ApiError::new(ErrorCode::Unavailable, "the server is shutting down"));
    }
    Ok(())
}

/// `GET /health`: 200 once the weights are loaded and the engine runs; 503 while shutting down.
pub async fn health(state: web::Data<AppState>) -> HttpResponse {
    if *state.phase.borrow() != Phase::Serving {
        HttpResponse::ServiceUnavailable().json(json!({"status": "draining"}))
    } else if state.ready.load(Ordering::Relaxed) {
        HttpResponse::Ok().json(json!({"status": "ok", "model": state.cfg.model_id}))
    } else {
        HttpResponse::ServiceUnavailable().json(json!({"status": "loading"}))
    }
}

/// `GET /metrics` (Prometheus text).
pub async fn metrics(state: web::Data<AppState>) -> Result<HttpResponse, ApiError> {
    let (tx, rx) = oneshot::channel();
    if state.scheduler.send(SchedulerCommand::Stats { reply: tx }).is_err() {
        return Err(ApiError::new(ErrorCode::Unavailable, "the scheduler is gone"));
    }
    let s = rx.await.map_err(|_| ApiError::new(ErrorCode::Unavailable, "the scheduler is gone"))?;
    let v = match &state.vision {
        Some(vision) => {
            let (tx, rx) = oneshot::channel();
            let _ = vision.send(VisionCommand::Stats { reply: tx });
            rx.await.unwrap_or_default()
        }
        None => VisionStats::default(),
    };
    let p = match &state.prefix {
        Some(prefix) => {
            let (tx, rx) = oneshot::channel();
            let _ = prefix.send(PrefixCommand::Stats { reply: tx });
            rx.await.unwrap_or_default()
        }
        None => PrefixStats::default(),
    };
    let mut body = state.metrics.render(&s, &v, &p);
    if let Some(experts) = &state.experts {
        let (tx, rx) = oneshot::channel();
        let _ = experts.send(ResidencyCommand::Stats { reply: tx });
        if let Ok(e) = rx.await {
            body.push_str(&crate::metrics::render_experts(&e));
        }
    }
    if let Some(extra) = &state.extra_metrics {
        body.push_str(&(extra.0)());
    }
    Ok(HttpResponse::Ok().content_type("text/plain; version=0.0.4").body(body))
}
