//! The checks a body goes through before the tokenizer sees it, without a server: the fuzz targets'
//! entry (`crates/fuzz`).

use crate::body::Endpoint;
use crate::config::ServerConfig;
use crate::error::ApiError;
use crate::handlers::parse;
use crate::validate::{self, ChatRequest, CompletionRequest};

/// What an endpoint checks in a body before the tokenizer sees it: JSON, request shape (the Responses
/// and Messages forms translated into a chat body), parameters and media URLs (data URLs decoded,
/// remote ones only if allow-listed), ending in the prompt it would send to the tokenizer. The fuzz
/// targets' entry (`crates/fuzz`).
pub fn check_body(endpoint: Endpoint, body: &[u8], cfg: &ServerConfig) -> Result<(), ApiError> {
    let body = crate::body::parse_json(body, crate::body::JsonLimits::for_context(cfg.context_len))?;
    let chat = match endpoint {
        Endpoint::Completions => return validate::completion(&parse::<CompletionRequest>(&body)?, cfg).map(drop),
        Endpoint::Chat => body,
        Endpoint::Responses => crate::responses::chat_body(&body, &crate::store::ResponseStore::new(0, 0))?,
        Endpoint::Messages => crate::messages::chat_body(&body)?,
    };
    validate::chat(&parse::<ChatRequest>(&chat)?, cfg).map(drop)
}
