//! Messages: roles, content parts and their media, and the prompt-size check before tokenization.

use osprey_protocol::tokenizer::MediaInput;
use osprey_protocol::ErrorCode;
use serde_json::{json, Value};

use super::media_url::MediaKind;
use super::{bad, resolve_url, tools};
use crate::config::ServerConfig;
use crate::error::ApiError;

fn url_of(part: &Value, key: &str) -> Option<String> {
    match part.get(key)? {
        Value::String(s) => Some(s.clone()),
        v => v.get("url")?.as_str().map(str::to_string),
    }
}

/// Bytes of text in a message's content (a string, or the `text` of its parts).
pub(super) fn content_bytes(content: Option<&Value>) -> usize {
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
pub(super) fn check_prompt_bytes(bytes: usize, cfg: &ServerConfig, param: &str) -> Result<(), ApiError> {
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

/// One message of a chat body as the template takes it: its role checked (`developer` is `system`),
/// its content parts converted, and its media items resolved into `media` (at most
/// `max_media_per_request` in all).
pub(super) fn message(i: usize, m: &Value, cfg: &ServerConfig, media: &mut Vec<MediaInput>) -> Result<Value, ApiError> {
    let param = format!("messages[{i}]");
    let role = m
        .get("role")
        .and_then(Value::as_str)
        .ok_or_else(|| bad(ErrorCode::InvalidRequest, "each message needs a role", &param))?;
    let role = match role {
        "system" | "user" | "assistant" | "tool" => role,
        "developer" => "system",
        // The deprecated `functions` flow: a function's result is a tool message named by the function.
        "function" => "tool",
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
        } else if let Some(fc) = m.get("function_call").filter(|c| !c.is_null()) {
            // The deprecated form of one call.
            let calls = serde_json::json!([{"id": "call_0", "type": "function", "function": fc}]);
            out.insert("tool_calls".into(), tools::template_calls(&calls, &format!("{param}.function_call"))?);
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
        None | Some(Value::Null)
            if role == "assistant"
                && ["tool_calls", "function_call"].iter().any(|k| m.get(*k).is_some_and(|t| !t.is_null())) =>
        {
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
                conv.push(content_part(part, cfg, media, &pp)?);
                if media.len() > cfg.limits.max_media_per_request {
                    return Err(bad(
                        ErrorCode::TooManyMedia,
                        format!("at most {} images/videos per request", cfg.limits.max_media_per_request),
                        &pp,
                    ));
                }
            }
            Value::Array(conv)
        }
        Some(_) => return Err(bad(ErrorCode::InvalidRequest, "content must be a string or a list of parts", &param)),
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
    Ok(Value::Object(out))
}

/// One content part: text as it is, an image or video resolved into `media` and left as a placeholder.
fn content_part(part: &Value, cfg: &ServerConfig, media: &mut Vec<MediaInput>, pp: &str) -> Result<Value, ApiError> {
    let limits = &cfg.limits;
    let kind = part.get("type").and_then(Value::as_str).unwrap_or("");
    match kind {
        "text" => {
            let t = part
                .get("text")
                .and_then(Value::as_str)
                .ok_or_else(|| bad(ErrorCode::InvalidRequest, "text parts need `text`", pp))?;
            Ok(json!({"type": "text", "text": t}))
        }
        "image_url" | "image" => {
            let url = url_of(part, kind).ok_or_else(|| bad(ErrorCode::InvalidRequest, "image parts need a url", pp))?;
            media.push(MediaInput::Image { bytes: resolve_url(&url, limits, MediaKind::Image, pp)? });
            Ok(json!({"type": "image"}))
        }
        "video_url" => {
            let url =
                url_of(part, kind).ok_or_else(|| bad(ErrorCode::InvalidRequest, "video_url parts need a url", pp))?;
            media.push(MediaInput::VideoFile { bytes: resolve_url(&url, limits, MediaKind::Video, pp)? });
            Ok(json!({"type": "video"}))
        }
        "video" => {
            media.push(video_frames(part, cfg, pp)?);
            Ok(json!({"type": "video"}))
        }
        other => Err(bad(ErrorCode::InvalidRequest, format!("unsupported content part type `{other}`"), pp)),
    }
}

/// A `{"type": "video", "video": [frame URLs], "fps": n}` part.
fn video_frames(part: &Value, cfg: &ServerConfig, pp: &str) -> Result<MediaInput, ApiError> {
    let limits = &cfg.limits;
    let frames = part
        .get("video")
        .and_then(Value::as_array)
        .ok_or_else(|| bad(ErrorCode::InvalidRequest, "video parts need `video`: a list of frame image URLs", pp))?;
    if frames.len() > limits.max_video_frames {
        return Err(bad(
            ErrorCode::MediaTooLarge,
            format!("the video has {} frames, more than the limit of {}", frames.len(), limits.max_video_frames),
            pp,
        ));
    }
    // A present `fps` is a positive number; any other type is refused, not ignored.
    let fps = match part.get("fps") {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => n
            .as_f64()
            .filter(|f| f.is_finite() && *f > 0.0)
            .map(Some)
            .ok_or(())
            .map_err(|_| bad(ErrorCode::InvalidRequest, "fps must be a positive number", &format!("{pp}.fps")))?,
        Some(_) => return Err(bad(ErrorCode::InvalidRequest, "fps must be a positive number", &format!("{pp}.fps"))),
    };
    let frames = frames
        .iter()
        .map(|f| {
            f.as_str()
                .ok_or_else(|| bad(ErrorCode::InvalidRequest, "frames are URL strings", pp))
                .and_then(|u| resolve_url(u, limits, MediaKind::Image, pp))
        })
        .collect::<Result<Vec<_>, _>>()?;
    Ok(MediaInput::VideoFrames { frames, fps })
}
