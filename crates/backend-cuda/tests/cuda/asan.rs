//! The emulated kernels built with AddressSanitizer and UBSan (`emu/asan_harness.cpp`, compiled here by
//! the host C++ compiler): every kernel family runs on buffers of exactly the size it may touch, and a
//! planted off-by-one must be reported. Skipped, with the reason printed, where no C++ compiler with the
//! sanitizer runtimes is installed (CI installs g++).

use std::path::{Path, PathBuf};
use std::process::Command;

fn harness() -> Option<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = std::env::temp_dir().join(format!("osprey-emu-asan-{}", std::process::id()));
    let out = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
        .args(["-std=c++17", "-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"])
        .arg("-I")
        .arg(root.join("emu"))
        .arg("-I")
        .arg(root.join("kernels"))
        .arg(root.join("emu/runtime.cpp"))
        .arg(root.join("emu/asan_harness.cpp"))
        .arg("-o")
        .arg(&exe)
        .output();
    match out {
        Ok(o) if o.status.success() => Some(exe),
        Ok(o) => {
            let err = String::from_utf8_lossy(&o.stderr);
            // A missing sanitizer runtime is this machine's lack; anything else is our bug.
            assert!(err.contains("asan") || err.contains("ubsan"), "the ASan harness does not build:\n{err}");
            eprintln!("skipped: no sanitizer runtime for the C++ compiler ({})", err.lines().next().unwrap_or(""));
            None
        }
        Err(e) => {
            eprintln!("skipped: no C++ compiler ({e})");
            None
        }
    }
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
