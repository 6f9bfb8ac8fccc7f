//! Which GEMM the fast precision may use for prefill-shaped matmuls, best first: the CLI's `--gemm`
//! lowers the ceiling to measure one kernel against another in one build, or to force a fallback.

use std::sync::atomic::{AtomicU8, Ordering};

/// A prefill GEMM kernel family, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Gemm {
    /// AMX-BF16 tiles, where the CPU has them and the kernel grants their state: bf16 weights, and
    /// NVFP4 weights decoded exactly into bf16 ([`crate::amx::bf16`]).
    Amx = 0,
    /// AMX-INT8 tiles for NVFP4 × int8 ([`crate::amx::int8`]): one tile product per 16-value block,
    /// each scaled on its own (docs/architecture.md: why it loses to the bf16 tiles).
    AmxInt8 = 1,
    /// NVFP4 × int8 on AVX-512 VNNI or AVX2 ([`crate::q8_gemm`]).
    Int8 = 2,
    /// bf16 tiles on AVX512-BF16 ([`crate::bf16`]).
    Bf16 = 3,
    /// f32 sgemm over widened weight tiles.
    F32 = 4,
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

impl Gemm {
    /// Every kernel family, best first.
    pub const ALL: [Gemm; 5] = [Gemm::Amx, Gemm::AmxInt8, Gemm::Int8, Gemm::Bf16, Gemm::F32];

    /// Its name as `--gemm` takes it (what [`std::str::FromStr`] reads back).
    pub fn name(self) -> &'static str {
        match self {
            Gemm::Amx => "amx",
            Gemm::AmxInt8 => "amx-int8",
            Gemm::Int8 => "int8",
            Gemm::Bf16 => "bf16",
            Gemm::F32 => "f32",
        }
    }
}

impl std::str::FromStr for Gemm {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" | "amx" => Ok(Gemm::Amx),
            "amx-int8" => Ok(Gemm::AmxInt8),
            "int8" => Ok(Gemm::Int8),
            "bf16" => Ok(Gemm::Bf16),
            "f32" => Ok(Gemm::F32),
            other => Err(format!("{other:?}: expected auto, amx, amx-int8, int8, bf16 or f32")),
        }
    }
}

/// A class of weights the prefill dispatch chooses a GEMM for on its own: NVFP4 (AMX-BF16 tiles,
/// AMX-INT8 tiles, the int8 GEMM, bf16 tiles, sgemm) and bf16 (AMX-BF16 tiles, bf16 tiles, sgemm).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum WeightClass {
    /// NVFP4 weights.
    Nvfp4 = 0,
    /// bf16 weights (and any other dense weights).
    Bf16 = 1,
}

impl WeightClass {
    /// Both classes.
    pub const ALL: [WeightClass; 2] = [WeightClass::Nvfp4, WeightClass::Bf16];

    /// Its name in logs and the calibration cache.
    pub fn name(self) -> &'static str {
        match self {
            WeightClass::Nvfp4 => "nvfp4",
            WeightClass::Bf16 => "bf16",
        }
    }
}

/// From this many rows a prefill GEMM counts as a dense projection's ([`Rows::Many`]), below it as a
/// routed expert's ([`Rows::Few`]: a 512-token chunk gives each of 256 experts ~16 rows). Kernels rank
/// differently by rows: on a Sapphire Rapids without AMX the AVX512-BF16 tiles ran a 16 × 512 × 2048
/// bf16 GEMM in 0.22 ms against sgemm's 0.36, and 128 × 1024 × 2048 in 3.4 ms against 2.5; one choice per
/// class took sgemm for both (docs/benchmarks.md).
pub const MANY_ROWS: usize = 64;

/// The row counts the calibration chooses a kernel for on their own (see [`MANY_ROWS`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Rows {
    /// Fewer than [`MANY_ROWS`]: a prefill chunk's routed experts, a batch of decodes.
    Few = 0,
    /// [`MANY_ROWS`] and more: a prefill chunk's dense projections.
    Many = 1,
}

impl Rows {
    /// Both, fewer first.
    pub const ALL: [Rows; 2] = [Rows::Few, Rows::Many];

    /// The band of a GEMM of `m` rows.
    pub fn of(m: usize) -> Rows {
        if m < MANY_ROWS {
            Rows::Few
        } else {
            Rows::Many
        }
    }
}

/// The best kernel each class may use at each band of rows: [`Gemm::Amx`] (all) until a calibration
/// measured a faster one lower down ([`prefer`]); the ceiling ([`set_gemm_ceiling`]) applies on top.
static PREFERRED: [[AtomicU8; 2]; 2] = [
    [AtomicU8::new(Gemm::Amx as u8), AtomicU8::new(Gemm::Amx as u8)],
    [AtomicU8::new(Gemm::Amx as u8), AtomicU8::new(Gemm::Amx as u8)],
];

/// Lets `class` use `best` and the kernels after it only at `rows` (what `crate::calibrate` measured
/// fastest).
pub fn prefer(class: WeightClass, rows: Rows, best: Gemm) {
    PREFERRED[class as usize][rows as usize].store(best as u8, Ordering::Relaxed);
}

/// Whether `class` may use `g` at `rows`: under the ceiling and at or after its preferred kernel.
pub fn allowed_for(class: WeightClass, rows: Rows, g: Gemm) -> bool {
    allowed(g) && PREFERRED[class as usize][rows as usize].load(Ordering::Relaxed) <= g as u8
}

/// The GEMM `class` takes for a prefill GEMM of `rows` on this CPU under the ceiling and its preference.
pub fn prefill_kernel(class: WeightClass, rows: Rows) -> Gemm {
    Gemm::ALL.into_iter().find(|&g| available(class, g) && allowed_for(class, rows, g)).unwrap_or(Gemm::F32)
}

/// Whether `g` can run `class` on this CPU (under no ceiling).
pub fn available(class: WeightClass, g: Gemm) -> bool {
    match g {
        Gemm::Amx => crate::amx::available(),
        Gemm::AmxInt8 => class == WeightClass::Nvfp4 && crate::amx::available(),
        Gemm::Int8 => class == WeightClass::Nvfp4 && crate::q8_gemm::available(),
        Gemm::Bf16 => crate::bf16::available(),
        Gemm::F32 => true,
    }
}

/// A kernel's name in logs.
pub fn kernel_name(class: WeightClass, g: Gemm) -> &'static str {
    match (class, g) {
        (_, Gemm::Amx) => "amx-bf16 tiles",
        (_, Gemm::AmxInt8) => "amx-int8 tiles",
        (_, Gemm::Int8) => crate::q8_gemm::name(),
        (_, Gemm::Bf16) => "bf16 tiles avx512-bf16",
        (_, Gemm::F32) => "f32 sgemm",
    }
}

/// The prefill GEMMs the fast precision runs on this CPU under the ceiling and the calibration, for the
/// startup log and benchmark headers: NVFP4's, then bf16's (and why AMX is not used, where the CPU
/// lists it).
pub fn prefill_kernels() -> String {
    let mut parts: Vec<String> = WeightClass::ALL
        .iter()
        .map(|&c| {
            let name = |g: Gemm| {
                let from = if matches!(g, Gemm::Amx | Gemm::AmxInt8) { " (from 16 rows)" } else { "" };
                format!("{}{from}", kernel_name(c, g))
            };
            let (few, many) = (prefill_kernel(c, Rows::Few), prefill_kernel(c, Rows::Many));
            if few == many {
                format!("{} {}", c.name(), name(few))
            } else {
                format!("{} {} below {MANY_ROWS} rows, {} from {MANY_ROWS}", c.name(), name(few), name(many))
            }
        })
        .collect();
    if crate::amx::status() == crate::amx::Status::Emulated {
        parts.push("amx emulated in software".into());
    }
    match crate::amx::status() {
        refused @ crate::amx::Status::Refused(_) => format!("{} ({})", parts.join(", "), refused.describe()),
        _ => parts.join(", "),
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
        if crate::amx::available() {
            paths.push("amx-int8");
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
