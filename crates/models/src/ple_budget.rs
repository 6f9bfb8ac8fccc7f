//! The RAM budget of `qwen4_exp`'s PLE row caches, a load option ([`crate::LoadOptions::ple_budget`]),
//! and the caches' counters. Its own module, outside the family's directory, because `LoadOptions` names
//! it: the family depends on the load options, not the other way round.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// PLE row-cache counters, summed over every PLE layer of the loaded model.
#[derive(Debug, Default)]
pub struct PleStats {
    /// Rows served from the cache.
    pub hits: AtomicU64,
    /// Rows read from the table.
    pub misses: AtomicU64,
    /// Bytes read from the table.
    pub bytes_read: AtomicU64,
    /// Bytes of rows held in the caches.
    pub resident_bytes: AtomicU64,
    /// Bytes of the tables on disk (0: no PLE model loaded).
    pub table_bytes: AtomicU64,
    /// Bytes the tables would take in RAM as cached rows (f32): what a budget fraction is of.
    pub table_row_bytes: AtomicU64,
}

/// [`PleStats`] read at one moment.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PleCounts {
    /// Rows served from the cache.
    pub hits: u64,
    /// Rows read from the table.
    pub misses: u64,
    /// Bytes read from the table.
    pub bytes_read: u64,
    /// Bytes of rows held in the caches.
    pub resident_bytes: u64,
    /// Bytes of the tables on disk.
    pub table_bytes: u64,
    /// Bytes the tables would take in RAM as cached rows (f32).
    pub table_row_bytes: u64,
}

impl PleStats {
    /// The counters now.
    pub fn counts(&self) -> PleCounts {
        PleCounts {
            hits: self.hits.load(Relaxed),
            misses: self.misses.load(Relaxed),
            bytes_read: self.bytes_read.load(Relaxed),
            resident_bytes: self.resident_bytes.load(Relaxed),
            table_bytes: self.table_bytes.load(Relaxed),
            table_row_bytes: self.table_row_bytes.load(Relaxed),
        }
    }
}

/// Default RAM budget for cached PLE rows, all layers together.
pub const DEFAULT_PLE_RAM_BYTES: u64 = 1 << 30;

/// The RAM budget of a model's PLE row caches, all its layers together (a load option), and what the
/// caches did with it. Clones share both: the model's tables follow a change at their next lookup
/// (shrinking evicts their least recently used rows), and the caller reads the counters live.
#[derive(Clone, Debug)]
pub struct PleBudget {
    bytes: Arc<AtomicU64>,
    stats: Arc<PleStats>,
}

impl PleBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Self {
        PleBudget { bytes: Arc::new(AtomicU64::new(bytes)), stats: Arc::default() }
    }

    /// Changes it.
    pub fn set(&self, bytes: u64) {
        self.bytes.store(bytes, Relaxed);
    }

    /// Bytes.
    pub fn get(&self) -> u64 {
        self.bytes.load(Relaxed)
    }

    /// The caches' counters now (zero until a model with PLE layers loads with this budget).
    pub fn counts(&self) -> PleCounts {
        self.stats.counts()
    }

    /// The shared counters the model's tables add to.
    pub(crate) fn stats(&self) -> Arc<PleStats> {
        self.stats.clone()
    }
}

impl Default for PleBudget {
    fn default() -> Self {
        PleBudget::new(DEFAULT_PLE_RAM_BYTES)
    }
}
