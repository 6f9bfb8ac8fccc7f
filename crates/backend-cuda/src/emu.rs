//! The emulated device: device memory is host memory, a launch runs the kernel's host-compiled body
//! (`build.rs`, `emu/`) thread by thread on fibers, and every operation runs as it is issued, so every
//! event is complete. A test device (`--device cuda-emu`), never chosen by default: it is how the
//! kernels and the backend above them are checked on machines without a GPU. Allocations are tracked,
//! so a copy outside one is refused rather than corrupting the process, and the memory cap makes the
//! out-of-memory path testable.

use std::collections::BTreeMap;
use std::ffi::{c_void, CStr};

use crate::kernels::{emu_entry, Launch};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

use crate::device::{Arg, DevPtr, DeviceError, DeviceInfo, DeviceLayer, Event, GemmBf16, LaunchConfig};
use crate::traffic::{Meter, Traffic};

thread_local! {
    /// The kernels launched on this thread while [`launches_of`] records.
    static LAUNCHED: std::cell::RefCell<Option<Vec<&'static str>>> = const { std::cell::RefCell::new(None) };
}

/// Runs `f` and returns the kernels the emulated device launched on this thread meanwhile, in order:
/// which kernels an op's test runs (the emulated device launches on the calling thread).
pub fn launches_of(f: impl FnOnce()) -> Vec<&'static str> {
    let outer = LAUNCHED.with(|l| l.borrow_mut().replace(Vec::new()));
    f();
    LAUNCHED.with(|l| std::mem::replace(&mut *l.borrow_mut(), outer)).unwrap_or_default()
}

unsafe extern "C" {
    fn osprey_emu_last_error() -> *const std::ffi::c_char;
}

/// The emulated device (see the module docs).
#[derive(Debug)]
pub struct EmuDevice {
    /// Live allocations: address → the memory (8-byte aligned).
    allocs: Mutex<BTreeMap<u64, Box<[u64]>>>,
    /// Bytes allocated, and the cap.
    used: AtomicU64,
    capacity: usize,
    /// Operations issued (an event is the count when recorded).
    issued: AtomicU64,
    /// The copy stream: copies not yet run, in order (id, destination, source address, bytes). A copy
    /// runs only when something waits for it — the latest a device may run it — so a read of its
    /// destination that did not wait sees the old bytes, as a GPU may let it.
    copies: Mutex<Vec<(u64, DevPtr, usize, usize)>>,
    /// Injected faults (tests): the launch, and the allocation, that fail, counted from 1 (0: none).
    fail_launch: AtomicU64,
    fail_alloc: AtomicU64,
    launches: AtomicU64,
    allocations: AtomicU64,
    /// The meter of global-memory traffic ([`EmuDevice::measuring`]).
    meter: Option<Mutex<Meter>>,
}

impl EmuDevice {
    /// A device with `capacity` bytes of memory.
    pub fn new(capacity: usize) -> Self {
        EmuDevice {
            allocs: Mutex::new(BTreeMap::new()),
            used: AtomicU64::new(0),
            capacity,
            issued: AtomicU64::new(0),
            copies: Mutex::new(Vec::new()),
            fail_launch: AtomicU64::new(0),
            fail_alloc: AtomicU64::new(0),
            launches: AtomicU64::new(0),
            allocations: AtomicU64::new(0),
            meter: None,
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

    /// Runs the copy stream's copies up to event `id`.
    fn run_copies(&self, id: u64) {
        let mut copies = self.copies.lock().unwrap_or_else(|e| e.into_inner());
        let ready = copies.iter().take_while(|c| c.0 <= id).count();
        for (_, dst, src, len) in copies.drain(..ready) {
            // SAFETY: `upload_async`'s caller keeps `src` valid until this copy's event completes (now);
            // the destination was checked inside an allocation when the copy was queued.
            unsafe { std::ptr::copy_nonoverlapping(src as *const u8, dst.0 as *mut u8, len) };
        }
    }

    fn issue(&self) {
        self.issued.fetch_add(1, Ordering::Relaxed);
    }

    /// Checks that `[p, p + bytes)` lies inside one live allocation.
    fn check(&self, p: DevPtr, bytes: usize, what: &str) -> Result<(), DeviceError> {
        let allocs = self.allocs.lock().unwrap_or_else(|e| e.into_inner());
        let inside = allocs
            .range(..=p.0)
            .next_back()
            .is_some_and(|(&base, mem)| p.0 + bytes as u64 <= base + (mem.len() * 8) as u64);
        if inside || bytes == 0 {
            Ok(())
        } else {
            Err(DeviceError::Bounds(format!("{what} of {bytes} bytes at {:#x} is outside every allocation", p.0)))
        }
    }
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
        let mem = vec![0u64; rounded / 8].into_boxed_slice();
        let at = mem.as_ptr() as u64;
        self.used.fetch_add(rounded as u64, Ordering::Relaxed);
        self.allocs.lock().unwrap_or_else(|e| e.into_inner()).insert(at, mem);
        self.metered(|m| m.region(at, rounded, true));
        Ok(DevPtr(at))
    }

    fn alloc_host(&self, bytes: usize) -> Result<osprey_backend::HostArena, DeviceError> {
        osprey_backend::HostArena::zeroed(bytes).ok_or(DeviceError::OutOfMemory { requested: bytes, available: 0 })
    }

    fn free(&self, p: DevPtr) -> Result<(), DeviceError> {
        if let Some(mem) = self.allocs.lock().unwrap_or_else(|e| e.into_inner()).remove(&p.0) {
            self.used.fetch_sub((mem.len() * 8) as u64, Ordering::Relaxed);
            self.metered(|m| m.region(p.0, mem.len() * 8, false));
        }
        Ok(())
    }

    fn upload(&self, dst: DevPtr, src: &[u8]) -> Result<(), DeviceError> {
        self.check(dst, src.len(), "an upload")?;
        self.issue();
        // SAFETY: the range lies inside a live allocation (checked above), which `src` cannot alias.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst.0 as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn upload_async(&self, dst: DevPtr, src: *const u8, len: usize) -> Result<Event, DeviceError> {
        self.check(dst, len, "an asynchronous upload")?;
        let id = self.issued.fetch_add(1, Ordering::Relaxed) + 1;
        self.copies.lock().unwrap_or_else(|e| e.into_inner()).push((id, dst, src as usize, len));
        Ok(Event(Event::COPY | id))
    }

    fn wait_event(&self, e: Event) -> Result<(), DeviceError> {
        // The compute stream runs each operation as it is issued: its wait is the copies running now.
        if e.is_copy() {
            self.run_copies(e.0 & !Event::COPY);
        }
        Ok(())
    }

    fn copies_after(&self, _e: Event) -> Result<(), DeviceError> {
        // Compute ran when it was issued, and copies run later (when something waits for them).
        Ok(())
    }

    fn download(&self, src: DevPtr, dst: &mut [u8]) -> Result<(), DeviceError> {
        self.check(src, dst.len(), "a download")?;
        self.issue();
        // SAFETY: as in `upload`.
        unsafe { std::ptr::copy_nonoverlapping(src.0 as *const u8, dst.as_mut_ptr(), dst.len()) };
        self.metered(Meter::close_window);
        Ok(())
    }

    fn copy(&self, dst: DevPtr, src: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.check(dst, bytes, "a copy's destination")?;
        self.check(src, bytes, "a copy's source")?;
        self.issue();
        self.metered(|m| m.touch("memcpy", &[(src.0, bytes, false), (dst.0, bytes, true)]));
        // SAFETY: both ranges lie inside live allocations; `copy` allows overlap.
        unsafe { std::ptr::copy(src.0 as *const u8, dst.0 as *mut u8, bytes) };
        Ok(())
    }

    fn zero(&self, dst: DevPtr, bytes: usize) -> Result<(), DeviceError> {
        self.check(dst, bytes, "a memset")?;
        self.issue();
        self.metered(|m| m.touch("memset", &[(dst.0, bytes, true)]));
        // SAFETY: the range lies inside a live allocation.
        unsafe { std::ptr::write_bytes(dst.0 as *mut u8, 0, bytes) };
        Ok(())
    }

    fn gemm_bf16(&self, g: GemmBf16) -> Result<(), DeviceError> {
        // cuBLAS's semantics on the host: column-major, `op(X)[i, j]` is `X[i + j·ld]`, or `X[j + i·ld]`
        // transposed; products of bf16 values are exact in f32, summed in `p` order.
        let (rows_a, cols_a) = if g.transa { (g.k, g.m) } else { (g.m, g.k) };
        let (rows_b, cols_b) = if g.transb { (g.n, g.k) } else { (g.k, g.n) };
        let span = |rows: usize, cols: usize, ld: usize| if cols == 0 { 0 } else { (cols - 1) * ld + rows };
        self.check(g.a.0, 2 * span(rows_a, cols_a, g.a.1), "a GEMM's A")?;
        self.check(g.b.0, 2 * span(rows_b, cols_b, g.b.1), "a GEMM's B")?;
        self.check(g.c.0, 4 * span(g.m, g.n, g.c.1), "a GEMM's C")?;
        self.issue();
        let (a, b, c) = (2 * span(rows_a, cols_a, g.a.1), 2 * span(rows_b, cols_b, g.b.1), 4 * span(g.m, g.n, g.c.1));
        let c_read = if g.beta == 0.0 { 0 } else { c };
        self.metered(|m| {
            m.touch(
                "cublasGemmEx",
                &[(g.a.0 .0, a, false), (g.b.0 .0, b, false), (g.c.0 .0, c_read, false), (g.c.0 .0, c, true)],
            )
        });
        let bf = |p: DevPtr, i: usize| {
            // SAFETY: inside the ranges checked above.
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
                // SAFETY: inside C's checked range.
                let c = unsafe { &mut *(g.c.0 .0 as *mut f32).add(i + j * g.c.1) };
                *c = g.alpha * acc + if g.beta == 0.0 { 0.0 } else { g.beta * *c };
            }
        }
        Ok(())
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
        // Each argument as its C value, 8 bytes of room each; `params[i]` points at argument `i`.
        let mut values: Vec<u64> = args.iter().map(|a| a.bits()).collect();
        let mut params: Vec<*mut c_void> = values.iter_mut().map(|v| v as *mut u64 as *mut c_void).collect();
        let launch = Launch { grid: cfg.grid, block: cfg.block };
        self.issue();
        // SAFETY: the entry point unpacks exactly the kernel's parameters from `params` (its signature
        // fixes their number and types; the backend passes them in that order), each pointing at a live
        // 8-byte value in little-endian order, which is where a 4-byte value sits.
        let mut run = || unsafe { entry(&launch, params.as_mut_ptr()) };
        let rc = match &self.meter {
            Some(m) => m.lock().unwrap_or_else(|e| e.into_inner()).launch(info.name, run),
            None => run(),
        };
        if rc == 0 {
            return Ok(());
        }
        // SAFETY: the runtime keeps a NUL-terminated message per thread after a failed launch.
        let message = unsafe { CStr::from_ptr(osprey_emu_last_error()) }.to_string_lossy().into_owned();
        Err(fault(message))
    }

    fn record(&self) -> Result<Event, DeviceError> {
        Ok(Event(self.issued.load(Ordering::Relaxed)))
    }

    fn is_complete(&self, e: Event) -> bool {
        // Compute has run when it returns; a copy, once something waited for it.
        let id = e.0 & !Event::COPY;
        !e.is_copy() || self.copies.lock().unwrap_or_else(|e| e.into_inner()).first().is_none_or(|c| c.0 > id)
    }

    fn synchronize(&self, e: Event) -> Result<(), DeviceError> {
        if e.is_copy() {
            self.run_copies(e.0 & !Event::COPY);
        }
        self.metered(Meter::close_window);
        Ok(())
    }

    fn traffic(&self) -> Option<Traffic> {
        self.metered(|m| m.totals())
    }
}
