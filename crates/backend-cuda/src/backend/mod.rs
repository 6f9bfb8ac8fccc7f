//! The CUDA backend over a [`DeviceLayer`]: tensors are device allocations, placed weights are uploaded
//! once (NVFP4 as its packed codes, scales and global scale), and every op launches kernels from
//! `kernels/`. One code path for the real device and the emulated one. One file per group of the seam's
//! table, as in the CPU backend.
//!
//! Every op of the seam has a kernel. The kernels are parity-first (f32 activations and accumulation,
//! simple tilings); the fast paths come next, checked against these.

mod attention;
mod bufs;
mod core;
mod experts;
mod memory;
mod q8;
mod qwen4;
mod recurrent;
mod sample;

use std::sync::Arc;

use osprey_backend::{Backend, BackendError, DType, Device, DeviceStats, Op, Result, Storage, Tensor};

use crate::counted::{Counted, DeviceCounts};
use crate::device::{DevPtr, DeviceError, DeviceInfo, DeviceLayer, LaunchConfig};
use crate::graph::Graphed;
use crate::launch::Call;
pub use bufs::BUF_CACHE;
use bufs::{Buf, BufCache};

/// A weight on the device: its elements (f32, bf16, f16, or NVFP4 codes with their e4m3 scales and
/// global scale).
#[derive(Debug)]
pub struct Placed {
    data: Buf,
    scales: Option<Buf>,
    global: f32,
}

/// What a CUDA tensor holds.
#[derive(Debug)]
pub enum CudaStorage {
    /// Activations, states, ids: owned memory (a clone is a device-to-device copy).
    Data(Buf),
    /// A placed weight, shared by its clones (weights are never written).
    Weight(Arc<Placed>),
}

impl Storage for CudaStorage {
    fn bytes(&self) -> usize {
        match self {
            CudaStorage::Data(b) => b.bytes,
            CudaStorage::Weight(w) => w.data.bytes + w.scales.as_ref().map_or(0, |s| s.bytes),
        }
    }

    fn clone_storage(&self) -> Box<dyn Storage> {
        match self {
            CudaStorage::Data(b) => {
                // A clone cannot report an error: a failed one is the device's fault (the engine stops at
                // its next step), and the clone is an empty buffer no kernel is launched on.
                let dev = &b.cache.dev;
                let copy = b.cache.take(b.bytes).and_then(|c| dev.copy(c.ptr, b.ptr, b.bytes).map(|_| c));
                let buf = copy.unwrap_or_else(|e| {
                    dev.fail("tensor copy", e);
                    Buf { ptr: DevPtr(0), bytes: b.bytes, cache: b.cache.clone() }
                });
                Box::new(CudaStorage::Data(buf))
            }
            CudaStorage::Weight(w) => Box::new(CudaStorage::Weight(w.clone())),
        }
    }
}

/// The CUDA backend (see the module docs).
#[derive(Debug)]
pub struct CudaBackend {
    /// The device, every call counted, its first fault kept.
    dev: Arc<Counted>,
    /// Decode steps as CUDA graphs, under the counters ([`crate::graph`]).
    graphs: Arc<Graphed>,
    /// Tensors' buffers, recycled.
    bufs: Arc<BufCache>,
    device: Device,
    info: DeviceInfo,
    /// `Int8` (the fast default): prefill-shaped bf16 and NVFP4 linears run as bf16 GEMMs (cuBLAS) with
    /// bf16 activations, as the CPU's fast path rounds them, and decode-shaped NVFP4 ones (dense and
    /// routed experts) take int8 activations per 16-value block with `dp4a`, as the CPU's `q8` does
    /// (`q8.rs`); `Exact`: every linear in f32 (parity tests).
    precision: osprey_backend::Precision,
    /// Most bytes of attention scores one launch may hold ([`CudaBackend::with_scratch_cap`]).
    scratch_cap: usize,
    /// Experts being copied into slots on the copy stream, kept (with their leases) until their copy's
    /// event completes: the execution contract's "the backend keeps `expert` until then".
    uploading: std::sync::Mutex<Vec<(crate::device::Event, osprey_backend::HostExpert)>>,
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // The copies must finish before their sources (the leases) go.
        let pending = std::mem::take(self.uploading.get_mut().unwrap_or_else(|e| e.into_inner()));
        for (e, expert) in pending {
            let _ = self.dev.synchronize(e);
            drop(expert);
        }
    }
}

/// Attention's scores per launch, at most (64 MiB): a 512-token chunk at a 32k context is 1 GiB of scores
/// at once, far past the memory plan's reserve; in bands of rows it is 64 MiB at any context (16 heads
/// × 32k keys × 4 bytes is 2 MiB a row: 32 rows a band). Until the flash kernels come (the next CUDA
/// issue), this bounds the scratch; their online softmax needs none.
pub const SCRATCH_CAP: usize = 64 << 20;

/// A device error as the seam reports it.
pub(crate) fn seam_error(e: DeviceError) -> BackendError {
    match e {
        DeviceError::OutOfMemory { requested, available } => BackendError::OutOfMemory { requested, available },
        DeviceError::Unavailable(m) => BackendError::Unavailable(m),
        other => BackendError::Device(other.to_string()),
    }
}

impl CudaBackend {
    /// The backend over `dev`, whose tensors are on `device`; every call to `dev` is counted
    /// ([`CudaBackend::counts`]).
    pub fn new(dev: Arc<dyn DeviceLayer>, device: Device) -> Self {
        let info = dev.info();
        // Graphs unless `OSPREY_CUDA_GRAPHS=0` (or `off`): the same results, eagerly launched.
        let on = std::env::var("OSPREY_CUDA_GRAPHS").map_or(true, |v| v != "0" && v != "off");
        let graphs = Arc::new(Graphed::new(dev, on));
        let dev = Arc::new(Counted::new(graphs.clone()));
        CudaBackend {
            graphs,
            bufs: Arc::new(BufCache::new(dev.clone(), BUF_CACHE)),
            dev,
            device,
            info,
            precision: osprey_backend::Precision::Exact,
            scratch_cap: SCRATCH_CAP,
            uploading: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// What the backend asked of its device since start: launches (per kernel), host waits, allocations,
    /// frees, bytes each way.
    pub fn counts(&self) -> DeviceCounts {
        self.dev.counts()
    }

    /// Host → device.
    fn copy_to_device(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.dev.upload(dst, src).map_err(seam_error)
    }

    /// Host → device on the copy stream.
    ///
    /// # Safety
    /// `src` must stay valid until the returned event completes.
    unsafe fn upload_async(&self, dst: DevPtr, src: &[u8]) -> Result<crate::device::Event> {
        // SAFETY: per this function's contract.
        unsafe { self.dev.upload_async(dst, src.as_ptr(), src.len()) }.map_err(seam_error)
    }

    /// Device → host.
    fn copy_to_host(&self, src: DevPtr, dst: &mut [u8]) -> Result<()> {
        self.dev.download(src, dst).map_err(seam_error)
    }

    /// The backend with attention's scores held to `bytes` per launch: query rows go in bands that fit
    /// (default [`SCRATCH_CAP`]; tests set it small to exercise the bands). The chunked delta rule's
    /// window of chunks is held to it too.
    pub fn with_scratch_cap(mut self, bytes: usize) -> Self {
        self.scratch_cap = bytes.max(1);
        self
    }

    /// The backend at `precision` (see the field's docs).
    pub fn with_precision(mut self, precision: osprey_backend::Precision) -> Self {
        self.precision = precision;
        self
    }

    /// The backend with decode steps as CUDA graphs or not (default: on unless `OSPREY_CUDA_GRAPHS=0`).
    pub fn with_graphs(self, on: bool) -> Self {
        self.graphs.set_enabled(on);
        self
    }

    /// What graphs did since start.
    pub fn graph_counts(&self) -> crate::GraphCounts {
        self.graphs.counts()
    }

    /// A graph's launch or build that failed is the device's sticky fault, as a kernel's would be.
    fn graph_fault(&self, e: DeviceError) -> BackendError {
        self.dev.fail("a step's graph", &e);
        self.dev.fault().unwrap_or_else(|| seam_error(e))
    }

    /// The backend with at most `bytes` of tensors' buffers kept for reuse (default [`BUF_CACHE`]; 0: every
    /// buffer freed when its tensor goes, as before the cache).
    pub fn with_buffer_cache(mut self, bytes: usize) -> Self {
        self.bufs = Arc::new(BufCache::new(self.dev.clone(), bytes));
        self
    }

    fn buf(&self, bytes: usize) -> Result<Buf> {
        self.bufs.take(bytes).map_err(seam_error)
    }

    /// An uninitialised tensor (at most 2^32 elements: the kernels count in `unsigned`).
    fn empty(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        let n: usize = shape.iter().product();
        if u32::try_from(n).is_err() {
            return Err(BackendError::Device(format!("a tensor of {n} elements: at most 2^32 on the CUDA backend")));
        }
        let buf = self.buf(n * dtype.size())?;
        Ok(Tensor::new(shape.to_vec(), dtype, self.device, Box::new(CudaStorage::Data(buf))))
    }

    /// Runs a kernel ([`crate::launch`]: typed by its signature) in an op that cannot report errors: a
    /// failure is the device's fault ([`Counted`] keeps it), which the step's next fallible op reports
    /// and [`Backend::health`] gives the engine. A launch over no threads is skipped.
    fn run<const N: usize>(&self, call: Call<N>, cfg: LaunchConfig) {
        if self.launchable(&call, cfg) {
            let _ = self.dev.launch(call.name, cfg, &call.args);
        }
    }

    /// Runs a kernel, reporting a fault.
    fn try_run<const N: usize>(&self, call: Call<N>, cfg: LaunchConfig) -> Result<()> {
        if !self.launchable(&call, cfg) {
            return self.dev.fault().map_or(Ok(()), Err);
        }
        self.dev.launch(call.name, cfg, &call.args).map_err(seam_error)
    }

    /// Whether a launch is made: not over no threads (skipped), nor with a null address (a tensor of
    /// another backend, or a failed copy: recorded as the device's fault).
    fn launchable<const N: usize>(&self, call: &Call<N>, cfg: LaunchConfig) -> bool {
        if call.args.iter().any(|a| matches!(a, crate::device::Arg::Ptr(DevPtr(0)))) {
            self.fail(call.name, "a tensor with no device memory (another backend's, or a failed copy)");
            return false;
        }
        !cfg.is_empty()
    }

    /// Records a fault in an op that cannot report it (see [`Counted::fail`]).
    fn fail(&self, op: &str, message: impl std::fmt::Display) {
        self.dev.fail(op, message);
    }
}

/// The device address of a tensor's elements; a tensor of another backend (a bug in the caller: the
/// seam never mixes backends) has none, and a launch naming the null address is not made: it is
/// recorded as the device's fault ([`CudaBackend::launchable`]).
pub(crate) fn ptr(t: &Tensor) -> DevPtr {
    match t.storage::<CudaStorage>() {
        Some(CudaStorage::Data(b)) => b.ptr,
        Some(CudaStorage::Weight(w)) => w.data.ptr,
        None => DevPtr(0),
    }
}

/// A count or size as a kernel's `unsigned` (tensors hold at most 2^32 elements: [`CudaBackend::empty`]).
pub(crate) fn u32_of(n: usize) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        self.device
    }

    fn describe(&self) -> String {
        let (major, minor) = self.info.capability;
        // A missing cuBLAS is said here, in the startup line, not silently fallen back from.
        let blas = if self.info.blas { "" } else { ", no cuBLAS: prefill GEMMs on osprey's kernels" };
        format!(
            "{} ({}, sm_{major}{minor}, {:.1} GiB{blas})",
            self.device,
            self.info.name,
            self.info.total_memory as f64 / (1u64 << 30) as f64
        )
    }

    fn health(&self) -> Result<()> {
        self.dev.fault().map_or(Ok(()), Err)
    }

    fn stats(&self) -> DeviceStats {
        let c = self.counts();
        let traffic = self.dev.traffic();
        let costs = costs(&c, traffic.as_ref());
        DeviceStats {
            memory_total: Some(self.info.total_memory as u64),
            memory_free: Some(self.dev.free_memory() as u64),
            bytes_to_device: c.bytes_to_device,
            bytes_from_device: c.bytes_from_device,
            launches: c.launches,
            kernels: c.kernels.into_iter().collect(),
            host_waits: c.host_waits,
            allocations: c.allocations,
            frees: c.frees,
            costs,
            window_bytes: traffic.map(|t| t.windows),
            graphs: {
                let g = self.graphs.counts();
                osprey_backend::GraphStats { built: g.built, launched: g.launched, nodes: g.nodes, updated: g.updated }
            },
        }
    }

    fn begin_step(&self, key: u64) -> Result<()> {
        self.graphs.begin(key).map_err(|e| self.graph_fault(e))
    }

    fn end_step(&self) -> Result<()> {
        self.graphs.end().map_err(|e| self.graph_fault(e))
    }

    fn supports(&self, _op: Op) -> bool {
        true // every op of the seam has a kernel (tests/cuda/ checks each against the CPU backend)
    }
}

/// Each kernel's cost: its launches and declared arithmetic ([`Counted`]), and the bytes the device
/// measured, if it meters (the copy engine's `memcpy` and `memset` come only from there).
fn costs(c: &DeviceCounts, traffic: Option<&crate::Traffic>) -> Vec<osprey_backend::KernelCost> {
    let mut names: std::collections::BTreeSet<&String> = c.kernels.keys().collect();
    names.extend(traffic.iter().flat_map(|t| t.kernels.keys()));
    names
        .into_iter()
        .map(|name| osprey_backend::KernelCost {
            name: name.clone(),
            launches: c.kernels.get(name).copied().unwrap_or(0),
            flops: c.flops.get(name).copied().unwrap_or_default(),
            bytes: traffic.map(|t| t.kernels.get(name).copied().unwrap_or_default()),
        })
        .collect()
}
