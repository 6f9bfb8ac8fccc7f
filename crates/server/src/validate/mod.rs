//! Parse, don't validate: OpenAI wire bodies become validated requests before anything enters the
//! engine. Lenient where OpenAI clients are (`max_completion_tokens` is `max_tokens`, `developer` is a
//! system role); strict about everything that would change the answer silently.

use osprey_protocol::constraint::Grammar;
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::{ChatPrompt, CompletionPrompt, MediaLimits};
use osprey_protocol::ErrorCode;
use serde::Deserialize;
use serde_json::Value;

use crate::config::ServerConfig;
use crate::error::{bad, ApiError};
use crate::grammar::call_grammar;
use crate::tools::{self, ToolChoice, ToolSpec};

mod kwargs;
mod media_url;
mod messages;
mod sampling;

use crate::schema::response_format;
pub use crate::schema::schema_grammar;
pub use media_url::resolve_url;
use messages::{check_prompt_bytes, content_bytes};
use sampling::common;

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
    /// Token id (as a string) → bias added to its logit, in [-100, 100].
    pub logit_bias: Option<serde_json::Map<String, Value>>,
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
    /// The deprecated form of `tools` (function definitions), mapped to `tools` as OpenAI does; the
    /// answer then names its call `function_call`.
    pub functions: Option<Value>,
    /// The deprecated form of `tool_choice` (`"none"`, `"auto"` or `{"name": …}`).
    pub function_call: Option<Value>,
    /// More than one call per answer (default true).
    pub parallel_tool_calls: Option<bool>,
    /// Extra template arguments (e.g. `enable_thinking`).
    pub chat_template_kwargs: Option<serde_json::Map<String, Value>>,
    /// Special tokens written in messages are control tokens (osprey extension; default false: text).
    #[serde(default)]
    pub parse_special_tokens: bool,
    /// Continue the last (assistant) message instead of starting a new turn (vLLM's extension; the
    /// Messages API sets it for a prefill).
    #[serde(default)]
    pub continue_final_message: bool,
    /// Render the generation prompt (default true; vLLM's extension).
    pub add_generation_prompt: Option<bool>,
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
    /// Chat-only fields a completion cannot honour: refused by name rather than ignored.
    pub response_format: Option<Value>,
    /// See `response_format`.
    pub tools: Option<Value>,
    /// See `response_format`.
    pub tool_choice: Option<Value>,
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
    /// The request used the deprecated `functions`: the answer's call is a `function_call`.
    pub legacy: bool,
}

/// `tools` and `tool_choice` of a chat request, the deprecated `functions` and `function_call` mapped
/// to them as OpenAI maps them.
struct Legacy {
    tools: Option<Value>,
    tool_choice: Option<Value>,
    legacy: bool,
}

fn legacy_functions(req: &ChatRequest) -> Result<Legacy, ApiError> {
    let present = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    if !present(&req.functions) {
        if present(&req.function_call) {
            return Err(bad(ErrorCode::InvalidRequest, "function_call needs functions", "function_call"));
        }
        return Ok(Legacy { tools: req.tools.clone(), tool_choice: req.tool_choice.clone(), legacy: false });
    }
    if present(&req.tools) || present(&req.tool_choice) {
        return Err(bad(
            ErrorCode::InvalidRequest,
            "give `tools` (and `tool_choice`) or the deprecated `functions` (and `function_call`), not both",
            "functions",
        ));
    }
    let Some(Value::Array(fs)) = &req.functions else {
        return Err(bad(ErrorCode::InvalidRequest, "functions must be a list of function definitions", "functions"));
    };
    let tools = fs.iter().map(|f| serde_json::json!({"type": "function", "function": f})).collect();
    let tool_choice = match &req.function_call {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if s == "none" || s == "auto" => Some(Value::String(s.clone())),
        Some(Value::Object(o)) if o.get("name").is_some_and(Value::is_string) => {
            Some(serde_json::json!({"type": "function", "function": {"name": o["name"]}}))
        }
        Some(_) => {
            return Err(bad(
                ErrorCode::InvalidRequest,
                "function_call must be \"none\", \"auto\" or {\"name\": …}",
                "function_call",
            ))
        }
    };
    Ok(Legacy { tools: Some(Value::Array(tools)), tool_choice, legacy: true })
}

/// Validates a chat request into a template-ready prompt (media fetched and decoded from URLs, not yet
/// from their image formats) and generation settings. Blocking (may fetch allow-listed URLs).
pub fn chat(req: &ChatRequest, cfg: &ServerConfig) -> Result<(ChatPrompt, GenParams), ApiError> {
    if req.messages.is_empty() {
        return Err(bad(ErrorCode::InvalidRequest, "messages must not be empty", "messages"));
    }
    check_message_count(req.messages.len(), cfg)?;
    let (mut template_kwargs, kw_tools) = kwargs::split(req.chat_template_kwargs.as_ref(), cfg)?;
    let Legacy { tools: req_tools, tool_choice: req_choice, legacy } = legacy_functions(req)?;
    let tools_value = match (&req_tools, kw_tools) {
        (Some(_), Some(_)) => {
            return Err(bad(
                ErrorCode::InvalidRequest,
                "tools are given twice (`tools` and `chat_template_kwargs.tools`); send them once",
                "chat_template_kwargs.tools",
            ))
        }
        (Some(t), None) => Some(t.clone()),
        (None, t) => t,
    };
    // Tools and template arguments are rendered into the prompt too: their JSON counts with the text.
    let tool_bytes = tools_value.as_ref().map_or(0, |t| t.to_string().len());
    let kwarg_bytes: usize = template_kwargs.values().map(|v| v.to_string().len()).sum();
    let text_bytes: usize = req.messages.iter().map(|m| content_bytes(m.get("content"))).sum();
    check_prompt_bytes(text_bytes + tool_bytes + kwarg_bytes, cfg, "messages")?;
    let specs = tools::parse_chat_tools(tools_value.as_ref())?;
    let choice = tools::parse_tool_choice(req_choice.as_ref(), &specs)?;
    // A legacy answer holds one `function_call`.
    let parallel = req.parallel_tool_calls.unwrap_or(true) && !legacy;
    let grammar = answer_grammar(req, &specs, &choice, parallel)?;
    let top = top_logprobs(req.logprobs, req.top_logprobs)?;
    let mut gen = common(&req.common, cfg, top)?;
    let mut media = Vec::new();
    let mut messages = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        messages.push(messages::message(i, m, cfg, &mut media)?);
    }
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
    if offered {
        gen.tools = Some(ToolSetup { specs, parallel, legacy });
    }
    if req.continue_final_message {
        if req.add_generation_prompt == Some(true) {
            return Err(bad(
                ErrorCode::InvalidRequest,
                "continue_final_message continues the last message; it cannot also add a generation prompt",
                "add_generation_prompt",
            ));
        }
        if req.messages.last().and_then(|m| m.get("role")).and_then(Value::as_str) != Some("assistant") {
            return Err(bad(
                ErrorCode::InvalidRequest,
                "continue_final_message needs the last message to be the assistant's",
                "continue_final_message",
            ));
        }
    }
    let add_generation_prompt = req.add_generation_prompt.unwrap_or(!req.continue_final_message);
    let prompt = ChatPrompt {
        messages: Value::Array(messages),
        media,
        grammar,
        template_kwargs,
        parse_special_tokens: req.parse_special_tokens,
        add_generation_prompt,
        continue_final_message: req.continue_final_message,
        deadline: None,
        limits: MediaLimits {
            max_pixels: cfg.limits.max_image_pixels,
            max_frames: cfg.limits.max_video_frames,
            max_total_pixels: cfg.limits.max_request_pixels,
            max_media_tokens: cfg.context_len,
        },
    };
    Ok((prompt, gen))
}

/// Most messages a chat body may hold: every message costs at least four template tokens (its
/// `<|im_start|>`, role, line break and `<|im_end|>`), so more than a quarter of the context cannot fit
/// whatever they say; refused before any message is converted.
fn check_message_count(n: usize, cfg: &ServerConfig) -> Result<(), ApiError> {
    let max = (cfg.context_len / 4).max(16);
    if n > max {
        return Err(bad(
            ErrorCode::ContextLengthExceeded,
            format!("{n} messages cannot fit this model's context of {} tokens (at most {max})", cfg.context_len),
            "messages",
        ));
    }
    Ok(())
}

/// The grammar the answer must follow: a forced call's, or `response_format`'s (not both).
fn answer_grammar(
    req: &ChatRequest,
    specs: &[ToolSpec],
    choice: &ToolChoice,
    parallel: bool,
) -> Result<Option<Grammar>, ApiError> {
    let format = response_format(req.response_format.as_ref())?;
    let forced = match choice {
        ToolChoice::Required if !specs.is_empty() => Some(Grammar::Lark(call_grammar(specs, None, parallel))),
        ToolChoice::Named(n) => Some(Grammar::Lark(call_grammar(specs, Some(n), parallel))),
        _ => None,
    };
    if forced.is_some() && format.is_some() {
        return Err(bad(
            ErrorCode::UnsupportedParameter,
            "a forced tool call (tool_choice required or named) cannot also have a JSON response_format",
            "response_format",
        ));
    }
    Ok(forced.or(format))
}

/// `logprobs` / `top_logprobs` of chat completions as the sampler's count of alternatives.
fn top_logprobs(logprobs: bool, top: Option<i64>) -> Result<Option<usize>, ApiError> {
    match (logprobs, top) {
        (false, Some(n)) if n > 0 => {
            Err(bad(ErrorCode::InvalidRequest, "top_logprobs requires logprobs: true", "top_logprobs"))
        }
        (false, _) => Ok(None),
        (true, None) => Ok(Some(0)),
        (true, Some(n)) if (0..=20).contains(&n) => Ok(Some(n as usize)),
        (true, Some(n)) => {
            Err(bad(ErrorCode::InvalidRequest, format!("top_logprobs must be in [0, 20], got {n}"), "top_logprobs"))
        }
    }
}

/// Validates a completion request.
pub fn completion(req: &CompletionRequest, cfg: &ServerConfig) -> Result<(CompletionPrompt, GenParams), ApiError> {
    if req.echo {
        return Err(bad(ErrorCode::UnsupportedParameter, "echo is not supported", "echo"));
    }
    for (field, v) in
        [("response_format", &req.response_format), ("tools", &req.tools), ("tool_choice", &req.tool_choice)]
    {
        if v.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad(
                ErrorCode::UnsupportedParameter,
                format!("`{field}` is not supported on /v1/completions; use /v1/chat/completions"),
                field,
            ));
        }
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
