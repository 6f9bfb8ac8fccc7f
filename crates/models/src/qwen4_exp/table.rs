//! A PLE layer's n-gram table, read a row at a time from the mapped checkpoint and kept in an LRU row
//! cache under a RAM budget. The real table is tens of GB (ngram_vocab_size_base 20 M rows per head), so
//! it is never resident in full: a row costs one read of `cols` values from the page cache or the disk.
//!
//! Layouts: one `ngram_embedding.weight` tensor, or the Hub's shards `ngram_embedding.shard_{i}.weight`
//! concatenated in order; dtypes f32 / bf16 / f16, or FP8 E4M3 as ModelOpt writes it (`weight` F8_E4M3
//! with `weight_scale` F32, one per tensor or one per row).
//!
//! Counters are the model's own ([`PleStats`], summed over its PLE layers; `CausalLm::family_stats`
//! reports them, and the runner passes them on to `/metrics`). The budget is a load option ([`PleBudget`] in
//! `LoadOptions`), shared by the model's PLE layers and followed at each lookup, so whoever loaded the
//! model may change it while it runs.

use std::num::NonZeroUsize;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::{Arc, Mutex};

use lru::LruCache;
use osprey_kernels::nvfp4::e4m3_to_f32;
use safetensors::Dtype;

use crate::checkpoint::{Checkpoint, MappedTensor};
use crate::error::{Error, Result};

pub use crate::ple_budget::{PleBudget, PleCounts, PleStats, DEFAULT_PLE_RAM_BYTES};

/// One part of the table: `rows` rows of a mapped tensor, with its scale for FP8.
#[derive(Debug)]
struct Part {
    t: MappedTensor,
    first_row: usize,
    rows: usize,
    /// FP8 scales: one for the whole part, or one per row.
    scales: Option<Vec<f32>>,
}

#[derive(Debug)]
pub(crate) struct PleTable {
    parts: Vec<Part>,
    cols: usize,
    cache: Mutex<LruCache<u32, Arc<[f32]>>>,
    /// PLE layers sharing the budget.
    layers: usize,
    budget: PleBudget,
    /// The model's counters.
    stats: Arc<PleStats>,
}

fn scales(ck: &Checkpoint, name: &str, rows: usize) -> Result<Vec<f32>> {
    let s = ck.mapped(name)?;
    let n = s.shape.iter().product::<usize>();
    if s.dtype != Dtype::F32 || (n != 1 && n != rows) {
        return Err(Error::Unsupported(format!("{name}: {:?} {:?} (an F32 scalar or one per row)", s.dtype, s.shape)));
    }
    Ok(s.bytes(0, 4 * n).chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect())
}

impl PleTable {
    /// The table `{prefix}.ngram_embedding` of `rows` rows of `cols` values, and this layer's share
    /// `1 / layers` of `budget`.
    pub(crate) fn open(
        ck: &Checkpoint,
        prefix: &str,
        (rows, cols): (usize, usize),
        layers: usize,
        (budget, stats): (&PleBudget, &Arc<PleStats>),
    ) -> Result<Self> {
        let one = format!("{prefix}.ngram_embedding");
        let names: Vec<String> = if ck.contains(&format!("{one}.weight")) {
            vec![one]
        } else {
            (0..).map(|i| format!("{one}.shard_{i}")).take_while(|n| ck.contains(&format!("{n}.weight"))).collect()
        };
        let mut parts = Vec::with_capacity(names.len());
        let mut first_row = 0;
        let mut disk = 0u64;
        for n in &names {
            let t = ck.mapped(&format!("{n}.weight"))?;
            let [r, c] = t.shape[..] else {
                return Err(Error::Unsupported(format!("{n}.weight has shape {:?}", t.shape)));
            };
            if c != cols {
                return Err(Error::Unsupported(format!("{n}.weight has {c} columns, the heads need {cols}")));
            }
            let scales = match t.dtype {
                Dtype::F32 | Dtype::BF16 | Dtype::F16 => None,
                Dtype::F8_E4M3 => Some(scales(ck, &format!("{n}.weight_scale"), r)?),
                other => return Err(Error::Unsupported(format!("{n}.weight in {other:?}"))),
            };
            disk += (r * c * t.dtype.bitsize() / 8) as u64;
            parts.push(Part { t, first_row, rows: r, scales });
            first_row += r;
        }
        if first_row != rows {
            return Err(Error::InvalidInput(format!(
                "{prefix}.ngram_embedding: {first_row} rows, the hash needs {rows}"
            )));
        }
        stats.table_bytes.fetch_add(disk, Relaxed);
        stats.table_row_bytes.fetch_add((rows * cols * 4) as u64, Relaxed);
        let cache = LruCache::new(NonZeroUsize::MIN);
        let (budget, stats) = (budget.clone(), stats.clone());
        Ok(PleTable { parts, cols, cache: Mutex::new(cache), layers: layers.max(1), budget, stats })
    }

    /// This table's row capacity under the current budget.
    fn capacity(&self) -> usize {
        (self.budget.get() / self.layers as u64 / (4 * self.cols) as u64) as usize
    }

    /// Row `r` decoded from the table.
    fn read(&self, r: usize) -> Vec<f32> {
        let p = &self.parts[self.parts.partition_point(|p| p.first_row + p.rows <= r)];
        let (i, c) = (r - p.first_row, self.cols);
        let size = p.t.dtype.bitsize() / 8;
        let raw = p.t.bytes(i * c * size, c * size);
        self.stats.bytes_read.fetch_add(raw.len() as u64, Relaxed);
        match (p.t.dtype, &p.scales) {
            (Dtype::F32, _) => raw.chunks_exact(4).map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]])).collect(),
            (Dtype::BF16, _) => raw.chunks_exact(2).map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            (Dtype::F16, _) => raw.chunks_exact(2).map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32()).collect(),
            (_, Some(s)) => {
                let scale = if s.len() == 1 { s[0] } else { s[i] };
                raw.iter().map(|&b| e4m3_to_f32(b) * scale).collect()
            }
            _ => unreachable!("checked at open"),
        }
    }

    /// The rows `ids` concatenated, `[ids.len() · cols]`.
    pub(crate) fn rows(&self, ids: &[u32]) -> Vec<f32> {
        let mut out = Vec::with_capacity(ids.len() * self.cols);
        let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let capacity = self.capacity();
        let row_bytes = (4 * self.cols) as u64;
        let before = cache.len();
        match NonZeroUsize::new(capacity) {
            // No budget: nothing stays, not even the one row an LRU of capacity one would keep.
            None => cache.clear(),
            Some(cap) if cap != cache.cap() => cache.resize(cap),
            Some(_) => {}
        }
        self.stats.resident_bytes.fetch_sub((before - cache.len()) as u64 * row_bytes, Relaxed);
        for &id in ids {
            if let Some(row) = cache.get(&id) {
                self.stats.hits.fetch_add(1, Relaxed);
                out.extend_from_slice(row);
                continue;
            }
            self.stats.misses.fetch_add(1, Relaxed);
            let row: Arc<[f32]> = self.read(id as usize).into();
            out.extend_from_slice(&row);
            if capacity > 0 && cache.push(id, row).is_none() {
                self.stats.resident_bytes.fetch_add(row_bytes, Relaxed);
            }
        }
        out
    }

    /// Columns of a row.
    pub(crate) fn cols(&self) -> usize {
        self.cols
    }
}

impl Drop for PleTable {
    fn drop(&mut self) {
        // The counters may outlive the table (a caller holding the model's stats): its rows leave RAM.
        let held = self.cache.get_mut().map(|c| c.len()).unwrap_or(0) as u64 * (4 * self.cols) as u64;
        self.stats.resident_bytes.fetch_sub(held.min(self.stats.resident_bytes.load(Relaxed)), Relaxed);
    }
}
