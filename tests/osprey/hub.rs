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

/// A local stand-in for the Hugging Face Hub: the two requests the `hf-hub` client makes (the repository's
/// file list, `GET /api/models/{id}/revision/{rev}`, and each file, `GET /{id}/resolve/{rev}/{file}` with
/// a `Range`, answered 206 with `x-repo-commit`, `etag` and `Content-Range` as the hub answers), a gated
/// repository that wants `Bearer good-token`, and the first full download of the weights cut halfway.
struct Hub {
    addr: std::net::SocketAddr,
    /// Every file request: (path, Range header).
    log: std::sync::Arc<std::sync::Mutex<Vec<(String, String)>>>,
}

const HUB_COMMIT: &str = "2222222222222222222222222222222222222222";

fn hub(src: PathBuf) -> Hub {
    use std::io::{BufRead, BufReader, Write};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::{Arc, Mutex};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let log = Arc::new(Mutex::new(Vec::new()));
    let cut = Arc::new(AtomicBool::new(true));
    let (log2, src2) = (log.clone(), src.clone());
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { continue };
            let (log, src, cut) = (log2.clone(), src2.clone(), cut.clone());
            std::thread::spawn(move || loop {
                let mut reader = BufReader::new(conn.try_clone().expect("clone"));
                let mut head = String::new();
                if reader.read_line(&mut head).unwrap_or(0) == 0 {
                    return;
                }
                let (mut range, mut auth) = (String::new(), String::new());
                loop {
                    let mut line = String::new();
                    reader.read_line(&mut line).expect("header");
                    let line = line.trim_end();
                    if line.is_empty() {
                        break;
                    }
                    let (k, v) = line.split_once(": ").unwrap_or((line, ""));
                    match k.to_ascii_lowercase().as_str() {
                        "range" => range = v.to_string(),
                        "authorization" => auth = v.to_string(),
                        _ => {}
                    }
                }
                let path = head.split_whitespace().nth(1).unwrap_or("/").to_string();
                let reply = |conn: &mut std::net::TcpStream, status: &str, headers: &str, body: &[u8]| {
                    let h = format!("HTTP/1.1 {status}\r\nContent-Length: {}\r\n{headers}\r\n", body.len());
                    conn.write_all(h.as_bytes()).and_then(|()| conn.write_all(body)).is_ok()
                };
                if path.contains("/gated/") && auth != "Bearer good-token" {
                    reply(
                        &mut conn,
                        "401 Unauthorized",
                        "",
                        b"{\"error\": \"Access to model gated/tiny is restricted.\"}",
                    );
                    continue;
                }
                if let Some(rest) = path.strip_prefix("/api/models/") {
                    assert!(rest.ends_with("/revision/main"), "{rest}");
                    let mut siblings: Vec<String> = std::fs::read_dir(&src)
                        .expect("fixture")
                        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
                        .collect();
                    siblings.extend(["README.md", "onnx/model.onnx", "pytorch_model.bin"].map(String::from));
                    let list: Vec<String> = siblings.iter().map(|f| format!("{{\"rfilename\": \"{f}\"}}")).collect();
                    let body = format!("{{\"sha\": \"{HUB_COMMIT}\", \"siblings\": [{}]}}", list.join(", "));
                    reply(&mut conn, "200 OK", "Content-Type: application/json\r\n", body.as_bytes());
                    continue;
                }
                let file = path.rsplit('/').next().unwrap_or_default().to_string();
                log.lock().expect("log").push((path.clone(), range.clone()));
                let Ok(bytes) = std::fs::read(src.join(&file)) else {
                    reply(&mut conn, "404 Not Found", "", b"");
                    continue;
                };
                let (from, to) = range
                    .strip_prefix("bytes=")
                    .and_then(|r| r.split_once('-'))
                    .map(|(a, b)| (a.parse::<usize>().unwrap_or(0), b.parse::<usize>().unwrap_or(bytes.len() - 1)))
                    .unwrap_or((0, bytes.len() - 1));
                let etag = format!(
                    "{:016x}{:024x}",
                    bytes.len(),
                    bytes.iter().fold(0u64, |h, b| h.wrapping_mul(31) ^ u64::from(*b))
                );
                let headers = format!(
                    "x-repo-commit: {HUB_COMMIT}\r\netag: \"{etag}\"\r\nContent-Range: bytes {from}-{to}/{}\r\n",
                    bytes.len()
                );
                let body = &bytes[from..=to];
                if file == "model.safetensors" && from == 0 && to > 0 && cut.swap(false, Ordering::SeqCst) {
                    // The weights' first full download: all headers, half the body, then the line drops.
                    let h = format!("HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\n{headers}\r\n", body.len());
                    let _ = conn.write_all(h.as_bytes()).and_then(|()| conn.write_all(&body[..body.len() / 2]));
                    return;
                }
                if !reply(&mut conn, "206 Partial Content", &headers, body) {
                    return;
                }
            });
        }
    });
    Hub { addr, log }
}

fn osprey(args: &[&str], hub: &Hub, cache: &Path, token: Option<&str>) -> std::process::Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_osprey"));
    c.args(args)
        .env("HF_ENDPOINT", format!("http://{}", hub.addr))
        .env("HF_HUB_CACHE", cache)
        .env("HF_HOME", cache.join("home"))
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN");
    if let Some(t) = token {
        c.env("HF_TOKEN", t);
    }
    c.output().expect("run osprey")
}

/// Issue 37, item 1: `osprey pull` downloads through the real `hf-hub` client from a server that answers
/// as the hub does: only the files a model needs; a download cut halfway fails, and the next pull resumes
/// it from the byte where it stopped (a `Range` from there) and ends with the same bytes; the pulled id
/// then serves offline as the directory does. A gated repository without a token is a clear error
/// naming HF_TOKEN, and pulls with one.
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
    let log = hub.log.lock().expect("log").clone();
    assert!(
        log.iter().all(|(p, _)| !p.ends_with("README.md") && !p.ends_with(".onnx") && !p.ends_with(".bin")),
        "{log:?}"
    );
    let resumed = format!("bytes={}-", weights / 2);
    assert!(
        log.iter().any(|(p, r)| p.ends_with("/model.safetensors") && *r == resumed),
        "no resume from {resumed}: {log:?}"
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
