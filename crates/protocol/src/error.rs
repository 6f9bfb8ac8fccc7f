//! Errors that travel between actors and end up in an OpenAI error envelope.

/// Stable, machine-readable error codes (the `code` field of the OpenAI error object).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ErrorCode {
    /// Malformed or inconsistent request fields.
    InvalidRequest,
    /// The body is not valid JSON or not the expected shape.
    InvalidJson,
    /// A message role the chat template does not accept.
    InvalidRole,
    /// A media URL or payload that cannot be used (bad data URL, bad base64, unsupported format, corrupt).
    InvalidMedia,
    /// A remote or local media URL that is not allow-listed.
    MediaUrlNotAllowed,
    /// Decoded media bytes, pixels or frames over a limit.
    MediaTooLarge,
    /// More media items than allowed in one request.
    TooManyMedia,
    /// Image or video content sent to a text-only model.
    VisionUnsupported,
    /// Prompt (plus max_tokens) longer than the context or the KV capacity.
    ContextLengthExceeded,
    /// A field we deliberately do not support (e.g. `response_format`, `n > 1`).
    UnsupportedParameter,
    /// Missing or wrong API key.
    InvalidApiKey,
    /// The requested model id is not served.
    ModelNotFound,
    /// The engine failed while running the request (e.g. an I/O error reading experts).
    EngineError,
    /// The engine is shutting down or an actor is gone.
    Unavailable,
    /// No such endpoint.
    NotFound,
    /// The endpoint exists but not with this HTTP method.
    MethodNotAllowed,
    /// The request body is over the size limit.
    RequestTooLarge,
    /// The body is not `application/json`.
    UnsupportedMediaType,
    /// The `Host` header names a host this server does not answer for (DNS rebinding).
    HostNotAllowed,
    /// A cross-origin request from an origin that is not allow-listed.
    OriginNotAllowed,
    /// The queue is full, or the request waited in it too long: retry later.
    Overloaded,
    /// The request body did not arrive in time.
    RequestTimeout,
    /// The request's deadline passed before its first token.
    DeadlineExceeded,
    /// A JSON Schema (response format or tool parameters) that cannot be enforced.
    InvalidSchema,
    /// `previous_response_id` names a response the store does not hold.
    ResponseNotFound,
    /// The compute device had no memory left for this request (it fails; the next one is served).
    OutOfMemory,
}

impl ErrorCode {
    /// The `code` string of the error envelope.
    pub fn as_str(self) -> &'static str {
        match self {
            ErrorCode::InvalidRequest => "invalid_request",
            ErrorCode::InvalidJson => "invalid_json",
            ErrorCode::InvalidRole => "invalid_role",
            ErrorCode::InvalidMedia => "invalid_media",
            ErrorCode::MediaUrlNotAllowed => "media_url_not_allowed",
            ErrorCode::MediaTooLarge => "media_too_large",
            ErrorCode::TooManyMedia => "too_many_media",
            ErrorCode::VisionUnsupported => "vision_unsupported",
            ErrorCode::ContextLengthExceeded => "context_length_exceeded",
            ErrorCode::UnsupportedParameter => "unsupported_parameter",
            ErrorCode::InvalidApiKey => "invalid_api_key",
            ErrorCode::ModelNotFound => "model_not_found",
            ErrorCode::EngineError => "engine_error",
            ErrorCode::Unavailable => "unavailable",
            ErrorCode::NotFound => "not_found",
            ErrorCode::MethodNotAllowed => "method_not_allowed",
            ErrorCode::RequestTooLarge => "request_too_large",
            ErrorCode::UnsupportedMediaType => "unsupported_media_type",
            ErrorCode::HostNotAllowed => "host_not_allowed",
            ErrorCode::OutOfMemory => "out_of_memory",
            ErrorCode::OriginNotAllowed => "origin_not_allowed",
            ErrorCode::Overloaded => "overloaded",
            ErrorCode::RequestTimeout => "request_timeout",
            ErrorCode::DeadlineExceeded => "deadline_exceeded",
            ErrorCode::InvalidSchema => "invalid_schema",
            ErrorCode::ResponseNotFound => "response_not_found",
        }
    }
}

/// An error with its code, a human message and the offending parameter when known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RequestError {
    /// Stable code.
    pub code: ErrorCode,
    /// What went wrong, for humans.
    pub message: String,
    /// The request field at fault (`messages[1].content[0].image_url`, `max_tokens`, ...).
    pub param: Option<String>,
}

impl RequestError {
    /// An error without a parameter.
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        RequestError { code, message: message.into(), param: None }
    }

    /// Names the parameter at fault.
    pub fn with_param(mut self, param: impl Into<String>) -> Self {
        self.param = Some(param.into());
        self
    }
}

impl std::fmt::Display for RequestError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.code.as_str(), self.message)
    }
}

impl std::error::Error for RequestError {}
