//! # osprey-protocol — every message between actors
//!
//! Brief overview: ids, requests, plans and events exchanged by the HTTP server, tokenizer, vision encoder,
//! scheduler and runner. One module per destination actor; no logic beyond constructors. Requests that
//! expect an answer carry a `oneshot` reply sender; streams of events go through unbounded channels whose
//! closure means the other side left (cancellation is channel closure).
#![deny(missing_docs)]

pub mod error;
pub mod experts;
pub mod prefix;
pub mod runner;
pub mod scheduler;
pub mod tokenizer;
pub mod vision;

pub use error::{ErrorCode, RequestError};

/// A sequence (one generation request) inside the engine.
pub type SeqId = u64;

/// 128-bit content hash of a media item (blake2b of its bytes).
pub type MediaHash = [u8; 16];
