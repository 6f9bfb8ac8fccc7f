//! Failures as the request sees them: the model's, the backend's, the KV pool's and the grammar's.

use osprey_models::ReserveError;
use osprey_protocol::constraint::GrammarError;
use osprey_protocol::{ErrorCode, RequestError};

/// An engine failure (500 `engine_error`) with its message.
pub(crate) fn engine_error(e: impl std::fmt::Display) -> RequestError {
    RequestError::new(ErrorCode::EngineError, e.to_string())
}

/// A model error as the request sees it: the device running out of memory is 503 `out_of_memory` (this
/// request fails, the engine goes on), anything else an engine error.
pub(crate) fn model_error(e: osprey_models::Error) -> RequestError {
    if e.is_out_of_memory() {
        RequestError::new(ErrorCode::OutOfMemory, e.to_string())
    } else {
        engine_error(e)
    }
}

/// A KV page reservation that failed, as the request sees it.
pub(crate) fn reserve_error(e: ReserveError) -> RequestError {
    match e {
        // The scheduler plans by the pool's free pages (and `generate`'s pool is unbounded), so this is
        // never reached when it is right.
        ReserveError::Full(st) => {
            engine_error(format!("KV pool exhausted ({} of {} pages free): this is a bug", st.free, st.total))
        }
        ReserveError::Backend(e) => backend_error(e),
    }
}

pub(crate) fn backend_error(e: osprey_models::backend::BackendError) -> RequestError {
    match e {
        osprey_models::backend::BackendError::OutOfMemory { .. } => {
            RequestError::new(ErrorCode::OutOfMemory, e.to_string())
        }
        other => engine_error(other),
    }
}

/// A grammar engine's failure as the client sees it: its first line only (the engine appends its
/// parser state, logged here at debug level instead).
pub(crate) fn grammar_error(e: &GrammarError) -> RequestError {
    tracing::debug!(error = %e, "grammar failed");
    let line: String = e.0.lines().next().unwrap_or("").chars().take(200).collect();
    engine_error(format!("grammar: {line}"))
}
