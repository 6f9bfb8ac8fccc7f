//! Kernels through NVRTC (feature `cuda`): what the real device compiles at startup, and what CI
//! checks for every target card without one — each source compiles, and each kernel stays within the
//! register budget written above it, with no spill. NVRTC needs no driver: only `libnvrtc` (and its
//! builtins library) on the library path; a missing library is an error, never cudarc's panic.
//!
//! Options: `--fmad=false`, so a GPU rounds each product and sum as the emulated device (and the CPU
//! backend) does; the kernels are parity-first versions, and fused multiply-adds are a later, measured
//! choice per kernel.

use std::ffi::CString;

use cudarc::nvrtc::{result, sys};

/// The architectures CI compiles every kernel for: Ampere (A100, RTX 30xx), Ada (RTX 40xx), Hopper,
/// consumer Blackwell (RTX 50xx).
pub const TARGETS: &[&str] = &["sm_80", "sm_86", "sm_89", "sm_90", "sm_120"];

/// What one kernel uses on one architecture (from ptxas's report).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// The kernel.
    pub kernel: String,
    /// Registers per thread.
    pub registers: u32,
    /// Bytes spilled to local memory (stores + loads).
    pub spill_bytes: u32,
}

/// One source compiled for one architecture.
#[derive(Debug)]
pub struct Compiled {
    /// The cubin (for `sm_XY`) or PTX (for `compute_XY`).
    pub image: Vec<u8>,
    /// NVRTC's log (ptxas's report included).
    pub log: String,
    /// Per kernel, from the log (cubin targets only).
    pub usage: Vec<Usage>,
}

/// Why NVRTC could not be used or a source did not compile.
#[derive(Debug, thiserror::Error)]
pub enum NvrtcError {
    /// `libnvrtc` is not on the library path.
    #[error("libnvrtc not found: install it (pip install nvidia-cuda-nvrtc==13.0.88) and put its lib directory on LD_LIBRARY_PATH")]
    Missing,
    /// An unknown source.
    #[error("no kernel source {0}")]
    NoSource(String),
    /// Compilation failed.
    #[error("{source_name} for {arch}: {message}\n{log}")]
    Compile {
        /// The source stem.
        source_name: String,
        /// The target.
        arch: String,
        /// NVRTC's error.
        message: String,
        /// NVRTC's log.
        log: String,
    },
}

/// Whether `libnvrtc` can be loaded.
pub fn available() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// NVRTC's version (major, minor).
pub fn version() -> Result<(i32, i32), NvrtcError> {
    if !available() {
        return Err(NvrtcError::Missing);
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the call writes two ints.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }.result().map_err(|_| NvrtcError::Missing)?;
    Ok((major, minor))
}

/// Compiles source `stem` for `arch` (`sm_XY`: a cubin with ptxas's report; `compute_XY`: PTX).
pub fn compile(stem: &str, arch: &str) -> Result<Compiled, NvrtcError> {
    if !available() {
        return Err(NvrtcError::Missing);
    }
    let text = crate::kernels::gpu_source(stem).ok_or_else(|| NvrtcError::NoSource(stem.into()))?;
    let src = CString::new(text).map_err(|_| NvrtcError::NoSource(stem.into()))?;
    let name = CString::new(format!("{stem}.cu")).map_err(|_| NvrtcError::NoSource(stem.into()))?;
    let prog = result::create_program(&src, Some(&name)).map_err(|e| fail(stem, arch, e, String::new()))?;
    let cubin = arch.starts_with("sm_");
    let opts = [format!("--gpu-architecture={arch}"), "--fmad=false".into(), "--ptxas-options=-v".into()];
    // SAFETY: `prog` was created above and is destroyed once, below; `src` and `name` outlive it.
    unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog).map(|l| text_of(&l)).unwrap_or_default();
        let image = match compiled {
            Ok(()) if cubin => cubin_of(prog).map_err(|e| fail(stem, arch, e, log.clone())),
            Ok(()) => {
                result::get_ptx(prog).map(|p| text_of(&p).into_bytes()).map_err(|e| fail(stem, arch, e, log.clone()))
            }
            Err(e) => Err(fail(stem, arch, e, log.clone())),
        };
        let _ = result::destroy_program(prog);
        image.map(|image| Compiled { usage: if cubin { usage_of(&log) } else { Vec::new() }, image, log })
    }
}

fn fail(stem: &str, arch: &str, e: impl std::fmt::Debug, log: String) -> NvrtcError {
    NvrtcError::Compile { source_name: stem.into(), arch: arch.into(), message: format!("{e:?}"), log }
}

fn text_of(chars: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = chars.iter().take_while(|&&c| c != 0).map(|&c| c as u8).collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// The cubin of a compiled program.
///
/// # Safety
/// `prog` is a live, compiled program.
unsafe fn cubin_of(prog: sys::nvrtcProgram) -> Result<Vec<u8>, sys::nvrtcResult> {
    let mut size = 0usize;
    // SAFETY: per this function's contract.
    let rc = unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(rc);
    }
    let mut image = vec![0u8; size];
    // SAFETY: `image` holds the size NVRTC reported.
    let rc = unsafe { sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()) };
    if rc != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(rc);
    }
    Ok(image)
}

/// Registers and spills per kernel from ptxas's `-v` report:
/// `Compiling entry function 'K' for 'sm_90'`, `Function properties for K`,
/// `N bytes stack frame, S bytes spill stores, L bytes spill loads`, `Used R registers, …`.
pub fn usage_of(log: &str) -> Vec<Usage> {
    let mut out: Vec<Usage> = Vec::new();
    let mut props: Option<String> = None;
    for line in log.lines() {
        let quoted = || line.split('\'').nth(1).map(str::to_string);
        if line.contains("Compiling entry function") {
            if let Some(k) = quoted() {
                out.push(Usage { kernel: k, ..Usage::default() });
            }
        } else if let Some(rest) = line.split("Function properties for ").nth(1) {
            props = Some(rest.trim().to_string());
        } else if line.contains("spill stores") {
            let spill: u32 = line
                .split(',')
                .filter(|p| p.contains("spill"))
                .filter_map(|p| p.split_whitespace().next()?.parse::<u32>().ok())
                .sum();
            if let Some(u) = props.as_ref().and_then(|k| out.iter_mut().find(|u| &u.kernel == k)) {
                u.spill_bytes += spill;
            }
        } else if let Some(rest) = line.split("Used ").nth(1) {
            if let (Some(n), Some(u)) = (rest.split_whitespace().next().and_then(|n| n.parse().ok()), out.last_mut()) {
                u.registers = n;
            }
        }
    }
    out
}
