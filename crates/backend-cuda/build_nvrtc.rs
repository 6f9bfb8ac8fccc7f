//! Part of `build.rs` with the `cuda` feature: every kernel source compiled by NVRTC at build time, when
//! the build finds `libnvrtc` (CI, the GPU kit): cubins for each target card and PTX for `compute_80`,
//! embedded in the binary, so a machine with only the NVIDIA driver starts without NVRTC (`src/images.rs`
//! picks the image). Without NVRTC the build embeds nothing and says so; the kernels are then compiled
//! at the first start.

use std::ffi::{c_char, c_int, c_void, CString};

type Prog = *mut c_void;

/// NVRTC's entry points, loaded from the library on the library path.
pub struct Nvrtc {
    _lib: libloading::Library,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> c_int,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> c_int,
    size: [unsafe extern "C" fn(Prog, *mut usize) -> c_int; 2],
    get: [unsafe extern "C" fn(Prog, *mut c_char) -> c_int; 2],
    destroy: unsafe extern "C" fn(*mut Prog) -> c_int,
}

impl Nvrtc {
    /// NVRTC 13 if the library loads.
    pub fn open() -> Option<Nvrtc> {
        // SAFETY: loading NVRTC runs no initialiser with preconditions; each symbol is NVRTC's C API with
        // the signature written here (nvrtc.h).
        unsafe {
            let lib = ["libnvrtc.so.13", "libnvrtc.so"].into_iter().find_map(|n| libloading::Library::new(n).ok())?;
            let create = *lib.get(b"nvrtcCreateProgram\0").ok()?;
            let compile = *lib.get(b"nvrtcCompileProgram\0").ok()?;
            let size = [*lib.get(b"nvrtcGetCUBINSize\0").ok()?, *lib.get(b"nvrtcGetPTXSize\0").ok()?];
            let get = [*lib.get(b"nvrtcGetCUBIN\0").ok()?, *lib.get(b"nvrtcGetPTX\0").ok()?];
            let destroy = *lib.get(b"nvrtcDestroyProgram\0").ok()?;
            Some(Nvrtc { _lib: lib, create, compile, size, get, destroy })
        }
    }

    /// `text` compiled for `arch` (`sm_XY`: a cubin; `compute_XY`: PTX, NUL-terminated), as
    /// `src/nvrtc.rs` compiles it at run time.
    pub fn compile(&self, name: &str, text: &str, arch: &str) -> Result<Vec<u8>, String> {
        let src = CString::new(text).map_err(|e| e.to_string())?;
        let name = CString::new(name).map_err(|e| e.to_string())?;
        let opts: Vec<CString> = [format!("--gpu-architecture={arch}"), "--fmad=false".into()]
            .into_iter()
            .map(|o| CString::new(o).expect("no NUL in an option"))
            .collect();
        let ptrs: Vec<*const c_char> = opts.iter().map(|o| o.as_ptr()).collect();
        let which = usize::from(!arch.starts_with("sm_"));
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: NVRTC's documented call sequence on a program created here and destroyed once; every
        // pointer passed outlives the calls, and the image buffer holds the size NVRTC reported.
        unsafe {
            if (self.create)(&mut prog, src.as_ptr(), name.as_ptr(), 0, std::ptr::null(), std::ptr::null()) != 0 {
                return Err(format!("nvrtcCreateProgram failed for {arch}"));
            }
            let rc = (self.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr());
            let mut n = 0usize;
            let image = if rc == 0 && (self.size[which])(prog, &mut n) == 0 {
                let mut image = vec![0u8; n];
                ((self.get[which])(prog, image.as_mut_ptr().cast()) == 0).then_some(image)
            } else {
                None
            };
            (self.destroy)(&mut prog);
            image.ok_or_else(|| format!("NVRTC could not compile it for {arch} (error {rc})"))
        }
    }
}
