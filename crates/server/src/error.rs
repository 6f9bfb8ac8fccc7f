//! The one place where errors become HTTP: status codes and the OpenAI error envelope
//! `{"error": {"message", "type", "param", "code"}}`, also used as an SSE event mid-stream.

use actix_web::http::StatusCode;
use actix_web::{HttpResponse, ResponseError};
use osprey_protocol::{ErrorCode, RequestError};

/// An error on its way to the client.
#[derive(Debug)]
pub struct ApiError(pub RequestError);

impl From<RequestError> for ApiError {
    fn from(e: RequestError) -> Self {
        ApiError(e)
    }
}

/// Longest error message a client gets, in bytes.
pub const MAX_MESSAGE: usize = 1024;
/// Longest parameter name an error names, in bytes.
pub const MAX_PARAM: usize = 256;
/// `s` cut to at most `max` bytes on a character boundary, `…` marking the cut.
pub(crate) fn bounded(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

/// An `invalid_request` error about `param` (the request's shape or values).
pub(crate) fn invalid(msg: impl Into<String>, param: &str) -> ApiError {
    ApiError::new(ErrorCode::InvalidRequest, msg).param(param)
}

impl ApiError {
    /// Shorthand constructor.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ApiError(RequestError::new(code, message))
    }

    /// Names the offending parameter.
    pub fn param(mut self, p: impl Into<String>) -> Self {
        self.0.param = Some(p.into());
        self
    }

    /// The message as a client sees it: at most [`MAX_MESSAGE`] bytes, so a string a client sent (a 1 MB
    /// role, a schema) is never echoed whole.
    pub fn message(&self) -> String {
        bounded(&self.0.message, MAX_MESSAGE)
    }

    /// The parameter as a client sees it (at most [`MAX_PARAM`] bytes).
    pub fn param_name(&self) -> Option<String> {
        self.0.param.as_deref().map(|p| bounded(p, MAX_PARAM))
    }

    /// The envelope as JSON.
    pub fn body(&self) -> serde_json::Value {
        let kind = match self.status_code().as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            500..=599 => "server_error",
            _ => "invalid_request_error",
        };
        serde_json::json!({"error": {
            "message": self.message(),
            "type": kind,
            "param": self.param_name(),
            "code": self.0.code.as_str(),
        }})
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl ResponseError for ApiError {
    fn status_code(&self) -> StatusCode {
        match self.0.code {
            ErrorCode::InvalidApiKey => StatusCode::UNAUTHORIZED,
            ErrorCode::ModelNotFound => StatusCode::NOT_FOUND,
            ErrorCode::MediaTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::MediaUrlNotAllowed => StatusCode::FORBIDDEN,
            ErrorCode::EngineError => StatusCode::INTERNAL_SERVER_ERROR,
            ErrorCode::Unavailable | ErrorCode::Overloaded | ErrorCode::OutOfMemory => StatusCode::SERVICE_UNAVAILABLE,
            ErrorCode::NotFound | ErrorCode::ResponseNotFound => StatusCode::NOT_FOUND,
            ErrorCode::RequestTimeout => StatusCode::REQUEST_TIMEOUT,
            ErrorCode::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
            ErrorCode::MethodNotAllowed => StatusCode::METHOD_NOT_ALLOWED,
            ErrorCode::RequestTooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            ErrorCode::UnsupportedMediaType => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            ErrorCode::HostNotAllowed | ErrorCode::OriginNotAllowed => StatusCode::FORBIDDEN,
            _ => StatusCode::BAD_REQUEST,
        }
    }

    fn error_response(&self) -> HttpResponse {
        let mut r = HttpResponse::build(self.status_code());
        if self.0.code == ErrorCode::Overloaded {
            // Requests drain at a few per second on this hardware: a short wait is the useful hint.
            r.insert_header((actix_web::http::header::RETRY_AFTER, "2"));
        }
        r.json(self.body())
    }
}

/// An optional string field as an error message shows it: `` `text` ``, or "none" when missing (not
/// Rust's `Some("text")`).
pub(crate) fn shown(v: Option<&str>) -> String {
    // At most 64 characters of it, as ids are cut ([`shown_id`]).
    v.map_or_else(|| "none".to_string(), |s| format!("`{}`", shown_id(s)))
}

/// `e`'s response (its status and headers, `Retry-After` included) with `body` in another API's shape
/// (Anthropic's envelope, Ollama's `{"error"}`).
pub(crate) fn rewrapped(e: &ApiError, body: &serde_json::Value) -> actix_web::HttpResponse {
    let mut r = e.error_response();
    let mut b = HttpResponse::build(r.status());
    for (k, v) in r.headers_mut().iter() {
        if k != actix_web::http::header::CONTENT_LENGTH && k != actix_web::http::header::CONTENT_TYPE {
            b.insert_header((k.clone(), v.clone()));
        }
    }
    b.json(body)
}

/// A refused request parameter: `code`, the message, and the parameter it names.
pub(crate) fn bad(code: ErrorCode, msg: impl Into<String>, param: &str) -> ApiError {
    ApiError::new(code, msg).param(param)
}

/// An id as an error message shows it: at most 64 characters (a client can send a megabyte of id).
pub(crate) fn shown_id(id: &str) -> String {
    match id.char_indices().nth(64) {
        Some((i, _)) => format!("{}…", &id[..i]),
        None => id.to_string(),
    }
}
