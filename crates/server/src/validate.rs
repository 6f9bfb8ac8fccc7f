//! Parse, don't validate: OpenAI wire bodies become validated requests before anything enters the
//! engine. Lenient where OpenAI clients are (`max_completion_tokens` is `max_tokens`, `developer` is a
//! system role); strict about everything that would change the answer silently.

use std::io::Read;
use std::time::Duration;

use base64::Engine;
use osprey_protocol::constraint::Grammar;
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::{ChatPrompt, CompletionPrompt, MediaInput, MediaLimits};
use osprey_protocol::ErrorCode;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::config::{Limits, ServerConfig};
use crate::error::ApiError;
use crate::grammar::{call_grammar, json_layout};
use crate::tools::{self, ToolChoice, ToolSpec};

/// `stop`: one string or several.
#[derive(Clone, Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    /// One.
    One(String),
    /// Several.
    Many(Vec<String>),
}

/// `stream_options`.
#[derive(Clone, Debug, Default, Deserialize)]
pub struct StreamOptions {
    /// Send a final chunk with `usage`.
    #[serde(default)]
    pub include_usage: bool,
}

/// Fields shared by chat and completion requests.
#[derive(Clone, Debug, Deserialize)]
pub struct Common {
    /// Model id (must be ours when given).
    pub model: Option<String>,
    /// Stream with SSE.
    #[serde(default)]
    pub stream: bool,
    /// Stream options.
    pub stream_options: Option<StreamOptions>,
    /// Token limit.
    pub max_tokens: Option<i64>,
    /// Alias of `max_tokens` (newer OpenAI clients).
    pub max_completion_tokens: Option<i64>,
    /// Sampling temperature (default 1).
    pub temperature: Option<f32>,
    /// Nucleus mass.
    pub top_p: Option<f32>,
    /// Top-k (vLLM extension; 0 or −1 off).
    pub top_k: Option<i64>,
    /// Min-p (vLLM extension).
    pub min_p: Option<f32>,
    /// Seed.
    pub seed: Option<u64>,
    /// Repetition penalty (vLLM extension).
    pub repetition_penalty: Option<f32>,
    /// Presence penalty.
    pub presence_penalty: Option<f32>,
    /// Frequency penalty.
    pub frequency_penalty: Option<f32>,
    /// Stop strings.
    pub stop: Option<Stop>,
    /// Number of choices (only 1).
    pub n: Option<i64>,
    /// Ignore EOS (vLLM extension; benchmarks).
    #[serde(default)]
    pub ignore_eos: bool,
    /// Seconds from arrival after which the generation is ended (osprey extension; the server's
    /// `--request-deadline-secs` caps it).
    pub deadline_secs: Option<f64>,
}

/// `POST /v1/chat/completions` body.
#[derive(Clone, Debug, Deserialize)]
pub struct ChatRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// Messages.
    pub messages: Vec<Value>,
    /// Return logprobs.
    #[serde(default)]
    pub logprobs: bool,
    /// Alternatives per token (0..=20).
    pub top_logprobs: Option<i64>,
    /// Structured output: `text`, `json_object` or `json_schema`.
    pub response_format: Option<Value>,
    /// Function tools.
    pub tools: Option<Value>,
    /// `none`, `auto`, `required` or a named function.
    pub tool_choice: Option<Value>,
    /// More than one call per answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Extra template arguments (e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
}

/// `POST /v1/completions` body.
#[derive(Clone, Debug, Deserialize)]
pub struct CompletionRequest {
    /// Shared fields.
    #[serde(flatten)]
    pub common: Common,
    /// A string or an array of token ids.
    pub prompt: Value,
    /// Alternatives per token (legacy `logprobs: n`).
    pub logprobs: Option<i64>,
    /// Echo the prompt (not supported).
    #[serde(default)]
    pub echo: bool,
}

/// Generation settings after validation.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// Sampling.
    pub sampling: SamplingParams,
    /// Requested token limit (None: the rest of the context).
    pub max_tokens: Option<usize>,
    /// Stop strings.
    pub stop: Vec<String>,
    /// SSE.
    pub stream: bool,
    /// Final usage chunk.
    pub include_usage: bool,
    /// Keep generating past EOS.
    pub ignore_eos: bool,
    /// Time from the request's arrival after which its generation is ended (the request's own
    /// `deadline_secs` or the server's, whichever is shorter).
    pub deadline: Option<std::time::Duration>,
    /// Tools whose calls are parsed out of the answer (chat requests with tools and a choice other than
    /// `none`).
    pub tools: Option<ToolSetup>,
}

/// The tools of a request, for the answer's parser.
#[derive(Clone, Debug)]
pub struct ToolSetup {
    /// The tools.
    pub specs: Vec<ToolSpec>,
    /// More than one call allowed.
    pub parallel: bool,
}

fn bad(code: ErrorCode, msg: impl Into<String>, param: &str) -> ApiError {
    ApiError::new(code, msg).param(param)
}

fn range(v: Option<f32>, lo: f32, hi: f32, default: f32, name: &str) -> Result<f32, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && (lo..=hi).contains(&x) => Ok(x),
        Some(x) => Err(bad(ErrorCode::InvalidRequest, format!("{name} must be in [{lo}, {hi}], got {x}"), name)),
    }
}

fn common(c: &Common, cfg: &ServerConfig, logprobs: Option<usize>) -> Result<GenParams, ApiError> {
    if let Some(m) = &c.model {
        if m != &cfg.model_id {
            return Err(ApiError::new(
                ErrorCode::ModelNotFound,
                format!("the model `{m}` does not exist; this server serves `{}`", cfg.model_id),
            )
            .param("model"));
        }
    }
    if c.n.unwrap_or(1) != 1 {
        return Err(bad(ErrorCode::UnsupportedParameter, "only n = 1 is supported", "n"));
    }
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        None => None,
        Some(n) if n >= 1 => Some(n as usize),
        Some(n) => {
            return Err(bad(ErrorCode::InvalidRequest, format!("max_tokens must be at least 1, got {n}"), "max_tokens"))
        }
    };
    if let Some(n) = max_tokens {
        if n >= cfg.context_len {
            return Err(bad(
                ErrorCode::ContextLengthExceeded,
                format!("max_tokens {n} is beyond this model's context length of {} tokens", cfg.context_len),
                "max_tokens",
            ));
        }
    }
    let top_k = match c.top_k {
        None | Some(-1) | Some(0) => 0,
        Some(k) if k > 0 => k as usize,
        Some(k) => {
            return Err(bad(ErrorCode::InvalidRequest, format!("top_k must be -1, 0 or positive, got {k}"), "top_k"))
        }
    };
    let top_p = range(c.top_p, 0.0, 1.0, 1.0, "top_p")?;
    if top_p == 0.0 {
        return Err(bad(ErrorCode::InvalidRequest, "top_p must be greater than 0", "top_p"));
    }
    let sampling = SamplingParams {
        temperature: range(c.temperature, 0.0, 2.0, 1.0, "temperature")?,
        top_p,
        top_k,
        min_p: range(c.min_p, 0.0, 1.0, 0.0, "min_p")?,
        seed: c.seed,
        repetition_penalty: range(c.repetition_penalty, 0.01, 10.0, 1.0, "repetition_penalty")?,
        presence_penalty: range(c.presence_penalty, -2.0, 2.0, 0.0, "presence_penalty")?,
        frequency_penalty: range(c.frequency_penalty, -2.0, 2.0, 0.0, "frequency_penalty")?,
        logprobs,
        constraint: None,
    };
    let stop = match &c.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(bad(ErrorCode::InvalidRequest, "stop takes up to 4 non-empty strings", "stop"));
    }
    let deadline = match c.deadline_secs {
        Some(d) if !(d.is_finite() && d > 0.0) => {
            return Err(bad(
                ErrorCode::InvalidRequest,
                format!("deadline_secs must be positive, got {d}"),
                "deadline_secs",
            ))
        }
        own => match (own, cfg.request_deadline_secs) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        },
    }
    .map(|s| std::time::Duration::from_secs_f64(s.min(1e9)));
    Ok(GenParams {
        sampling,
        max_tokens,
        stop,
        stream: c.stream,
        include_usage: c.stream_options.as_ref().is_some_and(|o| o.include_usage),
        ignore_eos: c.ignore_eos,
        deadline,
        tools: None,
    })
}

/// Largest `response_format` schema, in bytes of JSON (real schemas are a few KB; llguidance's own
/// limits bound the compile further).
const MAX_SCHEMA_BYTES: usize = 256 << 10;

/// `response_format` as a grammar (`None` for plain text).
fn response_format(rf: Option<&Value>) -> Result<Option<Grammar>, ApiError> {
    let Some(rf) = rf.filter(|v| !v.is_null()) else { return Ok(None) };
    let p = "response_format";
    match rf.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(Grammar::JsonSchema(json_layout(&json!({"type": "object"}), false)))),
        Some("json_schema") => {
            // Chat nests the fields in `json_schema`; the Responses API's `text.format` has them at the top.
            let js = rf.get("json_schema").filter(|v| v.is_object()).unwrap_or(rf);
            let schema = js.get("schema").cloned().ok_or_else(|| {
                bad(ErrorCode::InvalidRequest, "json_schema needs `json_schema`: {\"name\", \"schema\"}", p)
            })?;
            if !(schema.is_object() || schema.is_boolean()) {
                return Err(bad(
                    ErrorCode::InvalidSchema,
                    "the schema must be a JSON Schema object",
                    &format!("{p}.json_schema.schema"),
                ));
            }
            // Compiling is paid before admission, on a tokenizer worker: bound what one request can ask.
            let n = schema.to_string().len();
            if n > MAX_SCHEMA_BYTES {
                return Err(bad(
                    ErrorCode::InvalidSchema,
                    format!("the schema is {n} bytes of JSON, more than the limit of {MAX_SCHEMA_BYTES}"),
                    &format!("{p}.json_schema.schema"),
                ));
            }
            let strict = js.get("strict").and_then(Value::as_bool).unwrap_or(false);
            Ok(Some(Grammar::JsonSchema(json_layout(&schema, strict))))
        }
        other => Err(bad(
            ErrorCode::InvalidRequest,
            format!("response_format type {other:?} is not text, json_object or json_schema"),
            p,
        )),
    }
}

/// Fetches or decodes a media URL under the limits (blocking: called off the async threads).
pub fn resolve_url(url: &str, limits: &Limits, param: &str) -> Result<Vec<u8>, ApiError> {
    let too_big = |n: usize| {
        bad(
            ErrorCode::MediaTooLarge,
            format!("media item is {n} bytes, more than the limit of {}", limits.max_media_bytes),
            param,
        )
    };
    if let Some(rest) = url.strip_prefix("data:") {
        let (meta, payload) =
            rest.split_once(',').ok_or_else(|| bad(ErrorCode::InvalidMedia, "malformed data URL (no comma)", param))?;
        if !meta.ends_with(";base64") {
            return Err(bad(
                ErrorCode::InvalidMedia,
                "data URLs must be base64-encoded (`data:<mime>;base64,...`)",
                param,
            ));
        }
        if payload.len() / 4 * 3 > limits.max_media_bytes + 3 {
            return Err(too_big(payload.len() / 4 * 3));
        }
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(payload.trim())
            .map_err(|e| bad(ErrorCode::InvalidMedia, format!("malformed base64 in data URL: {e}"), param))?;
        if bytes.len() > limits.max_media_bytes {
            return Err(too_big(bytes.len()));
        }
        return Ok(bytes);
    }
    if url.starts_with("http://") || url.starts_with("https://") {
        let host = url.split("://").nth(1).and_then(|r| r.split(['/', '?', '#']).next()).unwrap_or("");
        let host_only = host.rsplit('@').next().unwrap_or(host).split(':').next().unwrap_or("");
        if !limits.allowed_media_domains.iter().any(|d| d.eq_ignore_ascii_case(host_only)) {
            return Err(bad(
                ErrorCode::MediaUrlNotAllowed,
                format!("fetching media from `{host_only}` is not allowed; send a data: URL or start the server with --allowed-media-domains"),
                param,
            ));
        }
        let resp = ureq::get(url)
            .timeout(Duration::from_secs(20))
            .call()
            .map_err(|e| bad(ErrorCode::InvalidMedia, format!("fetching {url} failed: {e}"), param))?;
        let mut bytes = Vec::new();
        resp.into_reader()
            .take(limits.max_media_bytes as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| bad(ErrorCode::InvalidMedia, format!("reading {url} failed: {e}"), param))?;
        if bytes.len() > limits.max_media_bytes {
            return Err(too_big(bytes.len()));
        }
        return Ok(bytes);
    }
    if let Some(path) = url.strip_prefix("file://") {
        let denied =
            || bad(ErrorCode::MediaUrlNotAllowed, "local files are only read under --allowed-local-media-path", param);
        let root = limits.allowed_local_media_path.as_ref().ok_or_else(denied)?;
        let root = root.canonicalize().map_err(|_| denied())?;
        let p = std::path::Path::new(path)
            .canonicalize()
            .map_err(|e| bad(ErrorCode::InvalidMedia, format!("cannot open {path}: {e}"), param))?;
        if !p.starts_with(&root) {
            return Err(denied());
        }
        let len = std::fs::metadata(&p).map(|m| m.len() as usize).unwrap_or(0);
        if len > limits.max_media_bytes {
            return Err(too_big(len));
        }
        return std::fs::read(&p).map_err(|e| bad(ErrorCode::InvalidMedia, format!("cannot read {path}: {e}"), param));
    }
    Err(bad(
        ErrorCode::InvalidMedia,
        "media URLs must be data:, http(s):// (allow-listed) or file:// (allowed path)",
        param,
    ))
}

fn url_of(part: &Value, key: &str) -> Option<String> {
    match part.get(key)? {
        Value::String(s) => Some(s.clone()),
        v => v.get("url")?.as_str().map(str::to_string),
    }
}

/// Bytes of text in a message's content (a string, or the `text` of its parts).
fn content_bytes(content: Option<&Value>) -> usize {
    match content {
        Some(Value::String(s)) => s.len(),
        Some(Value::Array(parts)) => {
            parts.iter().filter_map(|p| p.get("text").and_then(Value::as_str)).map(str::len).sum()
        }
        _ => 0,
    }
}

/// Refuses a prompt whose text cannot fit the context whatever it tokenizes to (every token stands for
/// at most `max_token_bytes` bytes), before the tokenizer spends memory and time on it.
fn check_prompt_bytes(bytes: usize, cfg: &ServerConfig, param: &str) -> Result<(), ApiError> {
    let cap = cfg.context_len.saturating_mul(cfg.max_token_bytes.max(1));
    if bytes > cap {
        return Err(bad(
            ErrorCode::ContextLengthExceeded,
            format!(
                "the prompt has {bytes} bytes of text, more than this model's context of {} tokens can hold (a token is at most {} bytes)",
                cfg.context_len, cfg.max_token_bytes
            ),
            param,
        ));
    }
    Ok(())
}

/// Validates a chat request into a template-ready prompt (media fetched and decoded from URLs, not yet
/// from their image formats) and generation settings. Blocking (may fetch allow-listed URLs).
pub fn chat(req: &ChatRequest, cfg: &ServerConfig) -> Result<(ChatPrompt, GenParams), ApiError> {
    if req.messages.is_empty() {
        return Err(bad(ErrorCode::InvalidRequest, "messages must not be empty", "messages"));
    }
    // Tools are rendered into the prompt too: their JSON counts with the messages' text.
    let tool_bytes = req.tools.as_ref().map_or(0, |t| t.to_string().len());
    let text_bytes: usize = req.messages.iter().map(|m| content_bytes(m.get("content"))).sum();
    check_prompt_bytes(text_bytes + tool_bytes, cfg, "messages")?;
    let specs = tools::parse_chat_tools(req.tools.as_ref())?;
    let choice = tools::parse_tool_choice(req.tool_choice.as_ref(), &specs)?;
    let parallel = req.parallel_tool_calls.unwrap_or(true);
    let format = response_format(req.response_format.as_ref())?;
    let forced = match &choice {
        ToolChoice::Required if !specs.is_empty() => Some(Grammar::Lark(call_grammar(&specs, None, parallel))),
        ToolChoice::Named(n) => Some(Grammar::Lark(call_grammar(&specs, Some(n), parallel))),
        _ => None,
    };
    if forced.is_some() && format.is_some() {
        return Err(bad(
            ErrorCode::UnsupportedParameter,
            "a forced tool call (tool_choice required or named) cannot also have a JSON response_format",
            "response_format",
        ));
    }
    let grammar = forced.or(format);
    let top = match (req.logprobs, req.top_logprobs) {
        (false, Some(n)) if n > 0 => {
            return Err(bad(ErrorCode::InvalidRequest, "top_logprobs requires logprobs: true", "top_logprobs"))
        }
        (false, _) => None,
        (true, None) => Some(0),
        (true, Some(n)) if (0..=20).contains(&n) => Some(n as usize),
        (true, Some(n)) => {
            return Err(bad(
                ErrorCode::InvalidRequest,
                format!("top_logprobs must be in [0, 20], got {n}"),
                "top_logprobs",
            ))
        }
    };
    let gen = common(&req.common, cfg, top)?;
    let limits = &cfg.limits;
    let mut media = Vec::new();
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let param = format!("messages[{i}]");
        let role = m
            .get("role")
            .and_then(Value::as_str)
            .ok_or_else(|| bad(ErrorCode::InvalidRequest, "each message needs a role", &param))?;
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system",
            other => {
                return Err(bad(
                    ErrorCode::InvalidRole,
                    format!("unknown role `{other}` (system, developer, user, assistant, tool)"),
                    &format!("{param}.role"),
                ))
            }
        };
        let mut out = serde_json::Map::new();
        out.insert("role".into(), role.into());
        if let Some(r) = m.get("reasoning_content") {
            out.insert("reasoning_content".into(), r.clone());
        }
        if role == "assistant" {
            if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
                out.insert("tool_calls".into(), tools::template_calls(calls, &format!("{param}.tool_calls"))?);
            }
        }
        if role == "tool" {
            for k in ["tool_call_id", "name"] {
                if let Some(v) = m.get(k).filter(|v| v.is_string()) {
                    out.insert(k.into(), v.clone());
                }
            }
        }
        let content = match m.get("content") {
            // OpenAI allows a null content only on an assistant message that carries tool calls.
            None | Some(Value::Null) if role == "assistant" && m.get("tool_calls").is_some_and(|t| !t.is_null()) => {
                Value::String(String::new())
            }
            None | Some(Value::Null) => {
                return Err(bad(
                    ErrorCode::InvalidRequest,
                    "`content` is required (null only on an assistant message with tool_calls)",
                    &format!("{param}.content"),
                ))
            }
            Some(Value::String(s)) => Value::String(s.clone()),
            Some(Value::Array(parts)) => {
                let mut conv = Vec::with_capacity(parts.len());
                for (j, part) in parts.iter().enumerate() {
                    let pp = format!("{param}.content[{j}]");
                    let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
                    match kind {
                        "text" => {
                            let t = part
                                .get("text")
                                .and_then(Value::as_str)
                                .ok_or_else(|| bad(ErrorCode::InvalidRequest, "text parts need `text`", &pp))?;
                            conv.push(json!({"type": "text", "text": t}));
                        }
                        "image_url" | "image" => {
                            let url = url_of(part, kind)
                                .ok_or_else(|| bad(ErrorCode::InvalidRequest, "image parts need a url", &pp))?;
                            media.push(MediaInput::Image { bytes: resolve_url(&url, limits, &pp)? });
                            conv.push(json!({"type": "image"}));
                        }
                        "video_url" => {
                            let url = url_of(part, kind)
                                .ok_or_else(|| bad(ErrorCode::InvalidRequest, "video_url parts need a url", &pp))?;
                            media.push(MediaInput::VideoFile { bytes: resolve_url(&url, limits, &pp)? });
                            conv.push(json!({"type": "video"}));
                        }
                        "video" => {
                            let frames = part.get("video").and_then(Value::as_array).ok_or_else(|| {
                                bad(
                                    ErrorCode::InvalidRequest,
                                    "video parts need `video`: a list of frame image URLs",
                                    &pp,
                                )
                            })?;
                            if frames.len() > limits.max_video_frames {
                                return Err(bad(
                                    ErrorCode::MediaTooLarge,
                                    format!(
                                        "the video has {} frames, more than the limit of {}",
                                        frames.len(),
                                        limits.max_video_frames
                                    ),
                                    &pp,
                                ));
                            }
                            let frames = frames
                                .iter()
                                .map(|f| {
                                    f.as_str()
                                        .ok_or_else(|| bad(ErrorCode::InvalidRequest, "frames are URL strings", &pp))
                                        .and_then(|u| resolve_url(u, limits, &pp))
                                })
                                .collect::<Result<Vec<_>, _>>()?;
                            let fps = part.get("fps").and_then(Value::as_f64);
                            if fps.is_some_and(|f| !(f.is_finite() && f > 0.0)) {
                                return Err(bad(ErrorCode::InvalidRequest, "fps must be positive", &pp));
                            }
                            media.push(MediaInput::VideoFrames { frames, fps });
                            conv.push(json!({"type": "video"}));
                        }
                        other => {
                            return Err(bad(
                                ErrorCode::InvalidRequest,
                                format!("unsupported content part type `{other}`"),
                                &pp,
                            ))
                        }
                    }
                    if media.len() > limits.max_media_per_request {
                        return Err(bad(
                            ErrorCode::TooManyMedia,
                            format!("at most {} images/videos per request", limits.max_media_per_request),
                            &pp,
                        ));
                    }
                }
                Value::Array(conv)
            }
            Some(_) => {
                return Err(bad(ErrorCode::InvalidRequest, "content must be a string or a list of parts", &param))
            }
        };
        if !media.is_empty() && !cfg.vision {
            return Err(bad(
                ErrorCode::VisionUnsupported,
                format!("the model `{}` does not accept image or video input", cfg.model_id),
                &param,
            ));
        }
        if !cfg.video && media.iter().any(|m| !matches!(m, MediaInput::Image { .. })) {
            return Err(bad(
                ErrorCode::VisionUnsupported,
                format!("the model `{}` does not accept video input", cfg.model_id),
                &param,
            ));
        }
        out.insert("content".into(), content);
        messages.push(Value::Object(out));
    }
    let mut template_kwargs = req.chat_template_kwargs.clone().unwrap_or_default();
    // Tools are shown to the model, and its calls parsed, unless the choice is `none`.
    let offered = !specs.is_empty() && choice != ToolChoice::None;
    if offered {
        template_kwargs.insert("tools".into(), Value::Array(specs.iter().map(ToolSpec::template_json).collect()));
    }
    if grammar.is_some() {
        // The grammar covers the answer; a reasoning block before it would be forced into the grammar too.
        if template_kwargs.get("enable_thinking") == Some(&Value::Bool(true)) {
            return Err(bad(
                ErrorCode::UnsupportedParameter,
                "structured output and forced tool calls answer without thinking; leave enable_thinking unset or false",
                "chat_template_kwargs.enable_thinking",
            ));
        }
        template_kwargs.insert("enable_thinking".into(), false.into());
    }
    let mut gen = gen;
    if offered {
        gen.tools = Some(ToolSetup { specs, parallel });
    }
    let prompt = ChatPrompt {
        messages: Value::Array(messages),
        media,
        grammar,
        template_kwargs,
        limits: MediaLimits {
            max_pixels: limits.max_image_pixels,
            max_frames: limits.max_video_frames,
            max_total_pixels: limits.max_request_pixels,
        },
    };
    Ok((prompt, gen))
}

/// Validates a completion request.
pub fn completion(req: &CompletionRequest, cfg: &ServerConfig) -> Result<(CompletionPrompt, GenParams), ApiError> {
    if req.echo {
        return Err(bad(ErrorCode::UnsupportedParameter, "echo is not supported", "echo"));
    }
    let top = match req.logprobs {
        None => None,
        Some(n) if (0..=5).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(bad(ErrorCode::InvalidRequest, format!("logprobs must be in [0, 5], got {n}"), "logprobs"))
        }
    };
    let gen = common(&req.common, cfg, top)?;
    let prompt_bytes = match &req.prompt {
        Value::String(s) => s.len(),
        Value::Array(a) => a.iter().filter_map(Value::as_str).map(str::len).sum(),
        _ => 0,
    };
    check_prompt_bytes(prompt_bytes, cfg, "prompt")?;
    let prompt = match &req.prompt {
        Value::String(s) if !s.is_empty() => CompletionPrompt::Text(s.clone()),
        Value::Array(a) if !a.is_empty() && a.iter().all(Value::is_u64) => {
            let ids: Vec<u32> = a.iter().filter_map(Value::as_u64).map(|v| v as u32).collect();
            if let Some(t) = ids.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(bad(
                    ErrorCode::InvalidRequest,
                    format!("token id {t} is outside the vocabulary ({})", cfg.vocab_size),
                    "prompt",
                ));
            }
            CompletionPrompt::Ids(ids)
        }
        Value::Array(a) if a.len() == 1 && a[0].is_string() => {
            CompletionPrompt::Text(a[0].as_str().unwrap_or_default().to_string())
        }
        _ => {
            return Err(bad(
                ErrorCode::InvalidRequest,
                "prompt must be a non-empty string or array of token ids (one prompt per request)",
                "prompt",
            ))
        }
    };
    Ok((prompt, gen))
}
