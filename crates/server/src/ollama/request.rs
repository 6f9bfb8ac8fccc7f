//! Ollama request bodies as the chat completions (or, for a raw `/api/generate`, completions) bodies they
//! run as. Every field of Ollama's API is either translated, accepted with a documented reason to ignore
//! it, or refused by name: nothing is silently dropped (docs/api.md, "Ollama API").

use osprey_protocol::ErrorCode;
use serde_json::{json, Map, Value};

use crate::error::{invalid, ApiError};

/// The fields of `POST /api/chat`.
/// `tool_choice` and `parallel_tool_calls` are osprey's extensions (Ollama has neither), with OpenAI's
/// values: to force a call, and one call at most.
const CHAT_FIELDS: &[&str] = &[
    "model",
    "messages",
    "tools",
    "format",
    "options",
    "stream",
    "think",
    "keep_alive",
    "tool_choice",
    "parallel_tool_calls",
];

/// The fields of `POST /api/generate`.
const GENERATE_FIELDS: &[&str] = &[
    "model",
    "prompt",
    "suffix",
    "images",
    "format",
    "options",
    "system",
    "template",
    "stream",
    "raw",
    "keep_alive",
    "context",
    "think",
];

/// Options that tune how Ollama's runner works, not what it answers (threads, GPU layers, batch size,
/// memory mapping): this server has its own flags for them, so they are accepted and have no effect.
/// `mirostat_tau`/`_eta` only apply with `mirostat` on, `repeat_last_n` and `penalize_newline` are
/// llama.cpp's penalty window and a deprecated switch.
const RUNTIME_OPTIONS: &[&str] = &[
    "num_keep",
    "num_batch",
    "num_gpu",
    "main_gpu",
    "use_mmap",
    "use_mlock",
    "num_thread",
    "low_vram",
    "f16_kv",
    "vocab_only",
    "numa",
    "logits_all",
    "embedding_only",
    "mirostat_tau",
    "mirostat_eta",
    "repeat_last_n",
    "penalize_newline",
];

/// What an Ollama request asks for, besides the chat or completions body.
#[derive(Debug)]
pub struct Asked {
    /// The chat completions body (or the completions body when `raw`).
    pub body: Value,
    /// NDJSON streaming (Ollama's default).
    pub stream: bool,
    /// A raw `/api/generate`: the prompt as is, without the chat template.
    pub raw: bool,
    /// An `/api/generate` with neither prompt nor images: Ollama's way to load a model (answered
    /// `done_reason: "load"` at once).
    pub load_only: bool,
}

fn object<'a>(body: &'a Value, endpoint: &str, fields: &[&str]) -> Result<&'a Map<String, Value>, ApiError> {
    let o = body.as_object().ok_or_else(|| invalid("the body must be a JSON object", "body"))?;
    if let Some(k) = o.keys().find(|k| !fields.contains(&k.as_str())) {
        return Err(ApiError::new(ErrorCode::UnsupportedParameter, format!("`{k}` is not a field of {endpoint}"))
            .param(k.clone()));
    }
    Ok(o)
}

/// The served model's names: its id, and the id with Ollama's default tag.
pub fn is_ours(name: &str, id: &str) -> bool {
    name == id || name.strip_suffix(":latest") == Some(id)
}

/// Checks the model Ollama requires in every request.
fn check_model(o: &Map<String, Value>, id: &str) -> Result<(), ApiError> {
    let name = o.get("model").and_then(Value::as_str).ok_or_else(|| invalid("model is required", "model"))?;
    if !is_ours(name, id) {
        let shown = crate::error::shown_id(name);
        return Err(ApiError::new(
            ErrorCode::ModelNotFound,
            format!("model \"{shown}\" not found (this server serves \"{id}\")"),
        )
        .param("model"));
    }
    Ok(())
}

/// `options` as chat body fields.
fn options(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let Some(opts) = o.get("options").filter(|v| !v.is_null()) else { return Ok(()) };
    let opts = opts.as_object().ok_or_else(|| invalid("options must be an object", "options"))?;
    for (k, v) in opts {
        let param = format!("options.{k}");
        let number = || v.as_f64().ok_or_else(|| invalid(format!("{k} must be a number"), &param));
        match k.as_str() {
            "temperature" | "top_p" | "top_k" | "min_p" | "presence_penalty" | "frequency_penalty" | "stop" => {
                chat.insert(k.clone(), v.clone());
            }
            "repeat_penalty" => {
                chat.insert("repetition_penalty".into(), v.clone());
            }
            // A negative seed is Ollama's "random".
            "seed" if number()? < 0.0 => {}
            "seed" => {
                chat.insert("seed".into(), v.clone());
            }
            // -1: no limit, -2: fill the context; here both are the room the context and the KV pool leave.
            "num_predict" if number()? < 0.0 => {}
            "num_predict" => {
                chat.insert("max_tokens".into(), v.clone());
            }
            // The context is the server's (`--context`, shown by /api/show and /api/ps); a request cannot
            // resize the KV pool. Checked, then the server's applies.
            "num_ctx" if number()? >= 1.0 => {}
            "num_ctx" => return Err(invalid("num_ctx must be a positive integer", &param)),
            "mirostat" if number()? == 0.0 => {}
            "tfs_z" | "typical_p" if number()? == 1.0 => {}
            "mirostat" | "tfs_z" | "typical_p" => {
                return Err(ApiError::new(
                    ErrorCode::UnsupportedParameter,
                    format!("{k} sampling is not supported (temperature, top_k, top_p, min_p and the penalties are)"),
                )
                .param(param))
            }
            k if RUNTIME_OPTIONS.contains(&k) => {}
            _ => {
                return Err(ApiError::new(ErrorCode::UnsupportedParameter, format!("unknown option `{k}`")).param(param))
            }
        }
    }
    Ok(())
}

/// `format` (`"json"` or a JSON Schema) as `response_format`; Ollama ignores the keywords it cannot
/// enforce, so the schema is not strict.
fn format(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let rf = match o.get("format") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::String(s)) if s.is_empty() => return Ok(()),
        Some(Value::String(s)) if s == "json" => json!({"type": "json_object"}),
        Some(schema @ Value::Object(_)) => {
            json!({"type": "json_schema", "json_schema": {"name": "format", "schema": schema, "strict": false}})
        }
        Some(_) => return Err(invalid("format must be \"json\" or a JSON Schema object", "format")),
    };
    chat.insert("response_format".into(), rf);
    Ok(())
}

/// `think` as the template's `enable_thinking` (a level counts as on: the model has one way to think).
fn think(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<(), ApiError> {
    let on = match o.get("think") {
        None | Some(Value::Null) => return Ok(()),
        Some(Value::Bool(b)) => *b,
        Some(Value::String(s)) if matches!(s.as_str(), "low" | "medium" | "high") => true,
        Some(_) => return Err(invalid("think must be true, false, \"low\", \"medium\" or \"high\"", "think")),
    };
    chat.insert("chat_template_kwargs".into(), json!({"enable_thinking": on}));
    Ok(())
}

/// `keep_alive` (a duration string or seconds): the model stays loaded for the server's lifetime, so
/// any value is accepted once it parses as one of Ollama's forms.
fn keep_alive(o: &Map<String, Value>) -> Result<(), ApiError> {
    match o.get("keep_alive") {
        None | Some(Value::Null | Value::Number(_)) => Ok(()),
        Some(Value::String(s)) if s.trim_start_matches('-').chars().next().is_some_and(|c| c.is_ascii_digit()) => {
            Ok(())
        }
        Some(_) => {
            Err(invalid("keep_alive must be a duration (\"5m\", \"1h\", \"-1\") or a number of seconds", "keep_alive"))
        }
    }
}

/// The MIME type a base64 image starts with (the bytes' magic number), PNG when unknown: the decoder
/// reads the bytes, the type only has to say "image".
fn mime(b64: &str) -> &'static str {
    match b64.as_bytes() {
        [b'/', b'9', b'j', b'/', ..] => "image/jpeg",
        [b'R', b'0', b'l', b'G', ..] => "image/gif",
        [b'U', b'k', b'l', b'G', ..] => "image/webp",
        _ => "image/png",
    }
}

/// Text and base64 `images` as chat content parts: the images first, as Qwen's chat examples and
/// Ollama's templates for vision models place them.
fn content(text: &str, images: Option<&Value>, param: &str) -> Result<Value, ApiError> {
    let Some(images) = images.filter(|v| !v.is_null()) else { return Ok(Value::String(text.into())) };
    let list = images.as_array().ok_or_else(|| invalid("images must be a list of base64 strings", param))?;
    let mut parts = Vec::with_capacity(list.len() + 1);
    for (i, img) in list.iter().enumerate() {
        let b64 = img.as_str().ok_or_else(|| invalid("images must be base64 strings", &format!("{param}[{i}]")))?;
        let url = if b64.starts_with("data:") { b64.to_string() } else { format!("data:{};base64,{b64}", mime(b64)) };
        parts.push(json!({"type": "image_url", "image_url": {"url": url}}));
    }
    parts.push(json!({"type": "text", "text": text}));
    Ok(Value::Array(parts))
}

/// One Ollama message as a chat message.
fn message(m: &Value, param: &str) -> Result<Value, ApiError> {
    let role = m.get("role").and_then(Value::as_str).ok_or_else(|| invalid("messages need a role", param))?;
    let text = match m.get("content") {
        None | Some(Value::Null) => "",
        Some(Value::String(s)) => s,
        Some(_) => return Err(invalid("content must be a string", &format!("{param}.content"))),
    };
    let mut out = json!({"role": role, "content": content(text, m.get("images"), &format!("{param}.images"))?});
    if let Some(t) = m.get("thinking").and_then(Value::as_str).filter(|t| !t.is_empty()) {
        out["reasoning_content"] = t.into();
    }
    if let Some(calls) = m.get("tool_calls").filter(|c| !c.is_null()) {
        // Ollama's calls carry no id; the template does not need one.
        let list =
            calls.as_array().ok_or_else(|| invalid("tool_calls must be a list", &format!("{param}.tool_calls")))?;
        let conv: Vec<Value> = list
            .iter()
            .enumerate()
            .map(|(j, c)| {
                let mut c = c.clone();
                c["type"] = "function".into();
                c["id"] = format!("call_{j}").into();
                c
            })
            .collect();
        out["tool_calls"] = Value::Array(conv);
    }
    if let Some(name) = m.get("tool_name").filter(|n| n.is_string()) {
        out["name"] = name.clone();
    }
    Ok(out)
}

/// Fields the chat and generate bodies share: options, format, think, stream.
fn common(o: &Map<String, Value>, chat: &mut Map<String, Value>) -> Result<bool, ApiError> {
    options(o, chat)?;
    format(o, chat)?;
    think(o, chat)?;
    keep_alive(o)?;
    let stream = match o.get("stream") {
        None | Some(Value::Null) => true,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("stream must be true or false", "stream")),
    };
    Ok(stream)
}

/// `POST /api/chat`'s body as a chat completions body.
pub fn chat(body: &Value, id: &str) -> Result<Asked, ApiError> {
    let o = object(body, "/api/chat", CHAT_FIELDS)?;
    check_model(o, id)?;
    let list = match o.get("messages") {
        None | Some(Value::Null) => &Vec::new(),
        Some(Value::Array(l)) => l,
        Some(_) => return Err(invalid("messages must be a list", "messages")),
    };
    let messages =
        list.iter().enumerate().map(|(i, m)| message(m, &format!("messages[{i}]"))).collect::<Result<Vec<_>, _>>()?;
    let load_only = messages.is_empty();
    let mut chat = Map::new();
    chat.insert("messages".into(), Value::Array(messages));
    for k in ["tools", "tool_choice", "parallel_tool_calls"] {
        if let Some(t) = o.get(k).filter(|t| !t.is_null()) {
            chat.insert(k.into(), t.clone());
        }
    }
    let stream = common(o, &mut chat)?;
    Ok(Asked { body: Value::Object(chat), stream, raw: false, load_only })
}

/// `POST /api/generate`'s body as a chat completions body (its `system` and `prompt` as the turns the
/// template renders), or, when `raw`, a completions body.
pub fn generate(body: &Value, id: &str) -> Result<Asked, ApiError> {
    let o = object(body, "/api/generate", GENERATE_FIELDS)?;
    check_model(o, id)?;
    let text = |k: &str| -> Result<&str, ApiError> {
        match o.get(k) {
            None | Some(Value::Null) => Ok(""),
            Some(Value::String(s)) => Ok(s),
            Some(_) => Err(invalid(format!("{k} must be a string"), k)),
        }
    };
    let refused = |k: &str, why: &str| ApiError::new(ErrorCode::UnsupportedParameter, why.to_string()).param(k);
    if !text("suffix")?.is_empty() {
        return Err(refused("suffix", "fill-in-the-middle (`suffix`) is not supported by the served model's template"));
    }
    if !text("template")?.is_empty() {
        return Err(refused("template", "a request cannot replace the model's chat template"));
    }
    if o.get("context").and_then(Value::as_array).is_some_and(|c| !c.is_empty()) {
        return Err(refused(
            "context",
            "`context` (deprecated by Ollama) is not supported: send the conversation to /api/chat",
        ));
    }
    let raw = match o.get("raw") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(invalid("raw must be true or false", "raw")),
    };
    let (prompt, system) = (text("prompt")?, text("system")?);
    let images = o.get("images").filter(|v| v.as_array().is_some_and(|l| !l.is_empty()));
    let load_only = prompt.is_empty() && images.is_none();
    let mut chat = Map::new();
    if raw {
        if images.is_some() || !system.is_empty() {
            return Err(invalid("a raw prompt takes no images or system (it is sent as is)", "raw"));
        }
        chat.insert("prompt".into(), prompt.into());
    } else {
        let mut messages = Vec::new();
        if !system.is_empty() {
            messages.push(json!({"role": "system", "content": system}));
        }
        messages.push(json!({"role": "user", "content": content(prompt, images, "images")?}));
        chat.insert("messages".into(), Value::Array(messages));
    }
    let stream = common(o, &mut chat)?;
    if raw && (chat.contains_key("response_format") || chat.contains_key("chat_template_kwargs")) {
        return Err(invalid("a raw prompt takes no format or think (they need the chat template)", "raw"));
    }
    Ok(Asked { body: Value::Object(chat), stream, raw, load_only })
}

/// A chat-body parameter as an Ollama client wrote it, for error messages.
pub fn param(p: &str) -> String {
    let opt = |name: &str| format!("options.{name}");
    match p {
        "max_tokens" => opt("num_predict"),
        "repetition_penalty" => opt("repeat_penalty"),
        "temperature" | "top_p" | "top_k" | "min_p" | "seed" | "stop" | "presence_penalty" | "frequency_penalty" => {
            opt(p)
        }
        _ if p.starts_with("response_format") => "format".into(),
        _ if p.starts_with("chat_template_kwargs") => "think".into(),
        _ => p.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chat_bodies_translate_field_by_field() {
        let body = json!({"model": "m:latest", "stream": false, "think": "high", "keep_alive": "5m", "format": "json",
            "options": {"temperature": 0.2, "num_predict": 12, "seed": -1, "num_ctx": 8192, "repeat_penalty": 1.1, "num_gpu": 99, "stop": ["\n"]},
            "messages": [{"role": "user", "content": "hi", "images": ["iVBORw0KGgo="]},
                {"role": "assistant", "content": "", "thinking": "hm", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "3", "tool_name": "f"}]});
        let a = chat(&body, "m").expect("translates");
        assert!(!a.stream && !a.raw && !a.load_only);
        let b = &a.body;
        assert_eq!(
            (b["temperature"].as_f64(), b["max_tokens"].as_i64(), b["repetition_penalty"].as_f64()),
            (Some(0.2), Some(12), Some(1.1))
        );
        assert!(b.get("seed").is_none(), "a negative seed is random");
        assert_eq!(b["response_format"], json!({"type": "json_object"}));
        assert_eq!(b["chat_template_kwargs"], json!({"enable_thinking": true}));
        assert_eq!(b["messages"][0]["content"][0]["image_url"]["url"], "data:image/png;base64,iVBORw0KGgo=");
        assert_eq!(b["messages"][1]["reasoning_content"], "hm");
        assert_eq!(b["messages"][1]["tool_calls"][0]["function"]["arguments"], json!({"a": 1}));
        assert_eq!(b["messages"][2]["name"], "f");
    }

    #[test]
    fn what_cannot_be_honoured_is_refused_by_name() {
        let ask = |extra: Value| {
            let mut b = json!({"model": "m", "messages": [{"role": "user", "content": "hi"}]});
            b.as_object_mut().expect("object").extend(extra.as_object().expect("object").clone());
            chat(&b, "m").err().map(|e| (e.0.param.unwrap_or_default(), e.0.message))
        };
        assert_eq!(ask(json!({"options": {"mirostat": 2}})).map(|e| e.0), Some("options.mirostat".into()));
        assert_eq!(ask(json!({"options": {"mirostat": 0, "tfs_z": 1.0}})), None);
        assert_eq!(ask(json!({"options": {"typo": 1}})).map(|e| e.0), Some("options.typo".into()));
        assert_eq!(ask(json!({"prompt": "x"})).map(|e| e.0), Some("prompt".into()), "a generate field on chat");
        assert_eq!(ask(json!({"format": "yaml"})).map(|e| e.0), Some("format".into()));
        assert_eq!(ask(json!({"think": "max"})).map(|e| e.0), Some("think".into()));
        assert_eq!(ask(json!({"model": "llama3"})).map(|e| e.0), Some("model".into()));
        let g = |b: Value| generate(&b, "m").err().map(|e| e.0.param.unwrap_or_default());
        assert_eq!(g(json!({"model": "m", "prompt": "x", "suffix": "y"})), Some("suffix".into()));
        assert_eq!(g(json!({"model": "m", "prompt": "x", "template": "{{ .Prompt }}"})), Some("template".into()));
        assert_eq!(g(json!({"model": "m", "prompt": "x", "context": [1, 2]})), Some("context".into()));
        assert_eq!(g(json!({"model": "m", "prompt": "x", "raw": true, "format": "json"})), Some("raw".into()));
        assert!(generate(&json!({"model": "m:latest"}), "m").expect("a load request").load_only);
    }

    #[test]
    fn chat_parameters_are_named_as_ollama_names_them() {
        assert_eq!(param("max_tokens"), "options.num_predict");
        assert_eq!(param("response_format.json_schema.schema"), "format");
        assert_eq!(param("messages[0].content"), "messages[0].content");
    }
}
