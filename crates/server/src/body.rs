//! Reading a request body: `application/json` only, bounded in size and in time. A client that stalls
//! in the middle of its body gets 408 `request_timeout` and its connection is closed, instead of holding
//! a worker's connection slot forever.

use std::time::Duration;

use actix_web::http::header;
use actix_web::{web, HttpRequest};
use futures_util::StreamExt;
use osprey_protocol::ErrorCode;
use serde_json::Value;

use crate::error::ApiError;

/// Limits of a body read.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimits {
    /// Largest body, bytes.
    pub max_bytes: usize,
    /// Longest time from the handler's start to the body's last byte.
    pub timeout: Duration,
    /// The shape the JSON may take.
    pub json: JsonLimits,
    /// Any `Content-Type` is read as JSON when the request has no `Origin` (Ollama's API, whose own
    /// examples are `curl -d`, which sends a form type): the JSON-only rule guards against a browser's
    /// cross-origin form, and a browser always sends `Origin` with a POST.
    pub any_type_without_origin: bool,
}

/// Bounds on a JSON body's shape, checked on its bytes before any tree is built: a parsed tree costs
/// 32 bytes and more per value, so 50 MB of `[[],[],…]` once became gigabytes before any other limit
/// applied.
#[derive(Clone, Copy, Debug)]
pub struct JsonLimits {
    /// Deepest nesting of arrays and objects.
    pub max_depth: usize,
    /// Most values (array elements, object members and containers, counted by their separators).
    pub max_values: usize,
}

/// Deepest JSON nesting a body may have: a schema's own bound (64, `validate::schema`) plus the few
/// levels that wrap it in a request.
pub const MAX_JSON_DEPTH: usize = 80;

impl JsonLimits {
    /// The limits for a model of `context_len` tokens: 65,536 values plus four per context token (a
    /// prompt of token ids, or messages, can legitimately have as many elements as the context holds).
    pub fn for_context(context_len: usize) -> Self {
        JsonLimits { max_depth: MAX_JSON_DEPTH, max_values: 65_536 + 4 * context_len }
    }
}

/// Reads and parses the JSON body of `req`.
pub async fn read_json(req: &HttpRequest, mut payload: web::Payload, lim: BodyLimits) -> Result<Value, ApiError> {
    let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    let lenient = lim.any_type_without_origin && !req.headers().contains_key(header::ORIGIN);
    if !essence.eq_ignore_ascii_case("application/json") && !lenient {
        // A browser can send text/plain or a form cross-origin without a preflight; JSON it cannot.
        return Err(ApiError::new(
            ErrorCode::UnsupportedMediaType,
            format!("the request body must be sent as `Content-Type: application/json` (got `{ct}`)"),
        ));
    }
    let too_large = || {
        ApiError::new(ErrorCode::RequestTooLarge, format!("the request body is larger than {} bytes", lim.max_bytes))
    };
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<usize>().ok());
    if declared.is_some_and(|n| n > lim.max_bytes) {
        return Err(too_large());
    }
    let deadline = tokio::time::Instant::now() + lim.timeout;
    let mut body = web::BytesMut::with_capacity(declared.unwrap_or(0).min(lim.max_bytes));
    loop {
        let chunk = match tokio::time::timeout_at(deadline, payload.next()).await {
            Err(_) => {
                return Err(ApiError::new(
                    ErrorCode::RequestTimeout,
                    format!("the request body did not arrive within {} s", lim.timeout.as_secs_f64()),
                ))
            }
            Ok(None) => break,
            Ok(Some(c)) => {
                c.map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("could not read the request body: {e}")))?
            }
        };
        if body.len() + chunk.len() > lim.max_bytes {
            return Err(too_large());
        }
        body.extend_from_slice(&chunk);
    }
    parse_json(&body, lim.json)
}

/// Parses a body's bytes as JSON within `lim`.
pub fn parse_json(body: &[u8], lim: JsonLimits) -> Result<Value, ApiError> {
    scan(body, lim)?;
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("could not parse the request body: {e}")))
}

/// Checks nesting and value count in one pass over the bytes (strings skipped, escapes honoured). A
/// string's body is skipped with `memchr` to its next quote or backslash: a conversation of images
/// resends megabytes of base64 every turn (15 MB at turn 52 of the long-images run), and a byte at a
/// time that was ~10% of the server's CPU.
fn scan(body: &[u8], lim: JsonLimits) -> Result<(), ApiError> {
    let (mut depth, mut values) = (0usize, 0usize);
    let mut i = 0;
    while i < body.len() {
        let c = body[i];
        i += 1;
        match c {
            b'"' => {
                // To the closing quote: a backslash escapes the byte after it.
                loop {
                    match memchr::memchr2(b'"', b'\\', &body[i..]) {
                        None => i = body.len(),
                        Some(at) if body[i + at] == b'\\' => {
                            i = (i + at + 2).min(body.len());
                            continue;
                        }
                        Some(at) => i += at + 1,
                    }
                    break;
                }
                continue;
            }
            b'[' | b'{' => {
                depth += 1;
                values += 1;
                if depth > lim.max_depth {
                    return Err(ApiError::new(
                        ErrorCode::InvalidJson,
                        format!("the request body nests deeper than {} levels", lim.max_depth),
                    ));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' => values += 1,
            _ => continue,
        }
        if values > lim.max_values {
            return Err(ApiError::new(
                ErrorCode::RequestTooLarge,
                format!("the request body has more than {} JSON values", lim.max_values),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIM: JsonLimits = JsonLimits { max_depth: 4, max_values: 10 };

    fn code(body: &str) -> &'static str {
        match parse_json(body.as_bytes(), LIM) {
            Ok(_) => "ok",
            Err(e) => e.0.code.as_str(),
        }
    }

    #[test]
    fn shape_is_bounded_before_parsing() {
        assert_eq!(code(r#"{"a": [[[1]]]}"#), "ok");
        assert_eq!(code(r#"{"a": [[[[1]]]]}"#), "invalid_json");
        assert_eq!(code("[[],[],[],[],[]]"), "ok");
        assert_eq!(code("[[],[],[],[],[],[],[],[],[],[]]"), "request_too_large");
        assert_eq!(code("[1,2,3,4,5,6,7,8,9,10,11]"), "request_too_large");
        // Brackets and commas inside strings, escaped quotes included, are text.
        assert_eq!(code(r#"{"s": "[[[[[,,,,,,,,,,,,\"[[[[["}"#), "ok");
        // An escaped backslash ends before the quote, which closes the string: what follows counts.
        assert_eq!(code(r#"{"s": "\\", "t": [[[[1]]]]}"#), "invalid_json");
        assert_eq!(code(r#"["\\\"[[[[[", 1]"#), "ok");
        // Bodies that stop inside a string or after a backslash are refused by the parser, not a panic.
        for cut in [r#"{"s": "abc"#, r#"{"s": "abc\"#, "\"", "\"\\"] {
            assert_eq!(code(cut), "invalid_json", "{cut:?}");
        }
    }
}

/// An endpoint that takes a generation request.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses` (with an empty response store).
    Responses,
    /// `/v1/messages`.
    Messages,
}
