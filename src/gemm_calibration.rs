//! `--gemm auto` (the default): the prefill GEMM for each weight class chosen by measuring
//! ([`osprey_kernels::calibrate`]) once per CPU model, thread count, osprey version and set of kernels the
//! build has for this CPU (a build that gained one measures again), and cached under
//! `gemm-calibration/` in [`crate::cache_root`]. The kernels round differently, so every process on a
//! machine must take the same choice: the first to publish the cache entry wins (it is linked into
//! place, which fails when it exists), and a process that finds an entry already there takes it instead
//! of its own measurement, before any model work. docs/architecture.md, "Prefill GEMMs".

use std::io::Write;
use std::path::PathBuf;

use blake2::digest::{Update, VariableOutput};

use osprey_kernels::calibrate::{calibrate, Calibration};

/// The cache entry for this CPU, thread count and build.
fn entry() -> Option<PathBuf> {
    let base = crate::cache_root()?;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| s.lines().find(|l| l.starts_with("model name")).map(str::to_string))
        .unwrap_or_default();
    let key = key(&cpu, osprey_kernels::threads(), !cfg!(debug_assertions));
    let mut h = blake2::Blake2bVar::new(8).ok()?;
    h.update(key.as_bytes());
    let mut d = [0u8; 8];
    h.finalize_variable(&mut d).ok()?;
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    Some(base.join("gemm-calibration").join(format!("{hex}.txt")))
}

/// What a choice depends on: the CPU, the thread count, the version, the kernels the build has for the
/// CPU, and whether the build is optimised. An unoptimised build (`cargo test`'s: opt-level 1 for the
/// workspace's kernels, 3 for dependencies such as matrixmultiply's sgemm) times its own kernels slow
/// and chose sgemm over the int8 GEMM (10.7 against 14.4 ms, where a release build measures 4.9 against
/// 1.5); its entry, under a key without this, then gave a release `serve` on the same machine sgemm:
/// prefill 183 tok/s instead of 437 (2026-12-07, docs/benchmarks.md).
fn key(cpu: &str, threads: usize, optimized: bool) -> String {
    let build = if optimized { "optimized" } else { "unoptimized" };
    // "rows": an entry holds a choice per band of rows (an older entry, one a class, is not read).
    format!(
        "{cpu}|threads={threads}|{}|{}|{build}|rows",
        env!("CARGO_PKG_VERSION"),
        osprey_kernels::calibrate::candidates()
    )
}

/// The cached choice, if one is there and readable.
fn cached(path: &std::path::Path) -> Option<Calibration> {
    let line = std::fs::read_to_string(path).ok()?;
    Calibration::from_choices_line(line.trim())
}

/// Chooses and applies the prefill GEMMs: the cached choice, else a measurement (written to the cache,
/// unless another process wrote one first, which is then taken).
pub fn auto() {
    let path = entry();
    if let Some(c) = path.as_deref().and_then(cached) {
        c.apply();
        tracing::info!(choice = %c.choices_line(), "prefill GEMMs from the calibration cache");
        return;
    }
    let t = std::time::Instant::now();
    let measured = calibrate();
    let ms = t.elapsed().as_secs_f64() * 1e3;
    let mut chosen = measured.clone();
    if let Some(p) = &path {
        // Written whole to a file of this process, then linked to the entry's name, which fails when
        // the entry exists: the entry appears complete, and the first process to link it wins.
        let _ = std::fs::create_dir_all(p.parent().unwrap_or(p));
        let tmp = p.with_extension(format!("{}.tmp", std::process::id()));
        let written = std::fs::File::create(&tmp).and_then(|mut f| f.write_all(measured.choices_line().as_bytes()));
        if written.is_ok() && std::fs::hard_link(&tmp, p).is_err() {
            // Another process measured first: one choice per machine.
            chosen = cached(p).unwrap_or(measured.clone());
        }
        let _ = std::fs::remove_file(&tmp);
    }
    chosen.apply();
    tracing::info!(ms = format!("{ms:.0}"), choice = %chosen.choices_line(), "prefill GEMMs measured: {}", measured.describe());
}

#[cfg(test)]
mod tests {
    use super::key;

    /// A test build's measurement never becomes a release build's choice: the two keep separate entries.
    #[test]
    fn an_unoptimised_build_keeps_its_own_entry() {
        assert_ne!(key("cpu", 2, true), key("cpu", 2, false));
        assert_eq!(key("cpu", 2, true), key("cpu", 2, true));
        assert_ne!(key("cpu", 2, true), key("cpu", 4, true));
    }
}
