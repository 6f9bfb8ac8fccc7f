//! Issue 37: a model named by Hugging Face id is served from the standard Hugging Face cache. The cache
//! is built here from a fixture checkpoint exactly as the hub client lays it out (every file a blob under
//! `blobs/`, linked from `snapshots/<commit>/`, the branch in `refs/main`), and `osprey run` given the id
//! answers as it does given the directory.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::fake_hub::{self, FakeHub, Reply};

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

const HUB_COMMIT: &str = "2222222222222222222222222222222222222222";

/// The hub as it answers: the fixture's files, a gated repository that wants `Bearer good-token`, and
/// the first full download of the weights cut halfway.
fn hub(src: PathBuf) -> FakeHub {
    use std::sync::atomic::{AtomicBool, Ordering};
    let cut = AtomicBool::new(true);
    fake_hub::start(move |req| {
        if req.path.contains("/gated/") && req.auth != "Bearer good-token" {
            let body = b"{\"error\": \"Access to model gated/tiny is restricted.\"}".to_vec();
            return Reply::Full("401 Unauthorized", String::new(), body);
        }
        if let Some(rest) = req.path.strip_prefix("/api/models/") {
            assert!(rest.ends_with("/revision/main?blobs=true"), "{rest}");
            let body = fake_hub::listing(&src, HUB_COMMIT, &["README.md", "onnx/model.onnx", "pytorch_model.bin"]);
            return Reply::Full("200 OK", "Content-Type: application/json\r\n".into(), body.into_bytes());
        }
        assert!(req.path.contains(&format!("/resolve/{HUB_COMMIT}/")), "{}", req.path);
        match fake_hub::file(&src, req) {
            Reply::Full(status, headers, body)
                if req.path.ends_with("/model.safetensors")
                    && req.range.is_none()
                    && cut.swap(false, Ordering::SeqCst) =>
            {
                // The weights' first full download: all headers, half the body, then the line drops.
                let keep = body.len() / 2;
                Reply::Cut(status, headers, body, keep)
            }
            r => r,
        }
    })
}

fn osprey(args: &[&str], hub: &FakeHub, cache: &Path, token: Option<&str>) -> std::process::Output {
    fake_hub::osprey(args, &hub.url(), cache, token, std::time::Duration::from_secs(120))
}

/// Issue 37, item 1: `osprey pull` downloads from a server that answers as the hub does: only the files
/// a model needs; a download cut halfway fails, and the next pull resumes it from the byte where it
/// stopped (a `Range` from there) and ends with the same bytes; the pulled id then serves offline as the
/// directory does. A gated repository without a token is a clear error naming HF_TOKEN, and pulls with
/// one.
#[test]
fn osprey_pull_downloads_only_what_it_needs_resumes_and_asks_for_a_token() {
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen3_5-tiny");
    let cache = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("hf-pull");
    let _ = std::fs::remove_dir_all(&cache);
    let hub = hub(src.clone());
    let first = osprey(&["pull", "Osprey/tiny"], &hub, &cache, None);
    let err = String::from_utf8_lossy(&first.stderr);
    assert!(!first.status.success(), "the cut download failed: {err}");
    assert!(err.contains("model.safetensors"), "{err}");
    let weights = std::fs::metadata(src.join("model.safetensors")).expect("weights").len() as usize;
    let second = osprey(&["pull", "Osprey/tiny"], &hub, &cache, None);
    assert!(second.status.success(), "{}", String::from_utf8_lossy(&second.stderr));
    let snapshot = PathBuf::from(String::from_utf8_lossy(&second.stdout).trim());
    assert_eq!(snapshot, cache.join(format!("models--Osprey--tiny/snapshots/{HUB_COMMIT}")));
    for f in std::fs::read_dir(&src).expect("fixture") {
        let f = f.expect("entry").path();
        let name = f.file_name().expect("name");
        assert_eq!(
            std::fs::read(snapshot.join(name)).expect("pulled"),
            std::fs::read(&f).expect("fixture"),
            "{name:?}"
        );
    }
    let log = hub.requests();
    assert!(
        log.iter().all(|r| !r.path.ends_with("README.md") && !r.path.ends_with(".onnx") && !r.path.ends_with(".bin")),
        "{log:?}"
    );
    assert!(
        log.iter().any(|r| r.path.ends_with("/model.safetensors") && r.range == Some((weights / 2) as u64)),
        "no resume from byte {}: {log:?}",
        weights / 2
    );
    assert_eq!(std::fs::read_to_string(cache.join("models--Osprey--tiny/refs/main")).expect("ref"), HUB_COMMIT);
    // Pulled, it serves offline as the directory does.
    assert_eq!(run("Osprey/tiny", &cache), run(src.to_str().expect("utf-8"), &cache));
    // A gated repository: refused without a token, pulled with one.
    let refused = osprey(&["pull", "gated/tiny"], &hub, &cache, None);
    let err = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success() && err.contains("gated or private") && err.contains("HF_TOKEN"), "{err}");
    let wrong = osprey(&["pull", "gated/tiny"], &hub, &cache, Some("bad-token"));
    assert!(String::from_utf8_lossy(&wrong.stderr).contains("refused the token"), "{:?}", wrong);
    let pulled = osprey(&["pull", "gated/tiny"], &hub, &cache, Some("good-token"));
    assert!(pulled.status.success(), "{}", String::from_utf8_lossy(&pulled.stderr));
    // `--model` pulls what the cache lacks (not offline), then serves it.
    let _ = std::fs::remove_dir_all(cache.join("models--Osprey--tiny"));
    let out = osprey(
        &["run", "--model", "Osprey/tiny", "--prompt", "Describe the weather in Paris.", "--max-tokens", "4"],
        &hub,
        &cache,
        None,
    );
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
}
