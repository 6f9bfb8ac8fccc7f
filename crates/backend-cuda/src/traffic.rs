//! The emulated device's meter of global-memory traffic (`emu/traffic.cpp`, which the kernels' compiled
//! loads and stores call): for each kernel, the distinct bytes its launches read and wrote, and for the
//! whole run the distinct bytes of each window between two host waits. Only a device made with
//! [`crate::EmuDevice::measuring`] meters (the hooks cost a call per access either way; the bitmaps only
//! when metering).

use std::collections::BTreeMap;
use std::ffi::c_void;

unsafe extern "C" {
    fn osprey_emu_traffic_new() -> *mut c_void;
    fn osprey_emu_traffic_drop(t: *mut c_void);
    fn osprey_emu_traffic_region(t: *mut c_void, base: u64, len: u64, live: i32);
    fn osprey_emu_traffic_begin(t: *mut c_void);
    fn osprey_emu_traffic_touch(t: *mut c_void, p: u64, len: u64, write: i32);
    fn osprey_emu_traffic_end(t: *mut c_void, out: *mut u64);
    fn osprey_emu_traffic_window(t: *mut c_void, out: *mut u64);
}

/// What a metered device measured since it was made.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Traffic {
    /// Per kernel (and `cublasGemmEx`, `memcpy`, `memset`): distinct bytes (read, written), summed over
    /// its launches.
    pub kernels: BTreeMap<String, (u64, u64)>,
    /// Distinct bytes (read, written) of each window between host waits, summed over the closed windows.
    pub windows: (u64, u64),
}

/// The C meter and its totals (one per metered device; used under the device's lock).
#[derive(Debug)]
pub(crate) struct Meter {
    raw: *mut c_void,
    totals: Traffic,
}

// SAFETY: the C meter is plain memory, used by one thread at a time (the device holds it in a mutex).
unsafe impl Send for Meter {}

impl Meter {
    pub(crate) fn new() -> Self {
        // SAFETY: allocates a fresh meter, freed in `drop`.
        Meter { raw: unsafe { osprey_emu_traffic_new() }, totals: Traffic::default() }
    }

    /// An allocation made (`live`) or freed.
    pub(crate) fn region(&mut self, base: u64, len: usize, live: bool) {
        // SAFETY: `raw` is live.
        unsafe { osprey_emu_traffic_region(self.raw, base, len as u64, i32::from(live)) };
    }

    /// Runs `f` (a launch on this thread) metered, under `name`.
    pub(crate) fn launch<T>(&mut self, name: &str, f: impl FnOnce() -> T) -> T {
        // SAFETY: `raw` is live; `begin` and `end` bracket `f` on this thread.
        unsafe { osprey_emu_traffic_begin(self.raw) };
        let r = f();
        self.end(name);
        r
    }

    /// Accesses the device makes outside a kernel, under `name`: (address, bytes, written).
    pub(crate) fn touch(&mut self, name: &str, spans: &[(u64, usize, bool)]) {
        // SAFETY: `raw` is live; `touch` only marks the meter's bitmaps.
        unsafe {
            osprey_emu_traffic_begin(self.raw);
            for &(p, len, write) in spans {
                osprey_emu_traffic_touch(self.raw, p, len as u64, i32::from(write));
            }
        }
        self.end(name);
    }

    fn end(&mut self, name: &str) {
        let mut out = [0u64; 4];
        // SAFETY: `raw` is live; `out` has the four slots `end` writes.
        unsafe { osprey_emu_traffic_end(self.raw, out.as_mut_ptr()) };
        let e = self.totals.kernels.entry(name.to_string()).or_default();
        (e.0, e.1) = (e.0 + out[0], e.1 + out[1]);
    }

    /// A host wait: closes the window under way.
    pub(crate) fn close_window(&mut self) {
        let mut out = [0u64; 2];
        // SAFETY: `raw` is live; `out` has the two slots `window` writes.
        unsafe { osprey_emu_traffic_window(self.raw, out.as_mut_ptr()) };
        self.totals.windows = (out[0], out[1]);
    }

    pub(crate) fn totals(&self) -> Traffic {
        self.totals.clone()
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        // SAFETY: `raw` came from `osprey_emu_traffic_new` and is dropped once.
        unsafe { osprey_emu_traffic_drop(self.raw) };
    }
}
