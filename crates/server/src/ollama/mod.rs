//! The Ollama API (`/api/chat`, `/api/generate`, `/api/tags`, `/api/show`, `/api/ps`, `/api/version`),
//! for the front ends that speak it (Home Assistant, Open WebUI, editor and phone clients). A request is
//! translated into a chat (or completions) body (`request.rs`) and runs on the same path as
//! `/v1/chat/completions`; the answer comes back in Ollama's shape: NDJSON lines by default, one object
//! with `stream: false`, Ollama's `done_reason` and timing fields (nanoseconds). Errors are Ollama's
//! `{"error": "..."}` with the status the OpenAI endpoints give.

mod request;

use std::sync::Arc;
use std::time::Instant;

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse, ResponseError};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use crate::answer::{Answer, Finish, Out};
use crate::error::ApiError;
use crate::generate::{RequestCtx, Usage};
use crate::handlers::{self, expired, pump, shutting_down};
use crate::AppState;

pub use request::is_ours;

/// The Ollama release whose API this one follows, as `/api/version` reports it (clients compare it to
/// decide which fields they may send).
pub const API_VERSION: &str = "0.12.0";

/// Largest `/api/show` body (it names a model).
const SHOW_MAX_BYTES: usize = 64 << 10;

/// An error in Ollama's shape.
#[derive(Debug)]
pub struct OllamaError(ApiError);

impl From<ApiError> for OllamaError {
    fn from(e: ApiError) -> Self {
        OllamaError(e)
    }
}

impl std::fmt::Display for OllamaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// `{"error": "<param>: <message>"}`, the parameter named as an Ollama client wrote it (in the message
/// too, where a check shared with chat completions named chat's: `max_tokens 3 cannot hold…`).
fn body(e: &ApiError) -> Value {
    let msg = e.message();
    let msg = match &e.param_name() {
        Some(p) if msg.contains(p.as_str()) => msg.replace(p.as_str(), &request::param(p)),
        Some(p) => format!("{}: {msg}", request::param(p)),
        None => msg,
    };
    json!({"error": msg})
}

impl ResponseError for OllamaError {
    fn status_code(&self) -> StatusCode {
        self.0.status_code()
    }

    fn error_response(&self) -> HttpResponse {
        crate::error::rewrapped(&self.0, &body(&self.0))
    }
}

/// Which endpoint an answer is written for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Api {
    Chat,
    Generate,
}

/// The served model's name as Ollama lists it (its id, tagged `latest` unless it has a tag).
fn name(state: &AppState) -> String {
    let id = &state.cfg.model_id;
    if id.contains(':') {
        id.clone()
    } else {
        format!("{id}:latest")
    }
}

/// When the request arrived, for the timings of its last line.
#[derive(Clone, Copy, Debug)]
struct Clock {
    started: Instant,
}

impl Clock {
    /// Makes `line` the last line: `done`, `done_reason`, counts and timings.
    fn finish(&self, line: &mut Value, finish: Finish, usage: &Usage) {
        if let (Some(l), Value::Object(done)) = (line.as_object_mut(), self.done(finish, usage)) {
            l.extend(done);
        }
    }

    /// `done_reason` and the timing fields of the last line. The prompt's evaluation runs from the
    /// request's arrival (validation and queueing included) to the first token; the answer's from there.
    fn done(&self, finish: Finish, usage: &Usage) -> Value {
        let now = Instant::now();
        let first = usage.first_token_at.unwrap_or(now);
        let ns = |d: std::time::Duration| d.as_nanos() as u64;
        // The deadline (osprey's `deadline_secs`) cuts an answer as the budget does.
        let reason = if matches!(finish, Finish::Length | Finish::Timeout) { "length" } else { "stop" };
        json!({"done": true, "done_reason": reason, "total_duration": ns(now - self.started), "load_duration": 0,
            "prompt_eval_count": usage.prompt, "prompt_eval_duration": ns(first - self.started),
            "eval_count": usage.completion, "eval_duration": ns(now - first)})
    }
}

/// One line (or the whole answer): the model, the time, the payload, `done`.
fn line(state: &AppState, api: Api, text: &str, thinking: &str, calls: &[Value]) -> Value {
    let created_at = handlers::rfc3339(handlers::now());
    let mut v = json!({"model": name(state), "created_at": created_at});
    match api {
        Api::Chat => {
            let mut m = json!({"role": "assistant", "content": text});
            if !thinking.is_empty() {
                m["thinking"] = thinking.into();
            }
            if !calls.is_empty() {
                m["tool_calls"] = calls.into();
            }
            v["message"] = m;
        }
        Api::Generate => {
            v["response"] = text.into();
            if !thinking.is_empty() {
                v["thinking"] = thinking.into();
            }
        }
    }
    v["done"] = false.into();
    v
}

fn ndjson(v: &Value) -> Bytes {
    Bytes::from(format!("{v}\n"))
}

/// The call being written: its name and the arguments' JSON so far.
#[derive(Debug, Default)]
struct Calls {
    open: Option<(String, String)>,
}

impl Calls {
    /// Follows the call events; a call that closed comes back in Ollama's shape (arguments as an object).
    fn feed(&mut self, o: &Out) -> Option<Value> {
        match o {
            Out::CallStart { name, .. } => self.open = Some((name.clone(), String::new())),
            Out::CallArgs { fragment, .. } => {
                if let Some((_, args)) = self.open.as_mut() {
                    args.push_str(fragment);
                }
            }
            Out::CallEnd => {
                let (name, args) = self.open.take()?;
                let args: Value = serde_json::from_str(&args).unwrap_or_else(|_| json!({}));
                return Some(json!({"function": {"name": name, "arguments": args}}));
            }
            _ => {}
        }
        None
    }
}

async fn stream_task(state: Arc<AppState>, api: Api, clock: Clock, a: Answer, tx: mpsc::Sender<Bytes>) {
    let mut calls = Calls::default();
    let phase = state.phase.clone();
    pump(a, &tx, phase, |next, frames| {
        let o = match next {
            Err(e) => {
                frames.push(ndjson(&body(&e)));
                return true;
            }
            Ok(o) => o,
        };
        let v = match &o {
            Out::Reasoning(r) => line(&state, api, "", r, &[]),
            Out::Text(t, _) if t.is_empty() => return false,
            Out::Text(t, _) => line(&state, api, t, "", &[]),
            Out::Done { finish, usage, .. } => {
                let mut v = line(&state, api, "", "", &[]);
                clock.finish(&mut v, *finish, usage);
                frames.push(ndjson(&v));
                return true;
            }
            _ => match calls.feed(&o) {
                Some(c) => line(&state, api, "", "", &[c]),
                None => return false,
            },
        };
        frames.push(ndjson(&v));
        false
    })
    .await;
}

/// The whole answer as one object.
async fn whole(state: &Arc<AppState>, api: Api, clock: Clock, mut a: Answer) -> Result<Value, ApiError> {
    let (mut text, mut thinking, mut done_calls, mut calls) =
        (String::new(), String::new(), Vec::new(), Calls::default());
    let (finish, usage, _) = a
        .drive(|o| match &o {
            Out::Reasoning(r) => thinking.push_str(r),
            Out::Text(t, _) => text.push_str(t),
            _ => done_calls.extend(calls.feed(&o)),
        })
        .await?;
    let text = if done_calls.is_empty() { text } else { text.trim().to_string() };
    let mut v = line(state, api, &text, thinking.trim(), &done_calls);
    clock.finish(&mut v, finish, &usage);
    Ok(v)
}

async fn run(
    state: Arc<AppState>,
    req: HttpRequest,
    payload: web::Payload,
    api: Api,
) -> Result<HttpResponse, ApiError> {
    let ctx = RequestCtx::new(&state);
    let raw = handlers::read_ollama_body(&state, &req, payload).await?;
    let asked = match api {
        Api::Chat => request::chat(&raw, &state.cfg.model_id)?,
        Api::Generate => request::generate(&raw, &state.cfg.model_id)?,
    };
    if asked.load_only {
        // Ollama's way to load a model: the model is loaded, answered at once.
        let mut v = line(&state, api, "", "", &[]);
        v["done"] = true.into();
        v["done_reason"] = "load".into();
        return Ok(HttpResponse::Ok().json(v));
    }
    let (prepared, gen) = if asked.raw {
        handlers::prepare_completion(&state, &asked.body, &ctx).await?
    } else {
        handlers::prepare_chat(&state, &asked.body, &ctx).await?
    };
    let a = handlers::start_answer(state.clone(), prepared, gen, &ctx, !asked.raw).await?;
    let clock = Clock { started: ctx.started };
    if asked.stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        actix_web::rt::spawn(stream_task(state.clone(), api, clock, a, tx));
        return Ok(handlers::streamed(rx, "application/x-ndjson"));
    }
    let v = tokio::select! {
        r = whole(&state, api, clock, a) => r?,
        () = expired(state.phase.clone()) => return Err(shutting_down()),
    };
    Ok(HttpResponse::Ok().json(v))
}

async fn counted(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
    api: Api,
) -> Result<HttpResponse, OllamaError> {
    let state = state.into_inner();
    state.metrics.request(crate::metrics::Api::Ollama);
    let r = run(state.clone(), req, payload, api).await;
    Ok(handlers::counted(&state, r)?)
}

/// `POST /api/chat`.
pub async fn chat(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, OllamaError> {
    counted(state, req, payload, Api::Chat).await
}

/// `POST /api/generate`.
pub async fn generate(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, OllamaError> {
    counted(state, req, payload, Api::Generate).await
}

/// The model's `details`, as `/api/tags`, `/api/show` and `/api/ps` give them.
fn details(state: &AppState) -> Value {
    let a = &state.cfg.about;
    json!({"parent_model": "", "format": "safetensors", "family": a.family, "families": [a.family],
        "parameter_size": parameter_size(a.parameters), "quantization_level": a.quantization})
}

/// A parameter count as Ollama writes it: `35.1B`, `120M`.
fn parameter_size(n: u64) -> String {
    match n {
        n if n >= 1_000_000_000 => format!("{:.1}B", n as f64 / 1e9),
        n if n >= 1_000_000 => format!("{}M", n / 1_000_000),
        n => format!("{}K", n.div_ceil(1000)),
    }
}

/// The model's entry in `/api/tags` (and, with more, in `/api/ps`).
fn entry(state: &AppState) -> Value {
    let a = &state.cfg.about;
    json!({"name": name(state), "model": name(state), "modified_at": handlers::rfc3339(a.modified),
        "size": a.bytes, "digest": a.digest, "details": details(state)})
}

/// `GET /api/tags`: the one served model.
pub async fn tags(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, OllamaError> {
    handlers::check_key(&state, &req)?;
    Ok(HttpResponse::Ok().json(json!({"models": [entry(&state)]})))
}

/// `GET /api/ps`: the served model, always loaded (it stays for the server's lifetime: `expires_at` is
/// far away), in host memory (`size_vram` 0: the CPU backend).
pub async fn ps(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, OllamaError> {
    handlers::check_key(&state, &req)?;
    let mut m = entry(&state);
    m["expires_at"] = "9999-12-31T23:59:59Z".into();
    m["size_vram"] = 0.into();
    m["context_length"] = state.cfg.context_len.into();
    Ok(HttpResponse::Ok().json(json!({"models": [m]})))
}

/// `POST /api/show`: details, template, capabilities and the context length of the served model.
pub async fn show(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, OllamaError> {
    handlers::check_key(&state, &req)?;
    // A name is all it reads: 64 KiB, read as every body is (a larger one is a JSON 413, not actix's
    // plain-text one).
    let lim = crate::body::BodyLimits {
        max_bytes: SHOW_MAX_BYTES,
        any_type_without_origin: true,
        ..state.body_limits(crate::body::Endpoint::Chat)
    };
    let v: Value = crate::body::read_json(&req, payload, lim).await?;
    let asked = v.get("model").or_else(|| v.get("name")).and_then(Value::as_str).unwrap_or_default();
    if !is_ours(asked, &state.cfg.model_id) {
        return Err(ApiError::new(
            osprey_protocol::ErrorCode::ModelNotFound,
            format!("model \"{}\" not found", crate::error::shown_id(asked)),
        )
        .into());
    }
    let a = &state.cfg.about;
    let mut caps = vec!["completion", "tools"];
    if state.cfg.template_kwargs.as_ref().is_some_and(|k| k.iter().any(|k| k == "enable_thinking")) {
        caps.push("thinking");
    }
    if state.cfg.vision {
        caps.push("vision");
    }
    let info = json!({"general.architecture": a.family, "general.parameter_count": a.parameters,
        format!("{}.context_length", a.family): state.cfg.context_len});
    Ok(HttpResponse::Ok().json(json!({"modelfile": format!("# served by osprey\nFROM {}\n", state.cfg.model_id),
        "parameters": "", "template": a.template, "details": details(&state), "model_info": info,
        "capabilities": caps, "modified_at": handlers::rfc3339(a.modified)})))
}

/// `GET /api/version`.
pub async fn version() -> HttpResponse {
    HttpResponse::Ok().json(json!({"version": API_VERSION}))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_sizes_read_as_ollama_writes_them() {
        assert_eq!(parameter_size(35_100_000_000), "35.1B");
        assert_eq!(parameter_size(120_400_000), "120M");
        assert_eq!(parameter_size(12_345), "13K");
    }

    #[test]
    fn errors_name_ollama_parameters() {
        let e = ApiError::new(osprey_protocol::ErrorCode::InvalidRequest, "too small").param("max_tokens");
        assert_eq!(body(&e), json!({"error": "options.num_predict: too small"}));
        let e =
            ApiError::new(osprey_protocol::ErrorCode::InvalidRequest, "max_tokens 3 is too small").param("max_tokens");
        assert_eq!(body(&e), json!({"error": "options.num_predict 3 is too small"}));
    }
}
