//! Device memory for tensors, recycled (issue 51, item 2, in part): a tensor's buffer, when dropped, goes
//! back to a cache by exact size instead of to the driver, and the next tensor of that size takes it. A
//! decode step allocates the same shapes every token, so in steady state it makes no device allocation
//! and no free (each of which, through the driver, waits for the stream). Reuse is safe because every
//! kernel runs on the one compute stream, in order: a buffer's last reader is queued before its next
//! writer. Exact sizes keep the emulated device's bounds checks exact. The cache holds at most
//! `cap` bytes (a buffer that would pass it is freed), gives everything back when an allocation runs out
//! of memory (then retries), and frees it all when the backend goes.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use crate::counted::Counted;
use crate::device::{DevPtr, DeviceError, DeviceLayer as _};

/// Bytes of recycled buffers kept at most by default (256 MiB, within the memory plan's reserve: a
/// 512-token prefill step of Qwen3.5-35B-A3B holds well under it at once).
pub const BUF_CACHE: usize = 256 << 20;

/// Device memory a tensor owns; back to its cache when dropped.
#[derive(Debug)]
pub struct Buf {
    pub(super) ptr: DevPtr,
    pub(super) bytes: usize,
    pub(super) cache: Arc<BufCache>,
}

impl Drop for Buf {
    fn drop(&mut self) {
        self.cache.give(self.ptr, self.bytes);
    }
}

/// Buffers given back, by size.
#[derive(Debug)]
pub struct BufCache {
    pub(super) dev: Arc<Counted>,
    free: Mutex<(HashMap<usize, Vec<DevPtr>>, usize)>,
    cap: usize,
}

impl BufCache {
    /// A cache of at most `cap` bytes over `dev`.
    pub fn new(dev: Arc<Counted>, cap: usize) -> Self {
        BufCache { dev, free: Mutex::new((HashMap::new(), 0)), cap }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (HashMap<usize, Vec<DevPtr>>, usize)> {
        self.free.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// A buffer of exactly `bytes`: a recycled one, else a fresh allocation (after giving the cache back
    /// to the device if the device is out of memory).
    pub fn take(self: &Arc<Self>, bytes: usize) -> Result<Buf, DeviceError> {
        let recycled = {
            let mut f = self.lock();
            let p = f.0.get_mut(&bytes).and_then(Vec::pop);
            if p.is_some() {
                f.1 -= bytes;
            }
            p
        };
        let ptr = match recycled {
            Some(p) => p,
            None => match self.dev.alloc(bytes) {
                Err(DeviceError::OutOfMemory { .. }) if self.trim() > 0 => self.dev.alloc(bytes)?,
                r => r?,
            },
        };
        Ok(Buf { ptr, bytes, cache: self.clone() })
    }

    /// Takes back a buffer: kept for the next tensor of its size while the cache holds under `cap` (and
    /// the device is healthy), else freed.
    fn give(&self, ptr: DevPtr, bytes: usize) {
        if ptr.0 == 0 {
            return; // a failed copy's empty buffer (`CudaStorage::clone_storage`)
        }
        {
            let mut f = self.lock();
            if f.1 + bytes <= self.cap && !self.dev.faulted() {
                // Kept by address, the lowest taken first: a step that takes and gives its buffers in the
                // same order as the step before gets the same addresses (a graph replays it with no node
                // updated for an address), whatever order the buffers came back in before it.
                let same = f.0.entry(bytes).or_default();
                let at = same.partition_point(|p| p.0 > ptr.0);
                same.insert(at, ptr);
                f.1 += bytes;
                return;
            }
        }
        // A failure is the device's fault, which `Counted` keeps (a drop cannot report it).
        let _ = self.dev.free(ptr);
    }

    /// Frees every cached buffer; returns the bytes given back.
    pub fn trim(&self) -> usize {
        let (held, bytes) = {
            let mut f = self.lock();
            (std::mem::take(&mut f.0), std::mem::take(&mut f.1))
        };
        for p in held.into_values().flatten() {
            let _ = self.dev.free(p);
        }
        bytes
    }
}

impl Drop for BufCache {
    fn drop(&mut self) {
        self.trim();
    }
}
