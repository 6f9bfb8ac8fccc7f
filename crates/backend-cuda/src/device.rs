//! The thin device layer under the CUDA backend: device memory by address, copies, kernel launches by
//! name with `cuLaunchKernel`'s argument convention, and events. Two implementations: the emulated device
//! ([`crate::emu::EmuDevice`], host memory and the host-compiled kernels: every CI run) and the real one
//! (`crate::driver`, cudarc, behind the `cuda` feature). Everything above this layer — the backend's
//! ops, weights, slots, page tables — is one code path for both.
//!
//! Ordering: operations run in the order they are issued (one queue per device layer); an [`Event`]
//! recorded after an operation completes when it has, and [`DeviceLayer::download`] waits for the
//! work before it.

use std::fmt::Debug;

/// A device address (a `CUdeviceptr`; on the emulated device, a host address).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DevPtr(pub u64);

impl DevPtr {
    /// `bytes` further on.
    pub fn offset(self, bytes: usize) -> DevPtr {
        DevPtr(self.0 + bytes as u64)
    }
}

/// A graph built by a device layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphId(pub u64);

/// One operation of a graph, each after the one before.
#[derive(Clone, Debug, PartialEq)]
pub enum Node {
    /// A kernel launch.
    Kernel {
        /// The kernel (of `kernels/`).
        name: String,
        /// Its grid and block.
        cfg: LaunchConfig,
        /// Its arguments.
        args: Vec<Arg>,
    },
    /// Host → device from the graph's staging memory at byte `at`.
    Upload {
        /// Where to.
        dst: DevPtr,
        /// Offset in the staging memory.
        at: usize,
        /// Bytes.
        len: usize,
    },
    /// Device → device.
    Copy {
        /// Where to.
        dst: DevPtr,
        /// Where from.
        src: DevPtr,
        /// Bytes.
        bytes: usize,
    },
    /// Zeroes `bytes` at `dst`.
    Zero {
        /// Where.
        dst: DevPtr,
        /// Bytes.
        bytes: usize,
    },
}

/// A launch's grid and block dimensions.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in x, y, z.
    pub grid: [u32; 3],
    /// Threads per block in x, y, z.
    pub block: [u32; 3],
}

impl LaunchConfig {
    /// `n` independent elements in a grid-stride loop: 256 threads a block, at most 1,024 blocks.
    pub fn elements(n: usize) -> Self {
        let blocks = n.div_ceil(256).clamp(1, 1024) as u32;
        LaunchConfig { grid: [blocks, 1, 1], block: [256, 1, 1] }
    }

    /// One block of `threads` per group (a norm's row or head).
    pub fn per_group(groups: usize, threads: u32) -> Self {
        LaunchConfig { grid: [groups as u32, 1, 1], block: [threads, 1, 1] }
    }

    /// Whether it launches no thread (an invalid launch on a GPU: the backend skips it, the emulated
    /// device refuses it).
    pub fn is_empty(&self) -> bool {
        self.grid.contains(&0) || self.block.contains(&0)
    }
}

/// One kernel argument, by value (a pointer is a device address).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg {
    /// A device pointer (`T*`).
    Ptr(DevPtr),
    /// `unsigned`.
    U32(u32),
    /// `int`.
    I32(i32),
    /// `float`.
    F32(f32),
}

impl Arg {
    /// The argument as its C value in the low bytes of 8 (how both device layers pass it: the driver
    /// reads each parameter's own size from there).
    pub fn bits(self) -> u64 {
        match self {
            Arg::Ptr(p) => p.0,
            Arg::U32(v) => u64::from(v),
            Arg::I32(v) => u64::from(v as u32),
            Arg::F32(v) => u64::from(v.to_bits()),
        }
    }
}

/// One GEMM as cuBLAS defines it (column-major, `C = alpha·op(A)·op(B) + beta·C`, `op` a transpose when
/// asked), with bf16 `A` and `B`, f32 `C` and f32 accumulation (`cublasGemmEx`, `CUBLAS_COMPUTE_32F`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GemmBf16 {
    /// `op(A)` is `A` transposed.
    pub transa: bool,
    /// `op(B)` is `B` transposed.
    pub transb: bool,
    /// Rows of `op(A)` and `C`.
    pub m: usize,
    /// Columns of `op(B)` and `C`.
    pub n: usize,
    /// Columns of `op(A)`, rows of `op(B)`.
    pub k: usize,
    /// `A` and its leading dimension.
    pub a: (DevPtr, usize),
    /// `B` and its leading dimension.
    pub b: (DevPtr, usize),
    /// `C` and its leading dimension.
    pub c: (DevPtr, usize),
    /// Scale of the product.
    pub alpha: f32,
    /// Scale of `C`'s old value.
    pub beta: f32,
}

/// A point in a device's queue: the compute stream's, or (tagged with [`Event::COPY`]) the copy stream's.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Event(pub u64);

impl Event {
    /// The tag of the copy stream's events.
    pub const COPY: u64 = 1 << 63;

    /// Whether it is a point in the copy stream.
    pub fn is_copy(self) -> bool {
        self.0 & Event::COPY != 0
    }
}

/// What the device says of itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Its name (`NVIDIA GeForce RTX 4090`, `emulated`).
    pub name: String,
    /// Compute capability (major, minor).
    pub capability: (u32, u32),
    /// Bytes of device memory.
    pub total_memory: usize,
    /// Whether bf16 GEMMs run in a BLAS (cuBLAS on a GPU, emulated here); without one, prefill-shaped
    /// linears stay on the backend's own kernels (said in the startup line, `CudaBackend::describe`).
    pub blas: bool,
}

/// Why a device operation failed.
#[derive(Clone, Debug, thiserror::Error)]
pub enum DeviceError {
    /// No room for an allocation.
    #[error("out of device memory: {requested} bytes asked, {available} available")]
    OutOfMemory {
        /// Bytes asked.
        requested: usize,
        /// Bytes free.
        available: usize,
    },
    /// The driver, a library or the device is missing.
    #[error("{0}")]
    Unavailable(String),
    /// A kernel faulted or could not launch (an emulated barrier deadlock, a bad shuffle, a driver error).
    #[error("kernel {kernel}: {message}")]
    Kernel {
        /// The kernel's name.
        kernel: String,
        /// What went wrong.
        message: String,
    },
    /// A copy outside the allocation it names (a bug in the caller).
    #[error("{0}: this is a bug")]
    Bounds(String),
    /// The device faulted earlier and is unusable (`Counted` refuses every call after the first fault).
    #[error("the device is unusable after {0}")]
    Faulted(String),
}

/// The device under the CUDA backend (see the module docs).
pub trait DeviceLayer: Send + Sync + Debug {
    /// Name, capability, memory.
    fn info(&self) -> DeviceInfo;
    /// Bytes of device memory not allocated.
    fn free_memory(&self) -> usize;
    /// `bytes` of device memory (contents undefined).
    fn alloc(&self, bytes: usize) -> Result<DevPtr, DeviceError>;
    /// Gives an allocation back, once the work issued before has run.
    fn free(&self, p: DevPtr) -> Result<(), DeviceError>;
    /// Host memory for the expert RAM tier, zeroed and 4 KiB-aligned: page-locked on a GPU, so the copy
    /// stream reads it directly; plain memory on the emulated device.
    fn alloc_host(&self, bytes: usize) -> Result<osprey_backend::HostArena, DeviceError>;
    /// Host → device, ordered after the work before it.
    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError>;
    /// Host → device on the copy stream, after the copies before it and concurrent with compute: the
    /// compute stream reads `dst` only after [`DeviceLayer::wait_event`] on the returned event.
    ///
    /// # Safety
    /// `src` must stay valid for reads of `len` bytes until the returned event completes
    /// ([`DeviceLayer::is_complete`], [`DeviceLayer::synchronize`]).
    unsafe fn upload_async(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<Event, DeviceError>;
    /// Makes the compute stream's later work wait for `e` (a copy's event) without blocking the host.
    fn wait_event(&self, e: Event) -> Result<(), DeviceError>;
    /// Makes the copy stream's later copies wait for `e` (a compute event: the last reader of memory a copy
    /// overwrites) without blocking the host; a copy's event is already in the copy stream's order.
    fn copies_after(&self, e: Event) -> Result<(), DeviceError>;
    /// Device → host, after the work before it (waits).
    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError>;
    /// Device → device.
    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError>;
    /// Zeroes `bytes` at `dst`.
    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError>;
    /// One bf16 GEMM with cuBLAS's semantics, on the compute stream.
    fn gemm_bf16(&self, g: GemmBf16) -> Result<(), DeviceError>;
    /// Launches kernel `name` (of the sources in `kernels/`).
    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), DeviceError>;
    /// An event after everything issued so far.
    fn record(&self) -> Result<Event, DeviceError>;
    /// Whether the work before `e` has run.
    fn is_complete(&self, e: Event) -> bool;
    /// Waits for the work before `e`.
    fn synchronize(&self, e: Event) -> Result<(), DeviceError>;
    /// The global-memory bytes measured since start, where the device meters them (the emulated device
    /// made [`crate::EmuDevice::measuring`]; a card does not).
    fn traffic(&self) -> Option<crate::Traffic> {
        None
    }
    /// A graph of `nodes`, each after the one before, its uploads reading `staging` (page-locked host
    /// memory the caller keeps, unchanged while the graph runs): built once, launched many times
    /// ([`crate::graph`]).
    fn graph_build(&self, nodes: &[Node], staging: *const u8) -> Result<GraphId, DeviceError> {
        let _ = (nodes, staging);
        Err(DeviceError::Unavailable("this device layer builds no graphs".into()))
    }
    /// Node `i` of graph `g` is now `node` (its kind and kernel unchanged): its arguments, sizes or
    /// addresses, updated in place for the next launch.
    fn graph_update(&self, g: GraphId, i: usize, node: &Node) -> Result<(), DeviceError> {
        let _ = (g, i, node);
        Err(DeviceError::Unavailable("this device layer builds no graphs".into()))
    }
    /// Launches graph `g` on the compute stream, after the work before it.
    fn graph_launch(&self, g: GraphId) -> Result<(), DeviceError> {
        let _ = g;
        Err(DeviceError::Unavailable("this device layer builds no graphs".into()))
    }
    /// Frees graph `g`.
    fn graph_drop(&self, g: GraphId) {
        let _ = g;
    }
}
