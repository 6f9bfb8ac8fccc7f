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
}

/// Reads and parses the JSON body of `req`.
pub async fn read_json(req: &HttpRequest, mut payload: web::Payload, lim: BodyLimits) -> Result<Value, ApiError> {
    let ct = req.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    let essence = ct.split(';').next().unwrap_or("").trim();
    if !essence.eq_ignore_ascii_case("application/json") {
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
    parse_json(&body)
}

/// Parses a body's bytes as JSON.
pub fn parse_json(body: &[u8]) -> Result<Value, ApiError> {
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(ErrorCode::InvalidJson, format!("could not parse the request body: {e}")))
}
