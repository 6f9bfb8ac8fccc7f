//! What the backend asks of its device, counted (issue 51): kernel launches (in total and per kernel),
//! host waits, device allocations and frees, and bytes each way. [`Counted`] wraps either device layer
//! (the emulated one and cudarc's), so the counts are the calls a card would see, whatever runs them.
//!
//! A host wait is a call after which the host cannot go on before the device has caught up: a
//! [`DeviceLayer::synchronize`], a [`DeviceLayer::download`] (it returns the bytes), and a
//! [`DeviceLayer::free`] (the device layers free after a stream sync, so the work reading the memory is
//! done). An [`DeviceLayer::upload`] from pageable memory is staged by the driver and queued without
//! waiting for the device (CUDA's synchronization rules for `cuMemcpyHtoDAsync` from pageable memory),
//! so it is counted as an upload ([`DeviceCounts::uploads`]), not a wait; [`DeviceLayer::upload_async`],
//! [`DeviceLayer::wait_event`] and launches do not wait either.
//!
//! It also keeps the device's first fault (a launch, copy or allocation that failed other than for lack
//! of memory; on a GPU a kernel fault leaves the context unusable): from then on every call that could
//! touch device memory fails at once, naming that fault ([`Counted::fault`]), so the backend never panics
//! and the engine reports the fault at the step's next fallible op and stops (docs/reliability.md).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use osprey_backend::Flops;

use crate::device::{Arg, DevPtr, DeviceError, DeviceInfo, DeviceLayer, Event, GemmBf16, LaunchConfig};

/// The counts since start (or, from [`DeviceCounts::since`], over a stretch such as one decode step).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DeviceCounts {
    /// Kernel launches (cuBLAS GEMMs included, as `cublasGemmEx`).
    pub launches: u64,
    /// Launches per kernel name.
    pub kernels: BTreeMap<String, u64>,
    /// The arithmetic each kernel's launches declare (`crate::cost`), per kernel name.
    pub flops: BTreeMap<String, Flops>,
    /// Calls that block the host until the device has caught up (see the module docs).
    pub host_waits: u64,
    /// Small host → device copies from pageable memory ([`DeviceLayer::upload`]), each staged by the driver.
    pub uploads: u64,
    /// Device allocations.
    pub allocations: u64,
    /// Device frees.
    pub frees: u64,
    /// Bytes copied host → device.
    pub bytes_to_device: u64,
    /// Bytes copied device → host.
    pub bytes_from_device: u64,
}

impl DeviceCounts {
    /// What happened after `earlier` (a snapshot taken before).
    pub fn since(&self, earlier: &DeviceCounts) -> DeviceCounts {
        let kernels = self
            .kernels
            .iter()
            .map(|(k, &n)| (k.clone(), n - earlier.kernels.get(k).copied().unwrap_or(0)))
            .filter(|(_, n)| *n > 0)
            .collect();
        let flops = self
            .flops
            .iter()
            .map(|(k, &f)| (k.clone(), f.since(earlier.flops.get(k).copied().unwrap_or_default())))
            .filter(|(_, f)| *f != Flops::default())
            .collect();
        DeviceCounts {
            launches: self.launches - earlier.launches,
            kernels,
            flops,
            host_waits: self.host_waits - earlier.host_waits,
            uploads: self.uploads - earlier.uploads,
            allocations: self.allocations - earlier.allocations,
            frees: self.frees - earlier.frees,
            bytes_to_device: self.bytes_to_device - earlier.bytes_to_device,
            bytes_from_device: self.bytes_from_device - earlier.bytes_from_device,
        }
    }
}

/// A device layer whose every call is counted.
#[derive(Debug)]
pub struct Counted {
    inner: Arc<dyn DeviceLayer>,
    counts: Mutex<DeviceCounts>,
    /// The first fault: (the op, what went wrong).
    fault: Mutex<Option<(String, String)>>,
}

impl Counted {
    /// Counts the calls to `inner`.
    pub fn new(inner: Arc<dyn DeviceLayer>) -> Self {
        Counted { inner, counts: Mutex::new(DeviceCounts::default()), fault: Mutex::new(None) }
    }

    /// The first fault, as the seam reports it (`None`: the device is healthy).
    pub fn fault(&self) -> Option<osprey_backend::BackendError> {
        let f = self.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        f.as_ref().map(|(op, message)| osprey_backend::BackendError::Fault { op: op.clone(), message: message.clone() })
    }

    /// Whether the device has faulted (cheap: no error built).
    pub fn faulted(&self) -> bool {
        self.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner).is_some()
    }

    /// Records a fault of `op` (the first one stays: it is the cause, the rest follow from it).
    pub fn fail(&self, op: &str, message: impl std::fmt::Display) {
        let mut f = self.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if f.is_none() {
            // The engine logs it when it stops (the runner asks `Backend::health` after each step).
            *f = Some((op.to_string(), message.to_string()));
        }
    }

    /// Fails at once after a fault.
    fn healthy(&self) -> Result<(), DeviceError> {
        match &*self.fault.lock().unwrap_or_else(std::sync::PoisonError::into_inner) {
            None => Ok(()),
            Some((op, message)) => Err(DeviceError::Faulted(format!("an earlier fault in {op}: {message}"))),
        }
    }

    /// `r`, with a failure other than running out of memory (or a missing library) recorded as the
    /// device's fault.
    fn watch<T>(&self, op: &str, r: Result<T, DeviceError>) -> Result<T, DeviceError> {
        if let Err(e) = &r {
            if !matches!(e, DeviceError::OutOfMemory { .. } | DeviceError::Unavailable(_) | DeviceError::Faulted(_)) {
                self.fail(op, e);
            }
        }
        r
    }

    /// The counts so far.
    pub fn counts(&self) -> DeviceCounts {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, DeviceCounts> {
        self.counts.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn count(&self, f: impl FnOnce(&mut DeviceCounts)) {
        f(&mut self.lock());
    }

    fn launched(&self, name: &str, flops: Flops) {
        self.count(|c| {
            c.launches += 1;
            match c.kernels.get_mut(name) {
                Some(n) => *n += 1,
                None => {
                    c.kernels.insert(name.to_string(), 1);
                }
            }
            if flops != Flops::default() {
                match c.flops.get_mut(name) {
                    Some(f) => *f += flops,
                    None => {
                        c.flops.insert(name.to_string(), flops);
                    }
                }
            }
        });
    }
}

impl DeviceLayer for Counted {
    fn info(&self) -> DeviceInfo {
        self.inner.info()
    }

    fn free_memory(&self) -> usize {
        self.inner.free_memory()
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, DeviceError> {
        self.healthy()?;
        self.count(|c| c.allocations += 1);
        self.watch("allocation", self.inner.alloc(bytes))
    }

    fn free(&self, p: DevPtr) -> Result<(), DeviceError> {
        self.count(|c| (c.frees, c.host_waits) = (c.frees + 1, c.host_waits + 1));
        // Freed even after a fault (the memory is the process's); the sync before it may report one.
        self.watch("free", self.inner.free(p))
    }

    fn alloc_host(&self, bytes: usize) -> Result<osprey_backend::HostArena, DeviceError> {
        self.inner.alloc_host(bytes)
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.healthy()?;
        let n = src.len() as u64;
        self.count(|c| (c.bytes_to_device, c.uploads) = (c.bytes_to_device + n, c.uploads + 1));
        self.watch("upload", self.inner.upload(dst, src))
    }

    unsafe fn upload_async(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<Event, DeviceError> {
        self.healthy()?;
        self.count(|c| c.bytes_to_device += len as u64);
        // SAFETY: the caller's contract, passed on unchanged.
        self.watch("upload", unsafe { self.inner.upload_async(dst, src, len) })
    }

    fn wait_event(&self, e: Event) -> Result<(), DeviceError> {
        self.healthy()?;
        self.watch("waiting for a copy", self.inner.wait_event(e))
    }

    fn copies_after(&self, e: Event) -> Result<(), DeviceError> {
        self.healthy()?;
        self.watch("ordering a copy after compute", self.inner.copies_after(e))
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.healthy()?;
        let n = dst.len() as u64;
        self.count(|c| (c.bytes_from_device, c.host_waits) = (c.bytes_from_device + n, c.host_waits + 1));
        self.watch("download", self.inner.download(src, dst))
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.healthy()?;
        self.watch("device copy", self.inner.copy(dst, src, bytes))
    }

    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.healthy()?;
        self.watch("memset", self.inner.zero(dst, bytes))
    }

    fn gemm_bf16(&self, g: GemmBf16) -> Result<(), DeviceError> {
        self.healthy()?;
        let r = self.inner.gemm_bf16(g);
        if r.is_ok() {
            self.launched("cublasGemmEx", Flops { bf16: 2 * (g.m * g.n * g.k) as u64, ..Flops::default() });
        }
        // No cuBLAS is not a fault (`Unavailable`): the backend falls back to its kernels.
        self.watch("cublasGemmEx", r)
    }

    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), DeviceError> {
        self.healthy()?;
        self.launched(name, crate::cost::declared_flops(name, &cfg, args));
        self.watch(name, self.inner.launch(name, cfg, args))
    }

    fn record(&self) -> Result<Event, DeviceError> {
        self.healthy()?;
        self.watch("recording an event", self.inner.record())
    }

    fn is_complete(&self, e: Event) -> bool {
        self.inner.is_complete(e)
    }

    fn synchronize(&self, e: Event) -> Result<(), DeviceError> {
        self.healthy()?;
        self.count(|c| c.host_waits += 1);
        self.watch("synchronize", self.inner.synchronize(e))
    }

    fn traffic(&self) -> Option<crate::Traffic> {
        self.inner.traffic()
    }
}
