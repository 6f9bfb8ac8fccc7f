//! Messages to the vision encoder actor.

use std::sync::Arc;

use tokio::sync::oneshot;

use crate::{MediaHash, RequestError};

/// Patch rows of one image or video and its grid, as the processor made them (plain data).
#[derive(Clone, Debug, PartialEq)]
pub struct PixelPatches {
    /// `[t·h·w, C·T·P·P]` in merge-block-major order.
    pub rows: Vec<f32>,
    /// `[t, h, w]` in patches (`t` in temporal patches).
    pub grid: [usize; 3],
}

/// Encoder cache counters.
#[derive(Clone, Copy, Debug, Default)]
pub struct VisionStats {
    /// Encodes served from the cache.
    pub hits: u64,
    /// Encodes computed.
    pub misses: u64,
    /// Bytes held by the cache.
    pub cached_bytes: u64,
}

/// Commands of the vision actor.
#[derive(Debug)]
pub enum VisionCommand {
    /// Vision rows `[tokens, hidden]` of one media item (from the cache when the hash is known).
    Encode {
        /// Content hash.
        hash: MediaHash,
        /// Pixel rows and grid.
        patches: Arc<PixelPatches>,
        /// The span of the request that needs the rows.
        span: tracing::Span,
        /// The rows, or why not (a typed error that reaches the client as is).
        reply: oneshot::Sender<Result<Arc<Vec<f32>>, RequestError>>,
    },
    /// Cache counters.
    Stats {
        /// Counters.
        reply: oneshot::Sender<VisionStats>,
    },
}
