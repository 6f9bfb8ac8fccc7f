//! # osprey-protocol — every message between actors
//!
//! Brief overview: ids, requests, plans and events exchanged by the HTTP server, tokenizer, vision encoder,
//! scheduler and runner. One module per destination actor; no logic beyond constructors. Requests that
//! expect an answer carry a `oneshot` reply sender; streams of events go through unbounded channels whose
//! closure means the other side left (cancellation is channel closure). One rule about replies lives here too
//! ([`inbox::wait_closed`]): a reply dropped unanswered is reported only once the actor's inbox is closed.
#![deny(missing_docs)]

pub mod constraint;
pub mod error;
pub mod experts;
pub mod inbox;
pub mod prefix;
pub mod runner;
pub mod sampling;
pub mod scheduler;
pub mod tokenizer;
pub mod vision;

pub use error::{ErrorCode, RequestError};

use std::sync::Arc;

/// Engine-owned data that other actors hold without looking inside: a KV page, a recurrent-state
/// snapshot, a leased expert. Only the actor that made it downcasts it (through `&dyn Any`); the others
/// see its size. This keeps model types out of the messages, so the HTTP side never compiles model code.
pub trait Opaque: std::any::Any + Send + Sync + std::fmt::Debug {
    /// Bytes held (what a cache charges for it).
    fn bytes(&self) -> usize;
}

/// A shared handle to [`Opaque`] data; the data lives until the last handle drops.
pub type Handle = Arc<dyn Opaque>;

/// The data behind `h` when it is a `T` (how the owning actor gets its own data back).
pub fn downcast<T: Opaque>(h: &Handle) -> Option<&T> {
    let any: &dyn std::any::Any = h.as_ref();
    any.downcast_ref::<T>()
}

/// A sequence (one generation request) inside the engine.
pub type SeqId = u64;

/// 128-bit content hash of a media item (BLAKE3 of its bytes).
pub type MediaHash = [u8; 16];
