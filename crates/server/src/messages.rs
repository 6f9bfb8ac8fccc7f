//! `POST /v1/messages` and `POST /v1/messages/count_tokens` (Anthropic Messages API): blocks become chat
//! messages, the chat path renders and runs them (same template and engine as `/v1/chat/completions`),
//! and the answer comes back as thinking, text and `tool_use` blocks, whole or as Anthropic's event
//! stream. Errors use Anthropic's envelope `{"type": "error", "error": {"type", "message"}}`.

use std::sync::Arc;

use actix_web::http::StatusCode;
use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse, ResponseError};
use osprey_protocol::ErrorCode;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch};

use crate::answer::{Answer, Finish, Out};
use crate::error::{invalid, ApiError};
use crate::generate::{RequestCtx, Usage};
use crate::handlers::{self, expired, pump, shutting_down, sse_event, sse_response};
use crate::{AppState, Phase};

/// An error in Anthropic's envelope (same status codes as the OpenAI endpoints).
#[derive(Debug)]
pub struct AnthropicError(ApiError);

impl From<ApiError> for AnthropicError {
    fn from(e: ApiError) -> Self {
        AnthropicError(e)
    }
}

impl std::fmt::Display for AnthropicError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

/// Anthropic's error `type` for a status.
fn kind(status: u16) -> &'static str {
    match status {
        401 => "authentication_error",
        403 => "permission_error",
        404 => "not_found_error",
        413 => "request_too_large",
        429 => "rate_limit_error",
        503 => "overloaded_error",
        500..=599 => "api_error",
        _ => "invalid_request_error",
    }
}

/// A parameter as a Messages client wrote it: checks shared with chat completions name chat's parameters
/// (the body runs as a chat body), and a Messages client sent `output_config.format` and `input_schema`.
fn messages_param(p: &str) -> String {
    if let Some(rest) = p.strip_prefix("response_format") {
        return format!("output_config.format{}", rest.strip_prefix(".json_schema").unwrap_or(rest));
    }
    if let Some(i) = p.strip_prefix("tools[").and_then(|r| r.strip_suffix("].parameters")) {
        return format!("tools[{i}].input_schema");
    }
    p.to_string()
}

fn envelope(e: &ApiError) -> Value {
    let mut msg = e.message();
    if let Some(p) = &e.param_name() {
        msg = format!("{}: {msg}", messages_param(p));
    }
    json!({"type": "error", "error": {"type": kind(e.status_code().as_u16()), "message": msg}})
}

impl ResponseError for AnthropicError {
    fn status_code(&self) -> StatusCode {
        self.0.status_code()
    }

    fn error_response(&self) -> HttpResponse {
        crate::error::rewrapped(&self.0, &envelope(&self.0))
    }
}

/// An image block's source as a chat image part.
fn image(b: &Value, param: &str) -> Result<Value, ApiError> {
    let src = b.get("source").ok_or_else(|| invalid("image blocks need a `source`", param))?;
    let url = match src.get("type").and_then(Value::as_str) {
        Some("base64") => {
            let mt = src.get("media_type").and_then(Value::as_str).unwrap_or("image/png");
            let data =
                src.get("data").and_then(Value::as_str).ok_or_else(|| invalid("base64 sources need `data`", param))?;
            format!("data:{mt};base64,{data}")
        }
        Some("url") => {
            src.get("url").and_then(Value::as_str).ok_or_else(|| invalid("url sources need `url`", param))?.to_string()
        }
        other => {
            return Err(ApiError::new(
                ErrorCode::UnsupportedParameter,
                format!("image source type {} is not base64 or url", crate::error::shown(other)),
            )
            .param(param))
        }
    };
    Ok(json!({"type": "image_url", "image_url": {"url": url}}))
}

/// Text and image blocks as chat parts.
fn parts(c: &Value, param: &str) -> Result<Value, ApiError> {
    let blocks = match c {
        Value::String(s) => return Ok(Value::String(s.clone())),
        Value::Array(b) => b,
        _ => return Err(invalid("content must be a string or a list of blocks", param)),
    };
    let mut out = Vec::with_capacity(blocks.len());
    for (i, b) in blocks.iter().enumerate() {
        let p = format!("{param}[{i}]");
        match b.get("type").and_then(Value::as_str) {
            Some("text") => out.push(json!({"type": "text", "text": b.get("text").and_then(Value::as_str).ok_or_else(|| invalid("text blocks need `text`", &p))?})),
            Some("image") => out.push(image(b, &p)?),
            other => {
                return Err(ApiError::new(ErrorCode::UnsupportedParameter, format!("unsupported block type {} here", crate::error::shown(other)))
                    .param(&p))
            }
        }
    }
    Ok(Value::Array(out))
}

/// One Anthropic message as chat messages: a user turn's `tool_result` blocks become `tool` messages
/// (before the rest of the turn), an assistant turn's `tool_use` blocks its `tool_calls` and its
/// `thinking` its reasoning.
fn convert(m: &Value, param: &str, out: &mut Vec<Value>) -> Result<(), ApiError> {
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| invalid("messages need a role", param))?;
    if role != "user" && role != "assistant" {
        return Err(ApiError::new(ErrorCode::InvalidRole, format!("role `{role}` is not user or assistant"))
            .param(format!("{param}.role")));
    }
    let c = m.get("content").ok_or_else(|| invalid("messages need content", param))?;
    let Value::Array(blocks) = c else {
        out.push(json!({"role": role, "content": parts(c, &format!("{param}.content"))?}));
        return Ok(());
    };
    let (mut rest, mut calls, mut thinking) = (Vec::new(), Vec::new(), String::new());
    for (i, b) in blocks.iter().enumerate() {
        let p = format!("{param}.content[{i}]");
        match b.get("type").and_then(Value::as_str) {
            Some("tool_result") if role == "user" => {
                let id = b.get("tool_use_id").and_then(Value::as_str).unwrap_or_default();
                let content = match b.get("content") {
                    None | Some(Value::Null) => Value::String(String::new()),
                    Some(c) => parts(c, &format!("{p}.content"))?,
                };
                out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
            }
            Some("tool_use") if role == "assistant" => {
                let name =
                    b.get("name").and_then(Value::as_str).ok_or_else(|| invalid("tool_use blocks need a name", &p))?;
                let input = b.get("input").cloned().unwrap_or_else(|| json!({}));
                let id = b.get("id").and_then(Value::as_str).unwrap_or_default();
                calls.push(
                    json!({"id": id, "type": "function", "function": {"name": name, "arguments": input.to_string()}}),
                );
            }
            Some("thinking") if role == "assistant" => {
                thinking.push_str(b.get("thinking").and_then(Value::as_str).unwrap_or_default());
            }
            Some("redacted_thinking") => {}
            _ => rest.push(b.clone()),
        }
    }
    if !rest.is_empty() || !calls.is_empty() || !thinking.is_empty() {
        let mut msg = json!({"role": role, "content": parts(&Value::Array(rest), &format!("{param}.content"))?});
        if !calls.is_empty() {
            msg["tool_calls"] = Value::Array(calls);
        }
        if !thinking.is_empty() {
            msg["reasoning_content"] = thinking.into();
        }
        out.push(msg);
    }
    Ok(())
}

/// The text of a converted message's content (a string, or its text parts).
fn content_text(c: &Value) -> String {
    match c {
        Value::String(s) => s.clone(),
        Value::Array(parts) => parts.iter().filter_map(|p| p.get("text")?.as_str()).collect(),
        _ => String::new(),
    }
}

/// The Messages request as a chat completions body.
fn translate(body: &Value, count_only: bool) -> Result<(Value, bool), ApiError> {
    let o = body.as_object().ok_or_else(|| invalid("the body must be a JSON object", "body"))?;
    let mut messages = Vec::new();
    match o.get("system") {
        None | Some(Value::Null) => {}
        Some(s) => messages.push(json!({"role": "system", "content": parts(s, "system")?})),
    }
    let list =
        o.get("messages").and_then(Value::as_array).ok_or_else(|| invalid("`messages` is required", "messages"))?;
    for (i, m) in list.iter().enumerate() {
        convert(m, &format!("messages[{i}]"), &mut messages)?;
    }
    // A last assistant message is a prefill: the answer continues it (Anthropic's API returns only the
    // continuation), instead of closing it as a finished turn and starting another.
    let prefill = messages.last().is_some_and(|m| {
        m["role"] == "assistant" && m.get("tool_calls").is_none() && !content_text(&m["content"]).is_empty()
    });
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    if prefill {
        chat.insert("continue_final_message".into(), true.into());
    }
    for k in ["model", "temperature", "top_p", "top_k", "stream", "deadline_secs", "ignore_eos"] {
        if let Some(v) = o.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    match o.get("max_tokens") {
        Some(v) => {
            chat.insert("max_tokens".into(), v.clone());
        }
        None if !count_only => return Err(invalid("`max_tokens` is required", "max_tokens")),
        None => {}
    }
    if let Some(s) = o.get("stop_sequences") {
        chat.insert("stop".into(), s.clone());
    }
    tools(o, &mut chat)?;
    output_format(o, &mut chat)?;
    // Thinking only when asked for, as Anthropic's API does.
    let thinking = o.get("thinking").and_then(|t| t.get("type")).and_then(Value::as_str) == Some("enabled");
    chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": thinking}));
    let stream = o.get("stream").and_then(Value::as_bool).unwrap_or(false);
    Ok((Value::Object(chat), stream))
}

/// `tools` and `tool_choice` as chat's (client tools only: name, description, input_schema).
fn tools(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(Value::Array(tools)) = o.get("tools") {
        let mut conv = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            if t.get("type").and_then(Value::as_str).is_some_and(|k| k != "custom") {
                return Err(ApiError::new(
                    ErrorCode::UnsupportedParameter,
                    "only client tools (name, input_schema) are supported",
                )
                .param(format!("tools[{i}]")));
            }
            let mut f = Map::new();
            for (from, to) in [("name", "name"), ("description", "description"), ("input_schema", "parameters")] {
                if let Some(v) = t.get(from) {
                    f.insert(to.into(), v.clone());
                }
            }
            conv.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(conv));
    }
    if let Some(tc) = o.get("tool_choice") {
        let choice = match tc.get("type").and_then(Value::as_str) {
            Some("auto") => json!("auto"),
            Some("any") => json!("required"),
            Some("none") => json!("none"),
            Some("tool") => json!({"type": "function", "function": {"name": tc.get("name")}}),
            other => {
                return Err(invalid(
                    format!("tool_choice type {} is not auto, any, tool or none", crate::error::shown(other)),
                    "tool_choice",
                ))
            }
        };
        chat.insert("tool_choice".into(), choice);
        if tc.get("disable_parallel_tool_use").and_then(Value::as_bool) == Some(true) {
            chat.insert("parallel_tool_calls".into(), false.into());
        }
    }
    Ok(())
}

/// Structured outputs (`output_config.format`, the older `output_format`) as chat's `response_format`.
fn output_format(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    // Structured outputs: `output_config.format` (and the older top-level `output_format`) constrain the
    // answer with the same grammar engine as chat's `response_format`; Anthropic's are always strict. One
    // of the two: given both, which applies would be a guess.
    let config = o.get("output_config").filter(|v| !v.is_null());
    let legacy = o.get("output_format").filter(|v| !v.is_null());
    if config.is_some() && legacy.is_some() {
        return Err(invalid("give output_config.format or the older output_format, not both", "output_format"));
    }
    if config.is_some_and(|c| !c.is_object()) {
        return Err(invalid(
            "output_config must be an object: {\"format\": {\"type\": \"json_schema\", ...}}",
            "output_config",
        ));
    }
    let format = match (config.and_then(|c| c.get("format")).filter(|f| !f.is_null()), legacy) {
        (Some(f), _) => Some((f, "output_config.format")),
        (None, Some(f)) => Some((f, "output_format")),
        (None, None) => None,
    };
    if let Some((f, param)) = format {
        if !f.is_object() {
            return Err(invalid(
                "the output format must be an object: {\"type\": \"json_schema\", \"schema\": {...}}",
                param,
            ));
        }
        match f.get("type").and_then(Value::as_str) {
            Some("json_schema") => {
                let schema = f.get("schema").ok_or_else(|| invalid("a json_schema format needs `schema`", param))?;
                // The gate here, so that a refusal names the field the client used: the error envelope maps
                // chat's `response_format` to `output_config.format` only (`messages_param`).
                crate::schema::check_schema(schema, &format!("{param}.schema"))?;
                chat.insert(
                    "response_format".into(),
                    json!({"type": "json_schema", "json_schema": {"name": "output", "schema": schema, "strict": true}}),
                );
            }
            Some(other) => return Err(invalid(format!("output format type `{other}` is not json_schema"), param)),
            None => return Err(invalid("the output format needs a `type` (json_schema)", param)),
        }
    }
    Ok(())
}

/// A Messages body as the chat completions body it runs as (for checks without a server).
pub(crate) fn chat_body(body: &Value) -> Result<Value, ApiError> {
    translate(body, false).map(|(chat, _)| chat)
}

fn stop_reason(finish: Finish, stop: &Option<String>) -> &'static str {
    match finish {
        Finish::Stop if stop.is_some() => "stop_sequence",
        Finish::Stop => "end_turn",
        Finish::Length => "max_tokens",
        Finish::ToolCalls => "tool_use",
        // Ended by the request's deadline: the turn can be continued.
        Finish::Timeout => "pause_turn",
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt - u.cached, "cache_read_input_tokens": u.cached,
        "cache_creation_input_tokens": 0, "output_tokens": u.completion})
}

/// The block being written.
#[derive(Debug, PartialEq)]
enum Open {
    None,
    Thinking,
    Text,
    Tool,
}

/// Answer events as content blocks and the Messages event stream.
#[derive(Debug)]
struct Builder {
    blocks: Vec<Value>,
    open: Open,
    events: Vec<(&'static str, Value)>,
    args: String,
}

impl Builder {
    fn new() -> Self {
        Builder { blocks: Vec::new(), open: Open::None, events: Vec::new(), args: String::new() }
    }

    fn close(&mut self) {
        let index = self.blocks.len().saturating_sub(1);
        match self.open {
            Open::None => return,
            Open::Thinking => {
                self.events.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "signature_delta", "signature": ""}})));
            }
            Open::Tool => {
                let input: Value = serde_json::from_str(&self.args).unwrap_or_else(|_| json!({}));
                if let Some(b) = self.blocks.last_mut() {
                    b["input"] = input;
                }
                self.args.clear();
            }
            Open::Text => {}
        }
        self.events.push(("content_block_stop", json!({"type": "content_block_stop", "index": index})));
        self.open = Open::None;
    }

    fn start(&mut self, open: Open, block: Value) {
        self.close();
        self.events.push((
            "content_block_start",
            json!({"type": "content_block_start", "index": self.blocks.len(), "content_block": block.clone()}),
        ));
        self.blocks.push(block);
        self.open = open;
    }

    fn feed(&mut self, o: Out) {
        match o {
            Out::Reasoning(r) => {
                if self.open != Open::Thinking {
                    self.start(Open::Thinking, json!({"type": "thinking", "thinking": "", "signature": ""}));
                }
                let index = self.blocks.len() - 1;
                self.blocks[index]["thinking"] =
                    format!("{}{r}", self.blocks[index]["thinking"].as_str().unwrap_or_default()).into();
                self.events.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "thinking_delta", "thinking": r}})));
            }
            Out::Text(t, _) if t.is_empty() => {}
            Out::Text(t, _) => {
                if self.open != Open::Text {
                    self.start(Open::Text, json!({"type": "text", "text": ""}));
                }
                let index = self.blocks.len() - 1;
                self.blocks[index]["text"] =
                    format!("{}{t}", self.blocks[index]["text"].as_str().unwrap_or_default()).into();
                self.events.push((
                    "content_block_delta",
                    json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": t}}),
                ));
            }
            Out::CallStart { id, name, .. } => {
                self.start(Open::Tool, json!({"type": "tool_use", "id": id, "name": name, "input": {}}));
            }
            Out::CallArgs { fragment, .. } => {
                let index = self.blocks.len() - 1;
                self.args.push_str(&fragment);
                self.events.push(("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "input_json_delta", "partial_json": fragment}})));
            }
            Out::CallEnd => {
                if let Some(b) = self.blocks.last_mut() {
                    b["complete"] = true.into();
                }
                self.close();
            }
            Out::Done { .. } => self.close(),
        }
    }

    /// Blocks for the whole message: text trimmed where calls follow it, empty ones dropped.
    fn final_blocks(&self) -> Vec<Value> {
        let calls = self.blocks.iter().any(|b| b["type"] == "tool_use");
        self.blocks
            .iter()
            .filter_map(|b| {
                let mut b = b.clone();
                if b["type"] == "tool_use" {
                    // A call cut off by max_tokens is left out; its text comes as a text block.
                    b.as_object_mut()?.remove("complete")?;
                }
                if b["type"] == "text" && calls {
                    let t = b["text"].as_str().unwrap_or_default().trim().to_string();
                    if t.is_empty() {
                        return None;
                    }
                    b["text"] = t.into();
                }
                Some(b)
            })
            .collect()
    }
}

async fn stream_task(
    id: String,
    model: String,
    prompt_tokens: usize,
    a: Answer,
    tx: mpsc::Sender<Bytes>,
    phase: watch::Receiver<Phase>,
) {
    let start = json!({"type": "message_start", "message": {"id": id, "type": "message", "role": "assistant", "model": model,
        "content": [], "stop_reason": null, "stop_sequence": null,
        "usage": {"input_tokens": prompt_tokens, "cache_read_input_tokens": 0, "cache_creation_input_tokens": 0, "output_tokens": 0}}});
    if tx.send(sse_event("message_start", &start)).await.is_err()
        || tx.send(sse_event("ping", &json!({"type": "ping"}))).await.is_err()
    {
        return;
    }
    let mut b = Builder::new();
    pump(a, &tx, phase, |next, frames| {
        let mut done = false;
        match next {
            Err(e) => {
                b.events.push(("error", envelope(&e)));
                done = true;
            }
            Ok(o) => {
                let end = if let Out::Done { finish, usage, stop } = &o {
                    Some((*finish, *usage, stop.clone()))
                } else {
                    None
                };
                b.feed(o);
                if let Some((finish, usage, stop)) = end {
                    b.events.push(("message_delta", json!({"type": "message_delta",
                        "delta": {"stop_reason": stop_reason(finish, &stop), "stop_sequence": stop}, "usage": usage_json(&usage)})));
                    b.events.push(("message_stop", json!({"type": "message_stop"})));
                    done = true;
                }
            }
        }
        frames.extend(b.events.drain(..).map(|(kind, v)| sse_event(kind, &v)));
        done
    })
    .await;
}

async fn run(state: Arc<AppState>, req: HttpRequest, payload: web::Payload) -> Result<HttpResponse, ApiError> {
    let ctx = RequestCtx::new(&state);
    let body = handlers::read_body(&state, &req, payload, crate::body::Endpoint::Messages).await?;
    let (chat, stream) = translate(&body, false)?;
    let (prepared, gen) = handlers::prepare_chat(&state, &chat, &ctx).await?;
    let prompt_tokens = prepared.input_ids.len();
    let a = handlers::start_answer(state.clone(), prepared, gen, &ctx, true).await?;
    let id = format!("msg_{:024x}", ctx.id);
    let model = state.cfg.model_id.clone();
    if stream {
        let (tx, rx) = mpsc::channel::<Bytes>(64);
        actix_web::rt::spawn(stream_task(id, model, prompt_tokens, a, tx, state.phase.clone()));
        return Ok(sse_response(rx));
    }
    let whole = async {
        let mut b = Builder::new();
        let mut a = a;
        let (finish, usage, stop) = a.drive(|o| b.feed(o)).await?;
        Ok::<_, ApiError>(json!({"id": id, "type": "message", "role": "assistant", "model": model,
            "content": b.final_blocks(), "stop_reason": stop_reason(finish, &stop), "stop_sequence": stop,
            "usage": usage_json(&usage)}))
    };
    let v: Value = tokio::select! {
        r = whole => r?,
        () = expired(state.phase.clone()) => return Err(shutting_down()),
    };
    Ok(HttpResponse::Ok().json(v))
}

/// `POST /v1/messages`.
pub async fn create(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, AnthropicError> {
    let state = state.into_inner();
    state.metrics.request(crate::metrics::Api::Messages);
    let r = run(state.clone(), req, payload).await;
    Ok(handlers::counted(&state, r)?)
}

/// `POST /v1/messages/count_tokens`: the prompt's token count, media included, without generating.
pub async fn count_tokens(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, AnthropicError> {
    let state = state.into_inner();
    state.metrics.request(crate::metrics::Api::Messages);
    let ctx = RequestCtx::new(&state);
    let body = handlers::read_body(&state, &req, payload, crate::body::Endpoint::Messages).await?;
    let (chat, _) = translate(&body, true)?;
    // The same preparation as a generation (template, media placeholders), without the generation.
    let (prepared, _) = handlers::prepare_chat(&state, &chat, &ctx).await?;
    Ok(HttpResponse::Ok().json(json!({"input_tokens": prepared.input_ids.len()})))
}
