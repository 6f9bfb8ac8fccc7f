//! The emulated device: device memory is host memory, a launch runs the kernel's host-compiled body
//! (`build.rs`, `emu/`) thread by thread on fibers, and work is queued on two streams that run as a GPU
//! may run them (`stream.rs`): compute when the host waits, each copy as early or as late as its order
//! allows. A test device (`--device cuda-emu`), never chosen by default: it is how the
//! kernels and the backend above them are checked on machines without a GPU. Allocations are tracked,
//! so a copy outside one is refused rather than corrupting the process, and the memory cap makes the
//! out-of-memory path testable.

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};

use crate::kernels::{emu_entry, Launch};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

mod stream;

pub use stream::CopyOrder;
use stream::{CopyItem, Streams, Work, MAX_QUEUED, MAX_STAGED};

use crate::device::{Arg, DevPtr, DeviceError, DeviceInfo, DeviceLayer, Event, GemmBf16, GraphId, LaunchConfig, Node};
use crate::traffic::{Meter, Traffic};

thread_local! {
    /// The kernels launched on this thread while [`launches_of`] records.
    static LAUNCHED: std::cell::RefCell<Option<Vec<&'static str>>> = const { std::cell::RefCell::new(None) };
}

/// 256 bytes aligned as a `cuMemAlloc` allocation is (the unit of the emulated device's memory).
#[derive(Clone, Copy, Debug)]
#[repr(C, align(256))]
struct Block([u64; 32]);

/// A live allocation: its memory and its size in bytes (a multiple of 8; the memory is whole blocks).
#[derive(Debug)]
struct Alloc {
    _mem: Box<[Block]>,
    len: usize,
}

/// Runs `f` and returns the kernels the emulated device launched on this thread meanwhile, in order:
/// which kernels an op's test runs (the emulated device launches on the calling thread).
pub fn launches_of(f: impl FnOnce()) -> Vec<&'static str> {
    let outer = LAUNCHED.with(|l| l.borrow_mut().replace(Vec::new()));
    f();
    let inner = LAUNCHED.with(|l| std::mem::replace(&mut *l.borrow_mut(), outer)).unwrap_or_default();
    // A nested call's launches are the enclosing call's too (a test that checks its op's kernels, run
    // by the coverage test that collects every case's).
    LAUNCHED.with(|l| {
        if let Some(o) = l.borrow_mut().as_mut() {
            o.extend(inner.iter().copied());
        }
    });
    inner
}

unsafe extern "C" {
    fn osprey_emu_last_error() -> *const std::ffi::c_char;
}

/// The emulated device (see the module docs).
#[derive(Debug)]
pub struct EmuDevice {
    /// Live allocations: address → the memory (256-byte aligned, as `cuMemAlloc`'s: a kernel's vector
    /// loads rely on it) and its size in bytes (a multiple of 8).
    allocs: Mutex<BTreeMap<u64, Alloc>>,
    /// Bytes allocated, and the cap.
    used: AtomicU64,
    capacity: usize,
    /// Operations issued (an event is the count when recorded).
    issued: AtomicU64,
    /// The compute and copy streams' queued work (`stream.rs`).
    streams: Mutex<Streams>,
    /// When copies run.
    copy_order: CopyOrder,
    /// Injected faults (tests): the launch, and the allocation, that fail, counted from 1 (0: none).
    fail_launch: AtomicU64,
    fail_alloc: AtomicU64,
    launches: AtomicU64,
    allocations: AtomicU64,
    /// The meter of global-memory traffic ([`EmuDevice::measuring`]).
    meter: Option<Mutex<Meter>>,
    /// Built graphs: their nodes and staging memory (an address), by id.
    graphs: Mutex<BTreeMap<u64, (Vec<Node>, usize)>>,
}

impl EmuDevice {
    /// A device with `capacity` bytes of memory.
    pub fn new(capacity: usize) -> Self {
        EmuDevice {
            allocs: Mutex::new(BTreeMap::new()),
            used: AtomicU64::new(0),
            capacity,
            issued: AtomicU64::new(0),
            streams: Mutex::new(Streams::new()),
            copy_order: CopyOrder::Seeded,
            fail_launch: AtomicU64::new(0),
            fail_alloc: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            meter: None,
            graphs: Mutex::new(BTreeMap::new()),
        }
    }

    /// The same device, metering the global-memory bytes of every launch, copy and GEMM
    /// ([`DeviceLayer::traffic`]; the speed model's input). Before any allocation.
    pub fn measuring(mut self) -> Self {
        self.meter = Some(Mutex::new(Meter::new()));
        self
    }

    /// Runs `f` with the meter, if metering.
    fn metered<T>(&self, f: impl FnOnce(&mut Meter) -> T) -> Option<T> {
        self.meter.as_ref().map(|m| f(&mut m.lock().unwrap_or_else(|e| e.into_inner())))
    }

    /// Makes the `n`-th launch from now fail as a kernel fault would (tests of the engine's fault path).
    pub fn fail_launch_after(&self, n: u64) {
        self.fail_launch.store(self.launches.load(Ordering::Relaxed) + n.max(1), Ordering::Relaxed);
    }

    /// Makes the `n`-th allocation from now fail as a driver error (not out of memory) would.
    pub fn fail_alloc_after(&self, n: u64) {
        self.fail_alloc.store(self.allocations.load(Ordering::Relaxed) + n.max(1), Ordering::Relaxed);
    }

    /// The same device with its copies run in `order` (tests of a missing fence).
    pub fn with_copy_order(mut self, order: CopyOrder) -> Self {
        self.copy_order = order;
        self
    }

    fn streams(&self) -> std::sync::MutexGuard<'_, Streams> {
        self.streams.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn next_id(&self) -> u64 {
        self.issued.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Queues compute work; runs the queue when it is long.
    fn queue(&self, w: Work) -> Result<(), DeviceError> {
        let mut s = self.streams();
        let id = self.next_id();
        if let Work::Write { bytes, .. } = &w {
            s.staged += bytes.len();
        }
        s.compute.push_back((id, w));
        if s.compute.len() >= MAX_QUEUED || s.staged >= MAX_STAGED {
            self.run_compute(&mut s, id);
        }
        Ok(())
    }

    /// Runs the compute stream up to `upto` (a fault is kept for the next fence).
    fn run_compute(&self, s: &mut Streams, upto: u64) {
        while s.compute.front().is_some_and(|(id, _)| *id <= upto) {
            let Some((id, w)) = s.compute.pop_front() else { break };
            if let Err(e) = self.exec(s, w) {
                s.fault.get_or_insert(e);
            }
            s.ran = s.ran.max(id);
        }
        s.ran = s.ran.max(upto);
    }

    /// Runs the copy stream up to `upto`, each copy after the compute work it was ordered behind.
    fn run_copies(&self, s: &mut Streams, upto: u64) {
        while s.copies.front().is_some_and(|c| c.id <= upto) {
            let Some(c) = s.copies.pop_front() else { break };
            if c.after > s.ran {
                self.run_compute(s, c.after);
            }
            // SAFETY: `upload_async`'s caller keeps `src` valid until this copy's event completes (now);
            // the destination was checked inside an allocation when the copy was queued, and a free runs
            // the queues first.
            unsafe { std::ptr::copy_nonoverlapping(c.src as *const u8, c.dst.0 as *mut u8, c.len) };
        }
    }

    /// Runs everything queued (before a free, a download).
    fn drain(&self, s: &mut Streams) {
        let all = self.issued.load(Ordering::Relaxed);
        self.run_compute(s, all);
        self.run_copies(s, all);
    }

    /// One piece of compute work, now.
    fn exec(&self, s: &mut Streams, w: Work) -> Result<(), DeviceError> {
        match w {
            Work::Launch { name, entry, cfg, mut args } => self.run_kernel(name, entry, cfg, &mut args),
            Work::Write { dst, bytes } => {
                s.staged -= bytes.len();
                // SAFETY: checked inside a live allocation when queued; a free runs the queue first.
                unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), dst.0 as *mut u8, bytes.len()) };
                Ok(())
            }
            Work::Copy { dst, src, len } => {
                self.metered(|m| m.touch("memcpy", &[(src.0, len, false), (dst.0, len, true)]));
                // SAFETY: both ranges checked inside live allocations when queued; `copy` allows overlap.
                unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, len) };
                Ok(())
            }
            Work::Stage { dst, src, len } => {
                // SAFETY: `dst` checked inside a live allocation when queued; `src` is the graph's staging
                // memory, which its owner keeps unchanged until the graph has run (read now, as a GPU's
                // copy node reads it when it runs).
                unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.0 as *mut u8, len) };
                Ok(())
            }
            Work::Zero { dst, len } => {
                self.metered(|m| m.touch("memset", &[(dst.0, len, true)]));
                // SAFETY: checked inside a live allocation when queued.
                unsafe { std::ptr::write_bytes(dst.0 as *mut u8, 0, len) };
                Ok(())
            }
            Work::Gemm(g) => {
                self.gemm_now(g);
                Ok(())
            }
            Work::WaitCopy(id) => {
                self.run_copies(s, id);
                Ok(())
            }
        }
    }

    /// Checks that `[p, p + bytes)` lies inside one live allocation.
    fn check(&self, p: DevPtr, bytes: usize, what: &str) -> Result<(), DeviceError> {
        let allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let inside =
            allocs.range(..=p.0).next_back().is_some_and(|(&base, a)| p.0 + bytes as u64 <= base + a.len as u64);
        if inside || bytes == 0 {
            Ok(())
        } else {
            Err(DeviceError::Bounds(format!("{what} of {bytes} bytes at {:#x} is outside every allocation", p.0)))
        }
    }
    /// Runs kernel `name` now (from the compute queue).
    fn run_kernel(
        &self,
        name: &'static str,
        entry: crate::kernels::EmuEntry,
        cfg: LaunchConfig,
        values: &mut [u64],
    ) -> Result<(), DeviceError> {
        // Each argument as its C value, 8 bytes of room each; `params[i]` points at argument `i`.
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        let launch = Launch { grid: cfg.grid, block: cfg.block };
        // SAFETY: the entry point unpacks exactly the kernel's parameters from `params` (its signature
        // fixes their number and types; the backend passes them in that order, the arity was checked when
        // queued), each pointing at a live 8-byte value in little-endian order, where a 4-byte value sits.
        let mut run = || unsafe { entry(&launch, params.as_mut_ptr()) };
        let rc = match &self.meter {
            Some(m) => m.lock().unwrap_or_else(|e| e.into_inner()).launch(name, run),
            None => run(),
        };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: the runtime keeps a NUL-terminated message per thread after a failed launch.
        let message = unsafe { CStr::from_ptr(osprey_emu_last_error()) }.to_string_lossy().into_owned();
        Err(DeviceError::Kernel { kernel: name.into(), message })
    }

    /// A GEMM with cuBLAS's semantics on the host (from the compute queue; bounds checked when queued):
    /// column-major, `op(X)[i, j]` is `X[i + j·ld]`, or `X[j + i·ld]` transposed; products of bf16 values
    /// are exact in f32, summed in `p` order.
    fn gemm_now(&self, g: GemmBf16) {
        let [a, b, c] = gemm_bytes(&g);
        let c_read = if g.beta == 0.0 { 0 } else { c };
        self.metered(|m| {
            m.touch(
                "cublasGemmEx",
                &[(g.a.0 .0, a, false), (g.b.0 .0, b, false), (g.c.0 .0, c_read, false), (g.c.0 .0, c, true)],
            )
        });
        let bf = |p: DevPtr, i: usize| {
            // SAFETY: inside the ranges checked when queued.
            f32::from_bits(u32::from(unsafe { *(p.0 as *const u16).add(i) }) << 16)
        };
        let (ta, tb) = (g.transa, g.transb);
        for j in 0..g.n {
            for i in 0..g.m {
                let mut acc = 0f32;
                for p in 0..g.k {
                    let a = bf(g.a.0, if ta { p + i * g.a.1 } else { i + p * g.a.1 });
                    let b = bf(g.b.0, if tb { j + p * g.b.1 } else { p + j * g.b.1 });
                    acc += a * b;
                }
                // SAFETY: inside C's range checked when queued.
                let c = unsafe { &mut *(g.c.0 .0 as *mut f32).add(i + j * g.c.1) };
                *c = g.alpha * acc + if g.beta == 0.0 { 0.0 } else { g.beta * *c };
            }
        }
    }
}

/// The bytes a GEMM's bf16 `A` and `B` and f32 `C` span in column-major storage with their leading
/// dimensions (what is bounds-checked when queued and metered when run).
fn gemm_bytes(g: &GemmBf16) -> [usize; 3] {
    let span = |rows: usize, cols: usize, ld: usize| if cols == 0 { 0 } else { (cols - 1) * ld + rows };
    let (rows_a, cols_a) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
    let (rows_b, cols_b) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
    [2 * span(rows_a, cols_a, g.a.1), 2 * span(rows_b, cols_b, g.b.1), 4 * span(g.m, g.n, g.c.1)]
}

impl DeviceLayer for EmuDevice {
    fn info(&self) -> DeviceInfo {
        // Reports sm_80, the oldest architecture the kernels target.
        DeviceInfo { name: "emulated CUDA device".into(), capability: (8, 0), total_memory: self.capacity, blas: true }
    }

    fn free_memory(&self) -> usize {
        self.capacity.saturating_sub(self.used.load(Ordering::Relaxed) as usize)
    }

    fn alloc(&self, bytes: usize) -> Result<DevPtr, DeviceError> {
        let n = self.allocations.fetch_add(1, Ordering::Relaxed) + 1;
        if n == self.fail_alloc.load(Ordering::Relaxed) {
            return Err(DeviceError::Kernel { kernel: "cuMemAlloc".into(), message: "injected driver error".into() });
        }
        let rounded = bytes.div_ceil(8).max(1) * 8;
        let available = self.free_memory();
        if rounded > available {
            return Err(DeviceError::OutOfMemory { requested: bytes, available });
        }
        let mem = vec![Block([0; 32]); rounded.div_ceil(256)].into_boxed_slice();
        let at = mem.as_ptr() as u64;
        self.used.fetch_add(rounded as u64, Ordering::Relaxed);
        self.allocs.lock().unwrap_or_else(|e| e.into_inner()).insert(at, Alloc { _mem: mem, len: rounded });
        self.metered(|m| m.region(at, rounded, true));
        Ok(DevPtr(at))
    }

    fn alloc_host(&self, bytes: usize) -> Result<osprey_backend::HostArena, DeviceError> {
        osprey_backend::HostArena::zeroed(bytes).ok_or(DeviceError::OutOfMemory { requested: bytes, available: 0 })
    }

    fn free(&self, p: DevPtr) -> Result<(), DeviceError> {
        // The work issued before may still read or fill it.
        let mut s = self.streams();
        self.drain(&mut s);
        if let Some(Alloc { len, .. }) = self.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&p.0) {
            self.used.fetch_sub(len as u64, Ordering::Relaxed);
            self.metered(|m| m.region(p.0, len, false));
        }
        s.take_fault()
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.check(dst, src.len(), "an upload")?;
        // Staged now (pageable memory), written in the compute stream's order.
        self.queue(Work::Write { dst, bytes: src.to_vec() })
    }

    unsafe fn upload_async(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<Event, DeviceError> {
        self.check(dst, len, "an asynchronous upload")?;
        let mut s = self.streams();
        let id = self.next_id();
        let after = s.copy_after;
        s.copies.push_back(CopyItem { id, dst, src: src as usize, len, after });
        if s.early(self.copy_order) {
            self.run_copies(&mut s, id);
        }
        Ok(Event(Event::COPY | id))
    }

    fn wait_event(&self, e: Event) -> Result<(), DeviceError> {
        if e.is_copy() {
            self.queue(Work::WaitCopy(e.0 & !Event::COPY))?;
        }
        Ok(())
    }

    fn copies_after(&self, e: Event) -> Result<(), DeviceError> {
        if !e.is_copy() {
            let mut s = self.streams();
            s.copy_after = s.copy_after.max(e.0);
        }
        Ok(())
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.check(src, dst.len(), "a download")?;
        let mut s = self.streams();
        let all = self.issued.load(Ordering::Relaxed);
        self.run_compute(&mut s, all);
        // SAFETY: inside a live allocation (checked above), which `dst` cannot alias.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.as_mut_ptr(), dst.len()) };
        self.metered(Meter::close_window);
        s.take_fault()
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.check(dst, bytes, "a copy's destination")?;
        self.check(src, bytes, "a copy's source")?;
        self.queue(Work::Copy { dst, src, len: bytes })
    }

    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.check(dst, bytes, "a memset")?;
        self.queue(Work::Zero { dst, len: bytes })
    }

    fn gemm_bf16(&self, g: GemmBf16) -> Result<(), DeviceError> {
        let [a, b, c] = gemm_bytes(&g);
        self.check(g.a.0, a, "a GEMM's A")?;
        self.check(g.b.0, b, "a GEMM's B")?;
        self.check(g.c.0, c, "a GEMM's C")?;
        self.queue(Work::Gemm(g))
    }

    fn launch(&self, name: &str, cfg: LaunchConfig, args: &[Arg]) -> Result<(), DeviceError> {
        let fault = |message: String| DeviceError::Kernel { kernel: name.into(), message };
        let (info, entry) = emu_entry(name).ok_or_else(|| fault("no such kernel in kernels/".into()))?;
        if cfg.is_empty() {
            return Err(fault(format!("a launch over no threads ({cfg:?}): invalid on a GPU, a bug in the caller")));
        }
        let n = self.launches.fetch_add(1, Ordering::Relaxed) + 1;
        if n == self.fail_launch.load(Ordering::Relaxed) {
            return Err(fault("injected fault (an illegal address, as a GPU would report it)".into()));
        }
        LAUNCHED.with(|l| l.borrow_mut().as_mut().map(|v| v.push(info.name)));
        if args.len() != info.arity {
            return Err(fault(format!("{} arguments for {} parameters: this is a bug", args.len(), info.arity)));
        }
        let args = args.iter().map(|a| a.bits()).collect();
        self.queue(Work::Launch { name: info.name, entry, cfg, args })
    }

    fn record(&self) -> Result<Event, DeviceError> {
        Ok(Event(self.issued.load(Ordering::Relaxed)))
    }

    fn is_complete(&self, e: Event) -> bool {
        let s = self.streams();
        let id = e.0 & !Event::COPY;
        if e.is_copy() {
            s.copies.front().is_none_or(|c| c.id > id)
        } else {
            id <= s.ran
        }
    }

    fn synchronize(&self, e: Event) -> Result<(), DeviceError> {
        let mut s = self.streams();
        let id = e.0 & !Event::COPY;
        if e.is_copy() {
            self.run_copies(&mut s, id);
        } else {
            self.run_compute(&mut s, id);
        }
        self.metered(Meter::close_window);
        s.take_fault()
    }

    fn traffic(&self) -> Option<Traffic> {
        self.metered(|m| m.totals())
    }

    fn graph_build(&self, nodes: &[Node], staging: *const u8) -> Result<GraphId, DeviceError> {
        let id = self.next_id();
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).insert(id, (nodes.to_vec(), staging as usize));
        Ok(GraphId(id))
    }

    fn graph_update(&self, g: GraphId, i: usize, node: &Node) -> Result<(), DeviceError> {
        let mut graphs = self.graphs.lock().unwrap_or_else(|e| e.into_inner());
        let slot = graphs.get_mut(&g.0).and_then(|(nodes, _)| nodes.get_mut(i));
        let slot = slot.ok_or_else(|| DeviceError::Bounds(format!("node {i} of graph {}", g.0)))?;
        *slot = node.clone();
        Ok(())
    }

    /// Queues the graph's nodes as the same launches, copies and writes issued one by one would be (the
    /// uploads read the staging memory when they run).
    fn graph_launch(&self, g: GraphId) -> Result<(), DeviceError> {
        let (nodes, staging) = self
            .graphs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&g.0)
            .cloned()
            .ok_or_else(|| DeviceError::Bounds(format!("graph {} launched after it was dropped", g.0)))?;
        for n in &nodes {
            match n {
                Node::Kernel { name, cfg, args } => self.launch(name, *cfg, args)?,
                Node::Upload { dst, at, len } => {
                    self.check(*dst, *len, "a graph's upload")?;
                    self.queue(Work::Stage { dst: *dst, src: staging + at, len: *len })?;
                }
                Node::Copy { dst, src, bytes } => self.copy(*dst, *src, *bytes)?,
                Node::Zero { dst, bytes } => self.zero(*dst, *bytes)?,
            }
        }
        Ok(())
    }

    fn graph_drop(&self, g: GraphId) {
        self.graphs.lock().unwrap_or_else(|e| e.into_inner()).remove(&g.0);
    }
}
