//! `POST /v1/responses` (OpenAI Responses API): input items become chat messages, the chat path renders
//! and runs them (same template, same engine as `/v1/chat/completions`), and the answer comes back as
//! output items — reasoning, message, function calls — whole or as the documented event stream.
//! `previous_response_id` continues a stored conversation (`store.rs`).

use std::sync::Arc;

use actix_web::web::{self, Bytes};
use actix_web::{HttpRequest, HttpResponse};
use osprey_protocol::ErrorCode;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, watch};

use crate::answer::{Answer, Finish, Out};
use crate::error::{invalid, shown_id, ApiError};
use crate::generate::{RequestCtx, Usage};
use crate::handlers::{self, check_key, expired, pump, shutting_down, sse_event, sse_response};
use crate::store::{ResponseStore, Stored};
use crate::{AppState, Phase};

/// A content part of an input message as a chat part.
fn part(p: &Value, param: &str) -> Result<Value, ApiError> {
    match p.get("type").and_then(Value::as_str) {
        Some("input_text" | "output_text" | "text") => {
            let t = p.get("text").and_then(Value::as_str).ok_or_else(|| invalid("text parts need `text`", param))?;
            Ok(json!({"type": "text", "text": t}))
        }
        Some("input_image") => {
            let url = p.get("image_url").and_then(|u| u.as_str().or_else(|| u.get("url")?.as_str()));
            match url {
                Some(u) => Ok(json!({"type": "image_url", "image_url": {"url": u}})),
                None => Err(ApiError::new(
                    ErrorCode::UnsupportedParameter,
                    "input images need `image_url` (a data URL or an allow-listed URL); file ids are not supported",
                )
                .param(param)),
            }
        }
        other => Err(ApiError::new(
            ErrorCode::UnsupportedParameter,
            format!("unsupported content part type {}", crate::error::shown(other)),
        )
        .param(param)),
    }
}

fn content(c: &Value, param: &str) -> Result<Value, ApiError> {
    match c {
        Value::String(s) => Ok(Value::String(s.clone())),
        Value::Array(parts) => Ok(Value::Array(
            parts.iter().enumerate().map(|(i, p)| part(p, &format!("{param}[{i}]"))).collect::<Result<_, _>>()?,
        )),
        _ => Err(invalid("content must be a string or a list of parts", param)),
    }
}

/// Input items as chat messages (consecutive function calls join one assistant message).
fn input_messages(input: &Value) -> Result<Vec<Value>, ApiError> {
    let items = match input {
        Value::String(s) => return Ok(vec![json!({"role": "user", "content": s})]),
        Value::Array(a) => a,
        _ => return Err(invalid("input must be a string or a list of items", "input")),
    };
    let mut out: Vec<Value> = Vec::new();
    for (i, it) in items.iter().enumerate() {
        let p = format!("input[{i}]");
        let kind = it.get("type").and_then(Value::as_str).unwrap_or("message");
        match kind {
            "message" => {
                let role = it.get("role").and_then(Value::as_str).ok_or_else(|| invalid("messages need a role", &p))?;
                let c = it.get("content").ok_or_else(|| invalid("messages need content", &p))?;
                out.push(json!({"role": role, "content": content(c, &format!("{p}.content"))?}));
            }
            "function_call" => {
                let name =
                    it.get("name").and_then(Value::as_str).ok_or_else(|| invalid("function calls need a name", &p))?;
                let call_id = it.get("call_id").and_then(Value::as_str).unwrap_or_default();
                let args = it.get("arguments").and_then(Value::as_str).unwrap_or("{}");
                let call = json!({"id": call_id, "type": "function", "function": {"name": name, "arguments": args}});
                match out.last_mut() {
                    Some(last) if last["role"] == "assistant" && last.get("tool_calls").is_some() => {
                        if let Some(a) = last["tool_calls"].as_array_mut() {
                            a.push(call);
                        }
                    }
                    _ => out.push(json!({"role": "assistant", "content": null, "tool_calls": [call]})),
                }
            }
            "function_call_output" => {
                let call_id = it.get("call_id").and_then(Value::as_str).unwrap_or_default();
                let o = it.get("output").ok_or_else(|| invalid("function call outputs need `output`", &p))?;
                out.push(
                    json!({"role": "tool", "tool_call_id": call_id, "content": content(o, &format!("{p}.output"))?}),
                );
            }
            // Reasoning of earlier turns is not rendered again (the template drops it before the last
            // user turn anyway).
            "reasoning" => {}
            other => {
                return Err(ApiError::new(
                    ErrorCode::UnsupportedParameter,
                    format!("unsupported input item type `{other}`"),
                )
                .param(&p))
            }
        }
    }
    Ok(out)
}

/// The Responses request as a chat completions body, with what the response echoes.
struct Translated {
    chat: Value,
    /// The conversation without instructions (what is stored).
    conversation: Vec<Value>,
    stream: bool,
    store: bool,
    echo: Map<String, Value>,
}

fn translate(body: &Value, store: &ResponseStore) -> Result<Translated, ApiError> {
    let o = body.as_object().ok_or_else(|| invalid("the body must be a JSON object", "body"))?;
    for k in ["background", "conversation", "prompt"] {
        if o.get(k).is_some_and(|v| !v.is_null() && v != &Value::Bool(false)) {
            return Err(ApiError::new(ErrorCode::UnsupportedParameter, format!("`{k}` is not supported")).param(k));
        }
    }
    let mut conversation = previous(o, store)?;
    check_metadata(o.get("metadata"))?;
    let store_it = match o.get("store") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("store must be true or false", "store")),
    };
    let input = o.get("input").ok_or_else(|| invalid("`input` is required", "input"))?;
    conversation.extend(input_messages(input)?);
    let mut messages = Vec::with_capacity(conversation.len() + 1);
    if let Some(ins) = o.get("instructions").and_then(Value::as_str) {
        messages.push(json!({"role": "system", "content": ins}));
    }
    messages.extend(conversation.iter().cloned());
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for k in [
        "model",
        "temperature",
        "top_p",
        "stream",
        "parallel_tool_calls",
        "seed",
        "top_k",
        "stop",
        "deadline_secs",
        "ignore_eos",
    ] {
        if let Some(v) = o.get(k) {
            chat.insert(k.into(), v.clone());
        }
    }
    if let Some(v) = o.get("max_output_tokens") {
        chat.insert("max_tokens".into(), v.clone());
    }
    tools(o, &mut chat)?;
    if let Some(fmt) = o.get("text").and_then(|t| t.get("format")) {
        // The gate here, so that a refusal names the Responses parameter, not chat's.
        if let Some(schema) = fmt.get("schema") {
            crate::schema::check_schema(schema, "text.format.schema")?;
        }
        chat.insert("response_format".into(), fmt.clone());
    }
    // Reasoning is on unless the request turns it down.
    let effort = o.get("reasoning").and_then(|r| r.get("effort")).and_then(Value::as_str);
    if matches!(effort, Some("none" | "minimal")) {
        chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": false}));
    }
    let mut echo = Map::new();
    for k in [
        "instructions",
        "previous_response_id",
        "temperature",
        "top_p",
        "max_output_tokens",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "metadata",
        "reasoning",
    ] {
        echo.insert(k.into(), o.get(k).cloned().unwrap_or(Value::Null));
    }
    Ok(Translated {
        chat: Value::Object(chat),
        conversation,
        stream: o.get("stream").and_then(Value::as_bool).unwrap_or(false),
        store: store_it,
        echo,
    })
}

/// The conversation a `previous_response_id` continues (empty without one).
fn previous(o: &Map<String, Value>, store: &ResponseStore) -> Result<Vec<Value>, ApiError> {
    let conversation = match o.get("previous_response_id") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(id)) => {
            store
                .get(id)
                .ok_or_else(|| {
                    ApiError::new(
                        ErrorCode::ResponseNotFound,
                        format!("no stored response `{}` (it expired, or was created with store: false)", shown_id(id)),
                    )
                    .param("previous_response_id")
                })?
                .messages
        }
        Some(_) => return Err(invalid("previous_response_id must be a string", "previous_response_id")),
    };
    Ok(conversation)
}

/// Function tools and `tool_choice` as chat's.
fn tools(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    if let Some(Value::Array(tools)) = o.get("tools") {
        let mut conv = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(ApiError::new(ErrorCode::UnsupportedParameter, "only function tools are supported")
                    .param(format!("tools[{i}]")));
            }
            let mut f = Map::new();
            for k in ["name", "description", "parameters"] {
                if let Some(v) = t.get(k) {
                    f.insert(k.into(), v.clone());
                }
            }
            conv.push(json!({"type": "function", "function": f}));
        }
        chat.insert("tools".into(), Value::Array(conv));
    }
    if let Some(tc) = o.get("tool_choice") {
        let tc = match tc.get("name") {
            Some(n) => json!({"type": "function", "function": {"name": n}}),
            None => tc.clone(),
        };
        chat.insert("tool_choice".into(), tc);
    }
    Ok(())
}

/// `metadata` as OpenAI takes it: at most 16 pairs, keys up to 64 characters, values strings up to 512
/// (it is stored with the response and echoed, so its size is bounded before anything is kept).
fn check_metadata(m: Option<&Value>) -> Result<(), ApiError> {
    let m = match m {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Object(m)) => m,
        Some(_) => return Err(invalid("metadata must be an object of string values", "metadata")),
    };
    if m.len() > 16 {
        return Err(invalid(format!("metadata has {} keys, at most 16 are allowed", m.len()), "metadata"));
    }
    for (k, v) in m {
        let ok = k.chars().count() <= 64 && v.as_str().is_some_and(|s| s.chars().count() <= 512);
        if !ok {
            return Err(invalid(
                "metadata keys are at most 64 characters and values strings of at most 512",
                &format!("metadata.{}", shown_id(k)),
            ));
        }
    }
    Ok(())
}

/// A Responses body as the chat completions body it runs as (for checks without a server).
pub(crate) fn chat_body(body: &Value, store: &ResponseStore) -> Result<Value, ApiError> {
    translate(body, store).map(|t| t.chat)
}

/// The output item being written.
#[derive(Debug)]
enum Open {
    None,
    Reasoning(String),
    Message(String),
    Call { call_id: String, name: String, args: String, complete: bool },
}

/// Turns answer events into output items and (when streaming) the Responses event sequence.
#[derive(Debug)]
struct Builder {
    id: String,
    seq: u64,
    items: Vec<Value>,
    open: Open,
    events: Vec<(String, Value)>,
}

impl Builder {
    fn new(id: String) -> Self {
        Builder { id, seq: 0, items: Vec::new(), open: Open::None, events: Vec::new() }
    }

    fn emit(&mut self, kind: &str, mut v: Value) {
        v["type"] = kind.into();
        v["sequence_number"] = self.seq.into();
        self.seq += 1;
        self.events.push((kind.to_string(), v));
    }

    fn item_id(&self, prefix: &str) -> String {
        format!("{prefix}_{}_{}", self.id.trim_start_matches("resp_"), self.items.len())
    }

    fn close(&mut self) {
        let index = self.items.len();
        let open = std::mem::replace(&mut self.open, Open::None);
        let item = match open {
            Open::None => return,
            Open::Reasoning(text) => {
                let id = self.item_id("rs");
                self.emit(
                    "response.reasoning_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                json!({"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}]})
            }
            Open::Message(text) => {
                let id = self.item_id("msg");
                let part = json!({"type": "output_text", "text": text, "annotations": []});
                self.emit(
                    "response.output_text.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "text": text}),
                );
                self.emit(
                    "response.content_part.done",
                    json!({"item_id": id, "output_index": index, "content_index": 0, "part": part}),
                );
                json!({"type": "message", "id": id, "status": "completed", "role": "assistant", "content": [part]})
            }
            Open::Call { call_id, name, args, complete } => {
                let id = self.item_id("fc");
                self.emit(
                    "response.function_call_arguments.done",
                    json!({"item_id": id, "output_index": index, "arguments": args}),
                );
                // A call cut off by the token limit stays in the output as incomplete (its text follows as
                // a message); it is not part of the stored conversation.
                let status = if complete { "completed" } else { "incomplete" };
                json!({"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": args, "status": status})
            }
        };
        self.emit("response.output_item.done", json!({"output_index": index, "item": item}));
        self.items.push(item);
    }

    fn feed(&mut self, o: Out) {
        let index = self.items.len();
        match o {
            Out::Reasoning(r) => {
                if !matches!(self.open, Open::Reasoning(_)) {
                    self.close();
                    let id = self.item_id("rs");
                    self.emit("response.output_item.added", json!({"output_index": self.items.len(), "item": {"type": "reasoning", "id": id, "summary": [], "content": []}}));
                    self.open = Open::Reasoning(String::new());
                }
                let id = self.item_id("rs");
                self.emit(
                    "response.reasoning_text.delta",
                    json!({"item_id": id, "output_index": self.items.len(), "content_index": 0, "delta": r}),
                );
                if let Open::Reasoning(t) = &mut self.open {
                    t.push_str(&r);
                }
            }
            Out::Text(t, _) if t.is_empty() => {}
            Out::Text(t, _) => {
                if !matches!(self.open, Open::Message(_)) {
                    self.close();
                    let index = self.items.len();
                    let id = self.item_id("msg");
                    self.emit("response.output_item.added", json!({"output_index": index, "item": {"type": "message", "id": id, "status": "in_progress", "role": "assistant", "content": []}}));
                    self.emit("response.content_part.added", json!({"item_id": id, "output_index": index, "content_index": 0, "part": {"type": "output_text", "text": "", "annotations": []}}));
                    self.open = Open::Message(String::new());
                }
                let id = self.item_id("msg");
                self.emit(
                    "response.output_text.delta",
                    json!({"item_id": id, "output_index": self.items.len(), "content_index": 0, "delta": t}),
                );
                if let Open::Message(m) = &mut self.open {
                    m.push_str(&t);
                }
            }
            Out::CallStart { id: call_id, name, .. } => {
                self.close();
                let id = self.item_id("fc");
                self.emit("response.output_item.added", json!({"output_index": self.items.len(), "item": {"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": "", "status": "in_progress"}}));
                self.open = Open::Call { call_id, name, args: String::new(), complete: false };
            }
            Out::CallArgs { fragment, .. } => {
                let id = self.item_id("fc");
                self.emit(
                    "response.function_call_arguments.delta",
                    json!({"item_id": id, "output_index": index, "delta": fragment}),
                );
                if let Open::Call { args, .. } = &mut self.open {
                    args.push_str(&fragment);
                }
            }
            Out::CallEnd => {
                if let Open::Call { complete, .. } = &mut self.open {
                    *complete = true;
                }
                self.close();
            }
            Out::Done { .. } => self.close(),
        }
    }

    /// The assistant turn as a chat message.
    /// The assistant turn as a chat message (what is stored), read from the closed output items.
    fn message(&self) -> Value {
        let text_of = |kind: &str| -> String {
            let items = self.items.iter().filter(|i| i["type"] == kind);
            let parts = items.flat_map(|i| i["content"].as_array().cloned().unwrap_or_default());
            parts.filter_map(|c| c["text"].as_str().map(str::to_string)).collect()
        };
        let (reasoning, text) = (text_of("reasoning"), text_of("message"));
        let calls: Vec<Value> = self
            .items
            .iter()
            .filter(|i| i["type"] == "function_call" && i["status"] == "completed")
            .map(|i| json!({"id": i["call_id"], "type": "function", "function": {"name": i["name"], "arguments": i["arguments"]}}))
            .collect();
        let mut m = json!({"role": "assistant", "content": text.trim()});
        if !reasoning.is_empty() {
            m["reasoning_content"] = reasoning.trim().into();
        }
        if !calls.is_empty() {
            m["tool_calls"] = Value::Array(calls);
        }
        m
    }
}

fn usage_json(u: &Usage) -> Value {
    json!({"input_tokens": u.prompt, "input_tokens_details": {"cached_tokens": u.cached},
        "output_tokens": u.completion, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": u.prompt + u.completion})
}

/// The response object.
fn response(
    id: &str,
    created: u64,
    model: &str,
    t: &Translated,
    output: &[Value],
    end: Option<(Finish, Usage)>,
) -> Value {
    let (status, incomplete, usage) = match end {
        None => ("in_progress", Value::Null, Value::Null),
        Some((Finish::Length, u)) => ("incomplete", json!({"reason": "max_output_tokens"}), usage_json(&u)),
        Some((Finish::Timeout, u)) => ("incomplete", json!({"reason": "timeout"}), usage_json(&u)),
        Some((_, u)) => ("completed", Value::Null, usage_json(&u)),
    };
    let mut r = json!({"id": id, "object": "response", "created_at": created, "status": status, "model": model,
        "output": output, "incomplete_details": incomplete, "usage": usage, "error": null, "store": t.store});
    for (k, v) in &t.echo {
        r[k] = v.clone();
    }
    if r["metadata"].is_null() {
        r["metadata"] = json!({});
    }
    r
}

struct Run {
    state: Arc<AppState>,
    id: String,
    created: u64,
    t: Translated,
}

impl Run {
    fn finish(&self, b: &Builder, end: (Finish, Usage)) -> Value {
        let mut r = response(&self.id, self.created, &self.state.cfg.model_id, &self.t, &b.items, Some(end));
        if self.t.store {
            let mut messages = self.t.conversation.clone();
            messages.push(b.message());
            let stored = Stored::new(messages, r.clone());
            if self.state.responses.fits(&stored) {
                self.state.responses.put(self.id.clone(), stored);
            } else {
                // Too large for the store's byte bound: not kept, and the response says so.
                r["store"] = false.into();
            }
        }
        r
    }
}

async fn stream_task(run: Run, a: Answer, tx: mpsc::Sender<Bytes>, phase: watch::Receiver<Phase>) {
    let mut b = Builder::new(run.id.clone());
    let start = response(&run.id, run.created, &run.state.cfg.model_id, &run.t, &[], None);
    b.emit("response.created", json!({"response": start}));
    b.emit("response.in_progress", json!({"response": start}));
    for (kind, v) in std::mem::take(&mut b.events) {
        if tx.send(sse_event(&kind, &v)).await.is_err() {
            return;
        }
    }
    pump(a, &tx, phase, |next, frames| {
        let done = match next {
            Err(e) => {
                let err = e.body()["error"].clone();
                b.emit("error", json!({"code": err["code"], "message": err["message"], "param": err["param"]}));
                true
            }
            Ok(o) => {
                let end = if let Out::Done { finish, usage, .. } = &o { Some((*finish, *usage)) } else { None };
                b.feed(o);
                if let Some(end) = end {
                    let r = run.finish(&b, end);
                    let kind = if r["status"] == "completed" { "response.completed" } else { "response.incomplete" };
                    b.emit(kind, json!({"response": r}));
                }
                end.is_some()
            }
        };
        frames.extend(b.events.drain(..).map(|(kind, v)| sse_event(&kind, &v)));
        done
    })
    .await;
}

/// `POST /v1/responses`.
pub async fn create(
    state: web::Data<AppState>,
    req: HttpRequest,
    payload: web::Payload,
) -> Result<HttpResponse, ApiError> {
    let state = state.into_inner();
    state.metrics.request(crate::metrics::Api::Responses);
    let ctx = RequestCtx::new(&state);
    let r = async {
        let body = handlers::read_body(&state, &req, payload, crate::body::Endpoint::Responses).await?;
        let t = translate(&body, &state.responses)?;
        let (prepared, gen) = handlers::prepare_chat(&state, &t.chat, &ctx).await?;
        let a = handlers::start_answer(state.clone(), prepared, gen, &ctx, true).await?;
        let nanos =
            std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_nanos()).unwrap_or(0);
        let id = format!("resp_{:x}{:04x}", nanos & 0xffff_ffff_ffff, ctx.id);
        let run = Run { state: state.clone(), id, created: handlers::now(), t };
        if run.t.stream {
            let (tx, rx) = mpsc::channel::<Bytes>(64);
            actix_web::rt::spawn(stream_task(run, a, tx, state.phase.clone()));
            return Ok(sse_response(rx));
        }
        let collected = async {
            let mut b = Builder::new(run.id.clone());
            let mut a = a;
            let (finish, usage, _) = a.drive(|o| b.feed(o)).await?;
            Ok::<_, ApiError>(run.finish(&b, (finish, usage)))
        };
        let r: Value = tokio::select! {
            r = collected => r?,
            () = expired(state.phase.clone()) => return Err(shutting_down()),
        };
        Ok(HttpResponse::Ok().json(r))
    }
    .await;
    handlers::counted(&state, r)
}

/// `GET /v1/responses/{id}`.
pub async fn get(
    state: web::Data<AppState>,
    req: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    check_key(&state, &req)?;
    match state.responses.get(&id) {
        Some(s) => Ok(HttpResponse::Ok().json(s.response)),
        None => Err(ApiError::new(ErrorCode::ResponseNotFound, format!("no stored response `{}`", shown_id(&id)))
            .param("response_id")),
    }
}

/// `DELETE /v1/responses/{id}`.
pub async fn delete(
    state: web::Data<AppState>,
    req: HttpRequest,
    id: web::Path<String>,
) -> Result<HttpResponse, ApiError> {
    check_key(&state, &req)?;
    if state.responses.remove(&id) {
        Ok(HttpResponse::Ok().json(json!({"id": id.as_str(), "object": "response", "deleted": true})))
    } else {
        Err(ApiError::new(ErrorCode::ResponseNotFound, format!("no stored response `{}`", shown_id(&id)))
            .param("response_id"))
    }
}
