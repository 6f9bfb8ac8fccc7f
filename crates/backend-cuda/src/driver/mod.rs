//! The real device layer (feature `cuda`): cudarc over the driver API, libraries loaded at run time.
//! At open it probes `libcuda` (cudarc panics on a missing library; a probe turns that into a clear
//! error), creates the device's primary context and its streams, and loads every kernel source's image
//! for the device's architecture (`images::choose`): the cubin embedded at build time, else one in the
//! disk cache (`kernel_cache`: keyed by source text and architecture, written atomically, checked on
//! read), else the embedded PTX for `compute_80`; NVRTC (probed only then) compiles only what none of
//! them has. A binary built with NVRTC, or a warm cache, starts with only the driver. Operations are issued on the stream in order; events are CUDA events.
//!
//! Not yet run on a GPU: no GPU was lent while it was written (docs/cuda.md says what has run where).

mod graph;

use std::collections::{BTreeMap, HashMap};

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream, PushKernelArg};
use cudarc::nvrtc::Ptx;

use crate::device::{Arg, DevPtr, DeviceError, DeviceInfo, DeviceLayer, Event, GemmBf16, GraphId, LaunchConfig, Node};
use crate::{images, kernel_cache, kernels, nvrtc};

/// A CUDA device through cudarc (see the module docs).
pub struct CudaDevice {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// Uploads of experts into slots, concurrent with compute (from the pinned arena when registered).
    copy: Arc<CudaStream>,
    functions: HashMap<&'static str, CudaFunction>,
    info: DeviceInfo,
    events: Mutex<BTreeMap<u64, CudaEvent>>,
    recorded: AtomicU64,
    /// cuBLAS on the compute stream (`None`: libcublas not found; the backend then keeps to its kernels).
    blas: Option<Blas>,
    /// Built graphs (`driver/graph.rs`).
    pub(crate) graphs: graph::Graphs,
}

/// A cuBLAS handle, used by one caller at a time.
struct Blas(Mutex<cudarc::cublas::sys::cublasHandle_t>);

// SAFETY: the handle is only used under its mutex, with the context bound.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Blas {
    /// A handle on `stream`, when libcublas loads.
    fn open(stream: &CudaStream) -> Option<Blas> {
        // SAFETY: only tries to open the library.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return None;
        }
        let handle = cudarc::cublas::result::create_handle().ok()?;
        // SAFETY: a fresh handle and a live stream of the bound context.
        unsafe { cudarc::cublas::result::set_stream(handle, stream.cu_stream() as _) }.ok()?;
        Some(Blas(Mutex::new(handle)))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let handle = *self.0.get_mut().unwrap_or_else(|e| e.into_inner());
        // SAFETY: created by `open`, destroyed once, here.
        let _ = unsafe { cudarc::cublas::result::destroy_handle(handle) };
    }
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CudaDevice({:?})", self.info)
    }
}

fn driver(what: &str, e: impl std::fmt::Debug) -> DeviceError {
    DeviceError::Unavailable(format!("{what}: {e:?}"))
}

/// The cubin (or PTX) of source `stem` for `arch`: from the disk cache when a whole file is there (no
/// NVRTC needed), else compiled by NVRTC and cached (`kernel_cache`: written atomically, checked on read).
/// The image of source `stem` for `arch`: embedded, cached or JIT PTX (`images::choose`), else compiled by
/// NVRTC for the card, or for `compute_80` when this NVRTC does not know it (then cached).
fn image(stem: &str, arch: &str) -> Result<Vec<u8>, DeviceError> {
    let source = kernels::gpu_source(stem).unwrap_or_default();
    let path = |a: &str| kernel_cache::path(&kernel_cache::dir(), stem, &source, a);
    if let Some(bytes) = images::choose(stem, arch, kernels::embedded(), |a| kernel_cache::read(&path(a))) {
        return Ok(bytes.into_owned());
    }
    if !nvrtc::available() {
        return Err(DeviceError::Unavailable(format!(
            "no kernel image for {arch}: this binary embeds none, none is cached in {}, and {}",
            kernel_cache::dir().display(),
            nvrtc::NvrtcError::Missing
        )));
    }
    let compiled = nvrtc::compile(stem, arch)
        .or_else(|_| nvrtc::compile(stem, images::PTX_ARCH))
        .map_err(|e| DeviceError::Unavailable(e.to_string()))?;
    // A cache that cannot be written only costs a compile at the next start.
    let _ = kernel_cache::write(&path(arch), &compiled.image);
    Ok(compiled.image)
}

impl CudaDevice {
    /// Opens device `ordinal`: a clear error without a driver, a device or NVRTC.
    pub fn open(ordinal: usize) -> Result<Self, DeviceError> {
        // SAFETY: only tries to open the library.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::Unavailable(
                "no CUDA driver: libcuda was not found (install the NVIDIA driver, or use --device cpu)".into(),
            ));
        }
        let count = CudaContext::device_count().map_err(|e| driver("counting CUDA devices", e))?;
        if ordinal >= count.max(0) as usize {
            return Err(DeviceError::Unavailable(format!("cuda:{ordinal}: this machine has {count} CUDA device(s)")));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| driver("creating a context", e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| driver("compute capability", e))?;
        let mut info = DeviceInfo {
            name: ctx.name().map_err(|e| driver("device name", e))?,
            capability: (major as u32, minor as u32),
            total_memory: ctx.total_mem().map_err(|e| driver("device memory", e))?,
            blas: false,
        };
        // Compute on a stream of its own, not the legacy default one: ordered against the copy stream by
        // events only, and capturable into a CUDA graph.
        let stream = ctx.new_stream().map_err(|e| driver("creating the compute stream", e))?;
        let copy = ctx.new_stream().map_err(|e| driver("creating the copy stream", e))?;
        let arch = format!("sm_{major}{minor}");
        let mut functions = HashMap::new();
        for stem in kernels::sources() {
            let bytes = image(stem, &arch)?;
            let ptx = if bytes.starts_with(b"\x7fELF") {
                Ptx::from_binary(bytes)
            } else {
                Ptx::from_src(String::from_utf8_lossy(&bytes).into_owned())
            };
            let module = ctx.load_module(ptx).map_err(|e| driver(&format!("loading {stem}"), e))?;
            for k in kernels::all().filter(|k| k.source == stem) {
                functions.insert(k.name, module.load_function(k.name).map_err(|e| driver(k.name, e))?);
            }
        }
        let blas = Blas::open(&stream);
        info.blas = blas.is_some();
        Ok(CudaDevice {
            blas,
            ctx,
            stream,
            copy,
            functions,
            info,
            events: Mutex::new(BTreeMap::new()),
            recorded: AtomicU64::new(0),
            graphs: graph::Graphs::default(),
        })
    }

    pub(crate) fn bind(&self) -> Result<(), DeviceError> {
        self.ctx.bind_to_thread().map_err(|e| driver("binding the context", e))
    }

    /// Kernel `name`'s handle.
    pub(crate) fn function(&self, name: &str) -> Result<sys::CUfunction, DeviceError> {
        let f = self
            .functions
            .get(name)
            .ok_or_else(|| DeviceError::Kernel { kernel: name.into(), message: "no such kernel in kernels/".into() })?;
        Ok(f.cu_function())
    }

    /// The context's handle.
    pub(crate) fn cu_ctx(&self) -> sys::CUcontext {
        self.ctx.cu_ctx()
    }

    /// The compute stream's handle.
    pub(crate) fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }
}

impl DeviceLayer for CudaDevice {
    fn info(&self) -> DeviceInfo {
        self.info.clone()
    }

    fn free_memory(&self) -> usize {
        self.ctx.mem_get_info().map(|(free, _)| free).unwrap_or(0)
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, DeviceError> {
        self.bind()?;
        // SAFETY: the context is bound; a zero-size request is rounded up.
        match unsafe { result::malloc_sync(bytes.max(1)) } {
            Ok(p) => Ok(DevPtr(p)),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                Err(DeviceError::OutOfMemory { requested: bytes, available: self.free_memory() })
            }
            Err(e) => Err(driver("allocating", e)),
        }
    }

    fn alloc_host(&self, bytes: usize) -> Result<osprey_backend::HostArena, DeviceError> {
        self.bind()?;
        // SAFETY: the context is bound; the memory is zeroed below before anyone reads it.
        let p = match unsafe { result::malloc_host(bytes.max(1), sys::CU_MEMHOSTALLOC_PORTABLE) } {
            Ok(p) => p.cast::<u8>(),
            Err(e) if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY => {
                return Err(DeviceError::OutOfMemory { requested: bytes, available: 0 })
            }
            Err(e) => return Err(driver("page-locked host memory", e)),
        };
        // SAFETY: `p` holds `bytes` bytes, page-aligned (4 KiB at least), until `Pinned` frees it.
        unsafe {
            std::ptr::write_bytes(p, 0, bytes);
            Ok(osprey_backend::HostArena::new(p, bytes, Box::new(Pinned { ptr: p, ctx: self.ctx.clone() })))
        }
    }

    fn free(&self, p: DevPtr) -> Result<(), DeviceError> {
        self.bind()?;
        // The stream's work that reads `p` must finish first: freeing is ordered by a sync, whose error
        // (a fault of any earlier kernel) is reported, not swallowed.
        let synced = self.stream.synchronize().map_err(|e| driver("the stream before a free", e));
        // SAFETY: `p` came from `alloc` and is freed once (its `Buf` owns it).
        let freed = unsafe { result::free_sync(p.0) }.map_err(|e| driver("free", e));
        synced.and(freed)
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: `dst` holds `src.len()` bytes (the backend sized it); a copy from pageable memory
        // returns once `src` has been staged, so `src` may be dropped after.
        unsafe { result::memcpy_htod_async(dst.0, src, self.stream.cu_stream()) }.map_err(|e| driver("upload", e))
    }

    unsafe fn upload_async(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<Event, DeviceError> {
        self.bind()?;
        // SAFETY: the caller keeps `src` valid for `len` bytes until the event recorded below completes;
        // `dst` holds `len` bytes (the backend sized the slot).
        let bytes = unsafe { std::slice::from_raw_parts(src, len) };
        unsafe { result::memcpy_htod_async(dst.0, bytes, self.copy.cu_stream()) }.map_err(|e| driver("copy", e))?;
        let n = self.recorded.fetch_add(1, Ordering::Relaxed) + 1;
        let ev = self.copy.record_event(None).map_err(|e| driver("recording a copy", e))?;
        self.events.lock().unwrap_or_else(|e| e.into_inner()).insert(Event::COPY | n, ev);
        Ok(Event(Event::COPY | n))
    }

    fn wait_event(&self, e: Event) -> Result<(), DeviceError> {
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        match events.get(&e.0) {
            Some(ev) => self.stream.wait(ev).map_err(|e| driver("ordering compute after a copy", e)),
            None => Ok(()), // already complete and pruned
        }
    }

    fn copies_after(&self, e: Event) -> Result<(), DeviceError> {
        if e.is_copy() {
            return Ok(()); // the copy stream's own order
        }
        let events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        match events.get(&e.0) {
            Some(ev) => self.copy.wait(ev).map_err(|e| driver("ordering a copy after compute", e)),
            None => Ok(()), // already complete and pruned
        }
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: `src` holds `dst.len()` bytes; the sync below completes the copy before `dst` is read.
        unsafe { result::memcpy_dtoh_async(dst, src.0, self.stream.cu_stream()) }.map_err(|e| driver("download", e))?;
        self.stream.synchronize().map_err(|e| driver("download", e))
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: both ranges are inside allocations of at least `bytes` (the backend sized them).
        unsafe { result::memcpy_dtod_async(dst.0, src.0, bytes, self.stream.cu_stream()) }
            .map_err(|e| driver("copy", e))
    }

    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.bind()?;
        // SAFETY: as in `copy`.
        unsafe { result::memset_d8_async(dst.0, 0, bytes, self.stream.cu_stream()) }.map_err(|e| driver("memset", e))
    }

    fn gemm_bf16(&self, g: GemmBf16) -> Result<(), DeviceError> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType_t};
        let blas = self.blas.as_ref().ok_or_else(|| DeviceError::Unavailable("libcublas not found".into()))?;
        self.bind()?;
        let op = |t: bool| if t { cublasOperation_t::CUBLAS_OP_T } else { cublasOperation_t::CUBLAS_OP_N };
        let dim = |v: usize| i32::try_from(v).map_err(|_| DeviceError::Bounds(format!("a GEMM dimension of {v}")));
        let handle = blas.0.lock().unwrap_or_else(|e| e.into_inner());
        // SAFETY: the pointers are live allocations of the sizes the dimensions and leading dimensions
        // span (the backend sized them); alpha and beta are host values read during the call.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *handle,
                op(g.transa),
                op(g.transb),
                dim(g.m)?,
                dim(g.n)?,
                dim(g.k)?,
                (&g.alpha as *const f32).cast(),
                g.a.0 .0 as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                dim(g.a.1)?,
                g.b.0 .0 as *const std::ffi::c_void,
                cudaDataType_t::CUDA_R_16BF,
                dim(g.b.1)?,
                (&g.beta as *const f32).cast(),
                g.c.0 .0 as *mut std::ffi::c_void,
                cudaDataType_t::CUDA_R_32F,
                dim(g.c.1)?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DFALT,
            )
        }
        .map_err(|e| DeviceError::Kernel { kernel: "cublasGemmEx".into(), message: format!("{e:?}") })
    }

    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), DeviceError> {
        let fault = |message: String| DeviceError::Kernel { kernel: name.into(), message };
        let f = self.functions.get(name).ok_or_else(|| fault("no such kernel in kernels/".into()))?;
        let info = kernels::find(name).ok_or_else(|| fault("no such kernel in kernels/".into()))?;
        if args.len() != info.arity {
            return Err(fault(format!("{} arguments for {} parameters: this is a bug", args.len(), info.arity)));
        }
        let values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut b = self.stream.launch_builder(f);
        for v in &values {
            b.arg(v);
        }
        let cfg = cudarc::driver::LaunchConfig {
            grid_dim: (cfg.grid[0], cfg.grid[1], cfg.grid[2]),
            block_dim: (cfg.block[0], cfg.block[1], cfg.block[2]),
            shared_mem_bytes: 0,
        };
        // SAFETY: the argument count matches the kernel's (checked above) and each pointer argument is a
        // live allocation of the size the kernel reads (the backend's contract with its kernels).
        unsafe { b.launch(cfg) }.map(|_| ()).map_err(|e| fault(format!("{e:?}")))
    }

    fn record(&self) -> Result<Event, DeviceError> {
        let n = self.recorded.fetch_add(1, Ordering::Relaxed) + 1;
        // A failed recording is an error, not an event that reads as complete.
        let ev = self.stream.record_event(None).map_err(|e| driver("recording an event", e))?;
        let mut events = self.events.lock().unwrap_or_else(|e| e.into_inner());
        events.retain(|_, e| !e.is_complete());
        events.insert(n, ev);
        Ok(Event(n))
    }

    fn is_complete(&self, e: Event) -> bool {
        self.events.lock().unwrap_or_else(|e| e.into_inner()).get(&e.0).is_none_or(|ev| ev.is_complete())
    }

    fn synchronize(&self, e: Event) -> Result<(), DeviceError> {
        let ev = self.events.lock().unwrap_or_else(|e| e.into_inner()).remove(&e.0);
        match ev {
            Some(ev) => ev.synchronize().map_err(|e| driver("waiting for an event", e)),
            None => Ok(()),
        }
    }

    fn graph_build(&self, nodes: &[Node], staging: *const u8) -> Result<GraphId, DeviceError> {
        self.build_graph(nodes, staging)
    }

    fn graph_update(&self, g: GraphId, i: usize, node: &Node) -> Result<(), DeviceError> {
        self.update_graph(g, i, node)
    }

    fn graph_launch(&self, g: GraphId) -> Result<(), DeviceError> {
        self.launch_graph(g)
    }

    fn graph_drop(&self, g: GraphId) {
        self.drop_graph(g);
    }
}

/// Page-locked host memory from `cuMemHostAlloc`, freed with its context.
struct Pinned {
    ptr: *mut u8,
    ctx: Arc<CudaContext>,
}

// SAFETY: uniquely owned page-locked memory, freed only on drop.
unsafe impl Send for Pinned {}
unsafe impl Sync for Pinned {}

impl Drop for Pinned {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_host` and freed once, here.
            let _ = unsafe { result::free_host(self.ptr.cast()) };
        }
    }
}
