//! Issue 37: a model named by Hugging Face id is served from the standard Hugging Face cache. The cache
//! is built here from a fixture checkpoint exactly as the hub client lays it out (every file a blob under
//! `blobs/`, linked from `snapshots/<commit>/`, the branch in `refs/main`), and `osprey run` given the id
//! answers as it does given the directory.

use std::path::{Path, PathBuf};
use std::process::Command;

fn run(model: &str, cache: &Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_osprey"))
        .args(["run", "--model", model, "--prompt", "Describe the weather in Paris.", "--max-tokens", "4"])
        .env("HF_HUB_CACHE", cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run osprey");
    assert!(out.status.success(), "{model}: {}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn a_model_named_by_its_hub_id_is_served_from_the_hf_cache() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen3_5-tiny");
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hf-cache");
    let _ = std::fs::remove_dir_all(&cache);
    let commit = "1111111111111111111111111111111111111111";
    let repo = cache.join("models--Osprey--qwen3_5-tiny");
    let snap = repo.join("snapshots").join(commit);
    for d in [repo.join("blobs"), snap.clone(), repo.join("refs")] {
        std::fs::create_dir_all(d).expect("mkdir");
    }
    for (i, f) in std::fs::read_dir(&src).expect("fixture").enumerate() {
        let f = f.expect("entry").path();
        let blob = format!("{i:040x}");
        std::fs::copy(&f, repo.join("blobs").join(&blob)).expect("blob");
        std::os::unix::fs::symlink(format!("../../blobs/{blob}"), snap.join(f.file_name().expect("name")))
            .expect("link");
    }
    std::fs::write(repo.join("refs/main"), commit).expect("ref");
    let by_dir = run(src.to_str().expect("utf-8"), &cache);
    assert_eq!(run("Osprey/qwen3_5-tiny", &cache), by_dir);
    assert_eq!(run(&format!("Osprey/qwen3_5-tiny@{commit}"), &cache), by_dir);
    // Offline and not in the cache: a clear error, no download.
    let out = Command::new(env!("CARGO_BIN_EXE_osprey"))
        .args(["run", "--model", "Osprey/not-here", "--prompt", "hi"])
        .env("HF_HUB_CACHE", &cache)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .expect("run osprey");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("HF_HUB_OFFLINE"), "{err}");
}
