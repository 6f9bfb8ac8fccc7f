//! Issue 49, item 1: a hostile hub cannot write outside the cache, hang a pull, or take the token to
//! another host. Each test pulls from a fake hub (`fake_hub.rs`) inside a sandbox directory whose
//! `cache/` is the hub cache and checks that nothing else in the sandbox appeared. hf-hub 0.4 named files
//! after the `etag` and `x-repo-commit` headers: an absolute or `../` value wrote anywhere; osprey's own
//! client ignores both and names files after the listed, checked digests and commit.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::fake_hub::{self, Reply};

const COMMIT: &str = "3333333333333333333333333333333333333333";
const LIMIT: Duration = Duration::from_secs(90);

fn fixture() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen3_5-tiny")
}

/// A fresh sandbox: (root, cache inside it).
fn sandbox(tag: &str) -> (PathBuf, PathBuf) {
    let root = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("hostile-hub-{tag}"));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(root.join("cache")).expect("sandbox");
    let cache = root.join("cache");
    (root, cache)
}

/// Everything in `root` outside `root/cache` (links not followed).
fn outside_cache(root: &Path) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(root).expect("sandbox") {
        let p = e.expect("entry").path();
        if p.file_name().is_some_and(|n| n != "cache") {
            found.push(p);
        }
    }
    found
}

/// The listing is honest (the fixture's files at `commit`); file answers are `file` of the honest one.
fn hub_with(
    commit: String,
    file: impl Fn(&fake_hub::Req, Reply) -> Reply + Send + Sync + 'static,
) -> fake_hub::FakeHub {
    let src = fixture();
    fake_hub::start(move |req| {
        if req.path.starts_with("/api/models/") {
            return Reply::Full("200 OK", String::new(), fake_hub::listing(&src, &commit, &[]).into_bytes());
        }
        file(req, fake_hub::file(&src, req))
    })
}

fn pull(hub: &fake_hub::FakeHub, cache: &Path) -> (bool, String) {
    let out = fake_hub::osprey(&["pull", "Evil/model"], &hub.url(), cache, None, LIMIT);
    assert_ne!(out.status.code(), Some(101), "panicked: {}", String::from_utf8_lossy(&out.stderr));
    (out.status.success(), String::from_utf8_lossy(&out.stderr).into_owned())
}

#[test]
fn etag_and_commit_headers_naming_paths_write_nothing_outside_the_cache() {
    for (tag, evil) in [("abs", None), ("rel", Some("../../../outside/PWNED"))] {
        let (root, cache) = sandbox(&format!("etag-{tag}"));
        let evil = evil.map(String::from).unwrap_or_else(|| root.join("outside/PWNED").display().to_string());
        let header = format!("etag: \"{evil}\"\r\nx-linked-etag: \"{evil}\"\r\nx-repo-commit: {evil}\r\n");
        let hub = hub_with(COMMIT.into(), move |_, r| match r {
            Reply::Full(s, h, b) => Reply::Full(s, format!("{h}{header}"), b),
            r => r,
        });
        let (ok, err) = pull(&hub, &cache);
        assert!(ok, "{tag}: the headers are not ours to trust, the files are fine: {err}");
        let snap = cache.join(format!("models--Evil--model/snapshots/{COMMIT}"));
        assert!(snap.join("config.json").is_file(), "{tag}");
        assert_eq!(outside_cache(&root), Vec::<PathBuf>::new(), "{tag}");
    }
}

#[test]
fn a_commit_that_is_a_path_is_refused_before_anything_is_written() {
    for (tag, evil) in [("abs", None), ("rel", Some("../../../outside/snap"))] {
        let (root, cache) = sandbox(&format!("commit-{tag}"));
        let evil = evil.map(String::from).unwrap_or_else(|| root.join("outside/snap").display().to_string());
        let hub = hub_with(evil, |_, r| r);
        let (ok, err) = pull(&hub, &cache);
        assert!(!ok && err.contains("not 40 hex digits"), "{tag}: {err}");
        assert_eq!(outside_cache(&root), Vec::<PathBuf>::new(), "{tag}");
        assert!(!cache.join("models--Evil--model/refs").exists(), "{tag}: a ref was written");
        assert!(hub.requests().iter().all(|r| r.path.starts_with("/api/")), "{tag}: a file was fetched");
    }
}

/// Short, long and altered bodies are refused; none becomes a blob or marks the snapshot whole.
#[test]
fn every_file_is_checked_against_its_listed_size_and_hash() {
    type Alter = fn(&str, Vec<u8>) -> Vec<u8>;
    let cases: [(&str, Alter, &str); 3] = [
        ("short", |name, b| if name == "config.json" { b[..1].to_vec() } else { b }, "ended at byte 1"),
        (
            "long",
            |name, mut b| {
                if name == "config.json" {
                    b.extend(std::iter::repeat_n(b' ', 55 << 20));
                }
                b
            },
            "longer than",
        ),
        (
            "altered",
            |name, mut b| {
                if name == "model.safetensors" {
                    let last = b.len() - 1;
                    b[last] ^= 1;
                }
                b
            },
            "hash to",
        ),
    ];
    for (tag, alter, want) in cases {
        let (root, cache) = sandbox(&format!("size-{tag}"));
        let hub = hub_with(COMMIT.into(), move |req, r| match r {
            Reply::Full(s, h, b) => Reply::Full(s, h, alter(req.path.rsplit('/').next().unwrap_or_default(), b)),
            r => r,
        });
        let (ok, err) = pull(&hub, &cache);
        assert!(!ok && err.contains(want), "{tag}: {err}");
        let snap = cache.join(format!("models--Evil--model/snapshots/{COMMIT}"));
        assert!(!snap.join("config.json").exists(), "{tag}: the snapshot was marked whole");
        assert_eq!(outside_cache(&root), Vec::<PathBuf>::new(), "{tag}");
        let blobs: Vec<_> = std::fs::read_dir(cache.join("models--Evil--model/blobs"))
            .expect("blobs")
            .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
            .collect();
        let bad = if tag == "altered" { "model.safetensors" } else { "config.json" };
        let bad_digest = fake_hub::digest(bad, &std::fs::read(fixture().join(bad)).expect("fixture"));
        assert!(!blobs.contains(&bad_digest), "{tag}: the bad file became a blob: {blobs:?}");
    }
}

/// A hub that stops sending (on the file list or a file) or drips a byte at a time fails the pull within
/// a few stall windows (`OSPREY_HUB_STALL_SECS=1` here; 30 s by default) instead of hanging it.
#[test]
fn stalled_and_dripping_hubs_fail_the_pull_instead_of_hanging_it() {
    let src = fixture();
    type Case = fn(&fake_hub::Req, &Path) -> Option<Reply>;
    let cases: [(&str, Case); 3] = [
        ("listing stalls", |req, _| req.path.starts_with("/api/").then_some(Reply::Stall)),
        ("file stalls", |req, _| req.path.ends_with("/model.safetensors").then_some(Reply::Stall)),
        ("file drips", |req, src| {
            let body = std::fs::read(src.join("tokenizer.json")).ok()?;
            req.path.ends_with("/tokenizer.json").then(|| Reply::Drip(body, Duration::from_millis(50)))
        }),
    ];
    for (tag, case) in cases {
        let (_, cache) = sandbox(&format!("stall-{}", tag.replace(' ', "-")));
        let src2 = src.clone();
        let hub = fake_hub::start(move |req| {
            if let Some(r) = case(req, &src2) {
                return r;
            }
            if req.path.starts_with("/api/") {
                return Reply::Full("200 OK", String::new(), fake_hub::listing(&src2, COMMIT, &[]).into_bytes());
            }
            fake_hub::file(&src2, req)
        });
        let (ok, err) = pull(&hub, &cache);
        assert!(!ok && (err.contains("timed out") || err.contains("slower than the floor")), "{tag}: {err}");
    }
}

/// The hub redirects weights to a CDN on another host, as huggingface.co does: the token goes to the
/// hub, never to the host the redirect names.
#[test]
fn a_redirect_to_another_host_does_not_carry_the_token() {
    let src = fixture();
    let cdn_src = src.clone();
    let cdn = fake_hub::start(move |req| fake_hub::file(&cdn_src, req));
    let cdn_url = cdn.url();
    let hub = fake_hub::start(move |req| {
        if req.auth != "Bearer good-token" {
            return Reply::Full("401 Unauthorized", String::new(), Vec::new());
        }
        if req.path.starts_with("/api/") {
            return Reply::Full("200 OK", String::new(), fake_hub::listing(&src, COMMIT, &[]).into_bytes());
        }
        let name = req.path.rsplit('/').next().unwrap_or_default();
        Reply::Full("302 Found", format!("Location: {cdn_url}/cdn/{name}\r\n"), Vec::new())
    });
    let (root, cache) = sandbox("redirect");
    let out = fake_hub::osprey(&["pull", "Evil/model"], &hub.url(), &cache, Some("good-token"), LIMIT);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let cdn_reqs = cdn.requests();
    assert!(!cdn_reqs.is_empty(), "nothing went to the CDN");
    assert!(cdn_reqs.iter().all(|r| r.auth.is_empty()), "the token reached another host: {cdn_reqs:?}");
    assert!(hub.requests().iter().all(|r| r.auth == "Bearer good-token"));
    assert_eq!(outside_cache(&root), Vec::<PathBuf>::new());
}

/// A 200 MB file list is refused after its first 16 MiB, not read whole.
#[test]
fn a_huge_file_list_is_refused_without_reading_it_all() {
    let hub = fake_hub::start(|req| {
        if req.path.starts_with("/api/") {
            let chunk = b"{\"rfilename\": \"x.safetensors\"}, ".repeat(2048);
            return Reply::Endless(200 << 20, chunk);
        }
        Reply::Full("404 Not Found", String::new(), Vec::new())
    });
    let (_, cache) = sandbox("listing");
    let (ok, err) = pull(&hub, &cache);
    assert!(!ok && err.contains("file list is over 16777216 bytes"), "{err}");
}
