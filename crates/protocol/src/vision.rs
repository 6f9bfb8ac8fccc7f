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

/// Makes an item's pixel rows again from its bytes (the tokenizer's decoder and processor).
pub type MakePixels = Box<dyn Fn() -> Result<Arc<PixelPatches>, RequestError> + Send + Sync>;

/// A media item's pixel rows, present or made on first need. A conversation resends every earlier
/// image each turn, and the prefix cache holds their rows' keys and values, so the tower never reads
/// their pixels: an item the tokenizer has seen before (its grid known) but whose rows it no longer
/// keeps is decoded only if the vision encoder asks for it (issue 53: 255 resent images were decoded
/// and resized on every turn of a 58k-token conversation).
pub struct Pixels {
    grid: [usize; 3],
    made: std::sync::OnceLock<Arc<PixelPatches>>,
    make: Option<MakePixels>,
}

impl Pixels {
    /// Rows at hand.
    pub fn ready(p: Arc<PixelPatches>) -> Self {
        let grid = p.grid;
        Pixels { grid, made: std::sync::OnceLock::from(p), make: None }
    }

    /// Rows of grid `grid` that `make` makes when first asked for.
    pub fn deferred(grid: [usize; 3], make: MakePixels) -> Self {
        Pixels { grid, made: std::sync::OnceLock::new(), make: Some(make) }
    }

    /// `[t, h, w]` in patches.
    pub fn grid(&self) -> [usize; 3] {
        self.grid
    }

    /// The rows if they are made (a deferred item's, once asked for).
    pub fn made(&self) -> Option<&Arc<PixelPatches>> {
        self.made.get()
    }

    /// The rows, made now if deferred; a made grid that is not the promised one is an error (the
    /// positions and spans were laid out for the promised grid).
    pub fn get(&self) -> Result<Arc<PixelPatches>, RequestError> {
        if let Some(p) = self.made.get() {
            return Ok(p.clone());
        }
        let Some(make) = &self.make else {
            return Err(RequestError::new(
                crate::ErrorCode::EngineError,
                "pixel rows neither made nor makeable: a bug",
            ));
        };
        let p = make()?;
        if p.grid != self.grid {
            return Err(RequestError::new(
                crate::ErrorCode::EngineError,
                format!(
                    "a media item decoded to grid {:?}, not the {:?} its prompt was laid out for",
                    p.grid, self.grid
                ),
            ));
        }
        Ok(self.made.get_or_init(|| p).clone())
    }
}

impl std::fmt::Debug for Pixels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pixels").field("grid", &self.grid).field("made", &self.made.get().is_some()).finish()
    }
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
        /// Pixel rows and grid (made here if deferred and not cached).
        patches: Arc<Pixels>,
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
