//! # osprey-vision — the vision encoder actor
//!
//! Brief overview: owns the vision tower and the encoder-output cache (LRU by bytes, keyed by the media
//! content hash), on its own thread. Accepts [`VisionCommand`]s: `Encode` returns the item's rows
//! `[tokens, hidden]` (shared `Arc`, so a request keeps its rows alive until its prefill ends even if the
//! cache evicts them), `Stats` returns hit/miss counters. Repeated images are encoded once.

use std::sync::Arc;
use std::thread;

use lru::LruCache;
use osprey_models::vision::VisionTower;
use osprey_protocol::vision::{VisionCommand, VisionStats};
use osprey_protocol::{ErrorCode, MediaHash, RequestError};
use tokio::sync::{mpsc, oneshot};

/// LRU cache of encoder outputs, bounded by bytes (the `lru` crate keeps the recency order).
#[derive(Debug)]
pub struct EncoderCache {
    map: LruCache<MediaHash, Arc<Vec<f32>>>,
    bytes: usize,
    capacity: usize,
    stats: VisionStats,
}

impl EncoderCache {
    /// A cache holding at most `capacity` bytes of rows.
    pub fn new(capacity: usize) -> Self {
        EncoderCache { map: LruCache::unbounded(), bytes: 0, capacity, stats: VisionStats::default() }
    }

    /// The rows of `hash`, computing and inserting them with `encode` on a miss.
    pub fn get_or_encode(
        &mut self,
        hash: MediaHash,
        encode: impl FnOnce() -> Result<Vec<f32>, RequestError>,
    ) -> Result<Arc<Vec<f32>>, RequestError> {
        if let Some(rows) = self.map.get(&hash) {
            self.stats.hits += 1;
            return Ok(rows.clone());
        }
        self.stats.misses += 1;
        let rows = Arc::new(encode()?);
        let size = rows.len() * 4;
        while self.bytes + size > self.capacity {
            let Some((_, r)) = self.map.pop_lru() else { break };
            self.bytes -= r.len() * 4;
        }
        if size <= self.capacity {
            self.map.put(hash, rows.clone());
            self.bytes += size;
        }
        Ok(rows)
    }

    /// Counters.
    pub fn stats(&self) -> VisionStats {
        VisionStats { cached_bytes: self.bytes as u64, ..self.stats }
    }
}

/// Cloneable handle to the vision actor.
#[derive(Clone, Debug)]
pub struct VisionHandle {
    tx: mpsc::UnboundedSender<VisionCommand>,
}

impl VisionHandle {
    /// Sends a command; `false` when the actor is gone.
    pub fn send(&self, cmd: VisionCommand) -> bool {
        self.tx.send(cmd).is_ok()
    }

    /// The actor's inbox, for actors that talk to it through `osprey-protocol` messages only.
    pub fn sender(&self) -> mpsc::UnboundedSender<VisionCommand> {
        self.tx.clone()
    }

    /// Encodes from a non-async thread (the runner), waiting for the rows.
    pub fn encode_blocking(
        &self,
        hash: MediaHash,
        patches: Arc<osprey_protocol::vision::Pixels>,
    ) -> Result<Arc<Vec<f32>>, RequestError> {
        let gone = || RequestError::new(ErrorCode::Unavailable, "the vision encoder is gone");
        let (reply, rx) = oneshot::channel();
        if !self.send(VisionCommand::Encode { hash, patches, span: tracing::Span::current(), reply }) {
            return Err(gone());
        }
        rx.blocking_recv().map_err(|_| gone())?
    }
}

/// Starts the vision thread.
pub fn spawn(tower: VisionTower, cache_bytes: usize) -> VisionHandle {
    let (tx, mut rx) = mpsc::unbounded_channel::<VisionCommand>();
    thread::Builder::new()
        .name("osprey-vision".into())
        .spawn(move || {
            let mut cache = EncoderCache::new(cache_bytes);
            while let Some(cmd) = rx.blocking_recv() {
                match cmd {
                    VisionCommand::Encode { hash, patches, span, reply } => {
                        let _in = span.enter();
                        let before = cache.stats().hits;
                        let out = cache.get_or_encode(hash, || {
                            let p = patches.get()?;
                            tower.encode(&p.rows, p.grid).map_err(|e| {
                                // Out of device memory fails this request (503), as the runner's steps do.
                                let code =
                                    if e.is_out_of_memory() { ErrorCode::OutOfMemory } else { ErrorCode::EngineError };
                                RequestError::new(code, e.to_string())
                            })
                        });
                        let hit = cache.stats().hits > before;
                        tracing::debug!(hit, grid = ?patches.grid(), ok = out.is_ok(), "vision rows");
                        let _ = reply.send(out);
                    }
                    VisionCommand::Stats { reply } => {
                        let _ = reply.send(cache.stats());
                    }
                }
            }
        })
        .expect("spawn vision thread");
    VisionHandle { tx }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cache_hits_and_evicts_least_recently_used_by_bytes() {
        let mut c = EncoderCache::new(64); // 16 floats
        let enc = |v: f32| move || Ok(vec![v; 8]);
        c.get_or_encode([1; 16], enc(1.0)).expect("a");
        c.get_or_encode([2; 16], enc(2.0)).expect("b");
        assert_eq!(
            c.get_or_encode([1; 16], || Err(RequestError::new(ErrorCode::EngineError, "must hit"))).expect("hit")[0],
            1.0
        );
        c.get_or_encode([3; 16], enc(3.0)).expect("c evicts b, the least recently used");
        assert!(c.get_or_encode([2; 16], || Err(RequestError::new(ErrorCode::EngineError, "miss"))).is_err());
        assert_eq!(c.stats().hits, 1);
        assert_eq!(c.stats().cached_bytes, 64);
    }
}
