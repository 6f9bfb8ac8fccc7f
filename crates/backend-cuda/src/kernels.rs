//! The kernel sources (`kernels/*.cu`) and what the build learnt of them: each kernel's source file,
//! parameter count and register budget. The same text is compiled twice: by NVRTC for a GPU, behind
//! [`PRELUDE`] and `common.cuh` ([`gpu_source`]), and by the host compiler for the emulated device
//! (`build.rs`).

use std::ffi::c_void;

/// What NVRTC compiles before every source: fixed-width types, no CUDA header.
pub const PRELUDE: &str = include_str!("../kernels/prelude_gpu.cuh");

/// Helpers every kernel may use (conversions, reductions), for both compilers.
pub const COMMON: &str = include_str!("../kernels/common.cuh");

/// One kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// Its source file's stem (`norm` for `kernels/norm.cu`).
    pub source: &'static str,
    /// Its name.
    pub name: &'static str,
    /// Its parameter count (a launch passes exactly this many arguments).
    pub arity: usize,
    /// Registers per thread it may use on any target (written above it in its source); more, or any
    /// spill, fails the NVRTC check.
    pub registers: u32,
    /// PTX instructions its design names (the `// ptx:` line above it): the NVRTC check finds each in
    /// the kernel's PTX, so a rewrite that loses its vector loads or `dp4a` fails CI.
    pub ptx: &'static [&'static str],
}

/// Grid and block of one launch, as the emulator's `emu::Launch` reads them.
#[repr(C)]
pub(crate) struct Launch {
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
}

/// A kernel's entry point on the emulated device.
pub(crate) type EmuEntry = unsafe extern "C" fn(*const Launch, *mut *mut c_void) -> i32;

include!(concat!(env!("OUT_DIR"), "/emu_kernels.rs"));
include!(concat!(env!("OUT_DIR"), "/embedded.rs"));

/// The images NVRTC compiled when this binary was built (feature `cuda` with `libnvrtc` found by the
/// build): `(source stem, architecture, cubin or PTX)`; none otherwise.
pub fn embedded() -> &'static [(&'static str, &'static str, &'static [u8])] {
    EMBEDDED
}

/// Every kernel.
pub fn all() -> impl Iterator<Item = KernelInfo> {
    EMU_KERNELS.iter().map(|&(k, _)| k)
}

/// The kernel named `name`.
pub fn find(name: &str) -> Option<KernelInfo> {
    all().find(|k| k.name == name)
}

/// Every source stem.
pub fn sources() -> impl Iterator<Item = &'static str> {
    SOURCES.iter().map(|&(s, _)| s)
}

/// The text NVRTC compiles for source `stem`: the prelude, the helpers, the source.
pub fn gpu_source(stem: &str) -> Option<String> {
    SOURCES.iter().find(|&&(s, _)| s == stem).map(|&(_, text)| format!("{PRELUDE}\n{COMMON}\n{text}"))
}

/// The emulated entry point of `name`.
pub(crate) fn emu_entry(name: &str) -> Option<(KernelInfo, EmuEntry)> {
    EMU_KERNELS.iter().find(|(k, _)| k.name == name).copied()
}
