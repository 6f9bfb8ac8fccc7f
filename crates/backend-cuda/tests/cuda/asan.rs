//! The emulated kernels built with AddressSanitizer and UBSan (`emu/asan_harness.cpp`, compiled here by
//! the host C++ compiler): every kernel family runs on buffers of exactly the size it may touch, and a
//! planted off-by-one must be reported. Skipped, with the reason printed, where no C++ compiler with the
//! sanitizer runtimes is installed (CI installs g++).

use std::path::{Path, PathBuf};
use std::process::Command;

/// The sanitizer flags, for the probe and the harness alike.
const FLAGS: [&str; 5] = ["-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"];

/// Whether the C++ compiler links a sanitized program here: a trivial one, so that a harness that does
/// not compile fails the test instead of passing for a machine's missing runtime (the harness's own
/// file name holds "asan", so its compile errors once read as one, and it went unbuilt for weeks).
fn sanitizers() -> Result<(), String> {
    let dir = std::env::temp_dir();
    let (src, exe) = (
        dir.join(format!("osprey-asan-probe-{}.cpp", std::process::id())),
        dir.join(format!("osprey-asan-probe-{}", std::process::id())),
    );
    std::fs::write(&src, "int main() { return 0; }\n").map_err(|e| e.to_string())?;
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args(FLAGS)
        .arg(&src)
        .arg("-o")
        .arg(&exe)
        .output();
    let _ = (std::fs::remove_file(&src), std::fs::remove_file(&exe));
    match out {
        Ok(o) if o.status.success() => Ok(()),
        Ok(o) => Err(String::from_utf8_lossy(&o.stderr).lines().next().unwrap_or("").to_string()),
        Err(e) => Err(format!("no C++ compiler ({e})")),
    }
}

fn harness() -> Option<PathBuf> {
    if let Err(why) = sanitizers() {
        eprintln!("skipped: the C++ compiler links no sanitized program here: {why}");
        return None;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = std::env::temp_dir().join(format!("osprey-emu-asan-{}", std::process::id()));
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args(FLAGS)
        .arg("-I")
        .arg(root.join("emu"))
        .arg("-I")
        .arg(root.join("kernels"))
        .arg(root.join("emu/runtime.cpp"))
        .arg(root.join("emu/asan_harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("the compiler ran for the probe");
    assert!(out.status.success(), "the ASan harness does not build:\n{}", String::from_utf8_lossy(&out.stderr));
    Some(exe)
}

#[test]
fn every_kernel_family_stays_in_bounds_under_asan_and_ubsan_and_a_planted_overflow_is_caught() {
    let Some(exe) = harness() else { return };
    let ok = Command::new(&exe).output().expect("run the harness");
    let text = String::from_utf8_lossy(&ok.stdout).into_owned() + &String::from_utf8_lossy(&ok.stderr);
    assert!(ok.status.success(), "a sanitizer reported:\n{text}");
    assert!(text.contains("every kernel ran within its buffers"), "{text}");
    let planted = Command::new(&exe).arg("plant").output().expect("run the planted bug");
    let err = String::from_utf8_lossy(&planted.stderr);
    assert!(!planted.status.success() && err.contains("heap-buffer-overflow"), "the planted off-by-one:\n{err}");
    let _ = std::fs::remove_file(exe);
}
