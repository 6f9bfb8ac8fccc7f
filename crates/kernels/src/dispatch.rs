//! Which GEMM the fast precision may use for prefill-shaped matmuls, best first: the CLI's `--gemm`
//! lowers the ceiling to measure one kernel against another in one build, or to force a fallback.

use std::sync::atomic::{AtomicU8, Ordering};

/// A prefill GEMM kernel family, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Gemm {
    /// AMX tiles (bf16 and int8), where the CPU has them and the kernel grants their state.
    Amx = 0,
    /// NVFP4 × int8 on AVX-512 VNNI ([`crate::q8_gemm`]).
    Int8 = 1,
    /// bf16 tiles on AVX512-BF16 ([`crate::bf16`]).
    Bf16 = 2,
    /// f32 sgemm over widened weight tiles.
    F32 = 3,
}

/// The ceiling before anything set it: read from `OSPREY_GEMM` on first use.
const UNSET: u8 = u8::MAX;
static CEILING: AtomicU8 = AtomicU8::new(UNSET);

/// Lets prefill GEMMs use `best` and the kernels after it only (process-wide; `Gemm::Amx`, the
/// default, allows all).
pub fn set_gemm_ceiling(best: Gemm) {
    CEILING.store(best as u8, Ordering::Relaxed);
}

/// Whether the ceiling allows `g`. Until [`set_gemm_ceiling`] is called, the ceiling is
/// `OSPREY_GEMM` (`auto`, `amx`, `int8`, `bf16`, `f32`; unset or unknown: `auto`), so that a whole
/// process, a test binary included, can be run with one path forced (the kernels' tests run once per
/// path the CPU has: `tests::the_kernel_tests_pass_with_each_gemm_forced`).
pub fn allowed(g: Gemm) -> bool {
    let mut c = CEILING.load(Ordering::Relaxed);
    if c == UNSET {
        let from_env = std::env::var("OSPREY_GEMM").ok().and_then(|v| v.parse::<Gemm>().ok()).unwrap_or(Gemm::Amx);
        c = match CEILING.compare_exchange(UNSET, from_env as u8, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => from_env as u8,
            Err(set) => set,
        };
    }
    c <= g as u8
}

impl std::str::FromStr for Gemm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "amx" => Ok(Gemm::Amx),
            "int8" => Ok(Gemm::Int8),
            "bf16" => Ok(Gemm::Bf16),
            "f32" => Ok(Gemm::F32),
            other => Err(format!("{other:?}: expected auto, amx, int8, bf16 or f32")),
        }
    }
}

/// The prefill GEMMs the fast precision runs on this CPU under the ceiling, for the startup log and
/// benchmark headers: NVFP4's, then bf16's (and why AMX is not used, where the CPU lists it).
pub fn prefill_kernels() -> String {
    let amx = allowed(Gemm::Amx) && crate::amx::available();
    if amx {
        let how = if crate::amx::status() == crate::amx::Status::Emulated { ", emulated in software" } else { "" };
        return format!("nvfp4 amx-int8 tiles, bf16 amx-bf16 tiles (from 16 rows{how})");
    }
    let nvfp4 = if crate::q8_gemm::available() && allowed(Gemm::Int8) {
        "nvfp4 int8 gemm avx512-vnni"
    } else if crate::bf16::available() && allowed(Gemm::Bf16) {
        "nvfp4 bf16 tiles avx512-bf16"
    } else {
        "nvfp4 f32 sgemm"
    };
    let bf16 =
        if crate::bf16::available() && allowed(Gemm::Bf16) { "bf16 tiles avx512-bf16" } else { "bf16 f32 sgemm" };
    match crate::amx::status() {
        refused @ crate::amx::Status::Refused(_) => format!("{nvfp4}, {bf16} ({})", refused.describe()),
        _ => format!("{nvfp4}, {bf16}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Issue 49: every kernel test holds whichever GEMM the dispatch may pick. This test binary runs
    /// again once per path below the default that this CPU has (`OSPREY_GEMM` caps the dispatch), so an
    /// AVX-512 or AMX machine also proves the paths an AVX2-only one takes. Mutation-checked: a test
    /// that assumes the bf16 tiles whatever the ceiling fails under `OSPREY_GEMM=f32`.
    #[test]
    fn the_kernel_tests_pass_with_each_gemm_forced() {
        if std::env::var_os("OSPREY_GEMM").is_some() {
            return; // a forced run: its other tests are the point
        }
        let mut paths = vec!["f32"];
        if crate::bf16::available() {
            paths.push("bf16");
        }
        if crate::q8_gemm::available() {
            paths.push("int8");
        }
        let exe = std::env::current_exe().expect("test binary");
        for p in paths {
            let out = std::process::Command::new(&exe)
                .env("OSPREY_GEMM", p)
                .args(["--skip", "the_kernel_tests_pass_with_each_gemm_forced", "--skip", "timing::"])
                .output()
                .expect("run the kernel tests");
            assert!(
                out.status.success(),
                "OSPREY_GEMM={p}: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        assert!("int8".parse::<Gemm>() == Ok(Gemm::Int8) && "x".parse::<Gemm>().is_err());
    }
}
