//! A local stand-in for the Hugging Face Hub, honest or hostile: each test gives a handler that answers
//! the requests osprey makes (the file list, `GET /api/models/{id}/revision/{rev}?blobs=true`, and each
//! file, `GET /{id}/resolve/{commit}/{file}`, with a `Range` when resuming) with a whole reply, one cut
//! short, a stall or a drip. Every request is logged with its Range and Authorization headers.

use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use sha1::Digest as _;

/// A request as the hub saw it.
#[derive(Clone, Debug)]
pub struct Req {
    pub path: String,
    pub range: Option<u64>,
    pub auth: String,
}

/// How the hub answers.
pub enum Reply {
    /// A whole answer: status line (e.g. `200 OK`), extra header lines, body.
    Full(&'static str, String, Vec<u8>),
    /// Headers announcing `body`, then only its first `keep` bytes, then the line drops.
    Cut(&'static str, String, Vec<u8>, usize),
    /// Headers announcing `len` bytes, then `chunk` written again and again until the client leaves.
    Endless(usize, Vec<u8>),
    /// Headers, then nothing for a minute.
    Stall,
    /// Headers announcing `body`, then one byte every `every`.
    Drip(Vec<u8>, Duration),
}

pub struct FakeHub {
    pub addr: SocketAddr,
    pub log: Arc<Mutex<Vec<Req>>>,
}

impl FakeHub {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Req> {
        self.log.lock().expect("log").clone()
    }
}

pub fn start(handler: impl Fn(&Req) -> Reply + Send + Sync + 'static) -> FakeHub {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let log = Arc::new(Mutex::new(Vec::new()));
    let handler = Arc::new(handler);
    let log2 = log.clone();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(conn) = conn else { continue };
            let (log, handler) = (log2.clone(), handler.clone());
            std::thread::spawn(move || serve(conn, &log, &*handler));
        }
    });
    FakeHub { addr, log }
}

fn serve(mut conn: TcpStream, log: &Mutex<Vec<Req>>, handler: &dyn Fn(&Req) -> Reply) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    loop {
        let mut head = String::new();
        if reader.read_line(&mut head).unwrap_or(0) == 0 {
            return;
        }
        let mut req =
            Req { path: head.split_whitespace().nth(1).unwrap_or("/").to_string(), range: None, auth: String::new() };
        loop {
            let mut line = String::new();
            if reader.read_line(&mut line).unwrap_or(0) == 0 {
                return;
            }
            let line = line.trim_end();
            if line.is_empty() {
                break;
            }
            let (k, v) = line.split_once(": ").unwrap_or((line, ""));
            match k.to_ascii_lowercase().as_str() {
                "range" => req.range = v.strip_prefix("bytes=").and_then(|r| r.trim_end_matches('-').parse().ok()),
                "authorization" => req.auth = v.to_string(),
                _ => {}
            }
        }
        log.lock().expect("log").push(req.clone());
        let head = |status: &str, headers: &str, len: usize| {
            format!("HTTP/1.1 {status}\r\nContent-Length: {len}\r\n{headers}\r\n").into_bytes()
        };
        let ok = match handler(&req) {
            Reply::Full(status, headers, body) => {
                conn.write_all(&head(status, &headers, body.len())).and_then(|()| conn.write_all(&body)).is_ok()
            }
            Reply::Cut(status, headers, body, keep) => {
                let _ =
                    conn.write_all(&head(status, &headers, body.len())).and_then(|()| conn.write_all(&body[..keep]));
                false
            }
            Reply::Endless(len, chunk) => {
                let _ = conn.write_all(&head("200 OK", "", len));
                while conn.write_all(&chunk).is_ok() {}
                false
            }
            Reply::Stall => {
                let _ = conn.write_all(&head("200 OK", "", 1000));
                std::thread::sleep(Duration::from_secs(60));
                false
            }
            Reply::Drip(body, every) => {
                let _ = conn.write_all(&head("200 OK", "", body.len()));
                for b in body {
                    std::thread::sleep(every);
                    if conn.write_all(&[b]).is_err() {
                        break;
                    }
                }
                false
            }
        };
        if !ok {
            return;
        }
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The digest the hub lists for a file: sha256 for LFS files (weights), else the git blob id.
pub fn digest(name: &str, bytes: &[u8]) -> String {
    if name.ends_with(".safetensors") {
        hex(&sha2::Sha256::digest(bytes))
    } else {
        let mut h = sha1::Sha1::new();
        h.update(format!("blob {}\0", bytes.len()).as_bytes());
        h.update(bytes);
        hex(&h.finalize())
    }
}

/// The hub's `?blobs=true` file list for the files of `dir` plus `extra` names (listed without bytes,
/// never needed), as the hub writes it: size and blob id for git files, `lfs.sha256` for weights.
pub fn listing(dir: &Path, commit: &str, extra: &[&str]) -> String {
    let mut items = Vec::new();
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("dir")
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for name in names {
        let bytes = std::fs::read(dir.join(&name)).expect("file");
        let d = digest(&name, &bytes);
        let n = bytes.len();
        items.push(if name.ends_with(".safetensors") {
            format!("{{\"rfilename\": \"{name}\", \"size\": {n}, \"blobId\": \"{}\", \"lfs\": {{\"sha256\": \"{d}\", \"size\": {n}, \"pointerSize\": 134}}}}", "0".repeat(40))
        } else {
            format!("{{\"rfilename\": \"{name}\", \"size\": {n}, \"blobId\": \"{d}\"}}")
        });
    }
    items.extend(
        extra.iter().map(|f| format!("{{\"rfilename\": \"{f}\", \"size\": 1, \"blobId\": \"{}\"}}", "1".repeat(40))),
    );
    format!("{{\"sha\": \"{commit}\", \"siblings\": [{}]}}", items.join(", "))
}

/// A file request answered from `dir` as the hub does: 206 with `Content-Range` for a `Range`, else 200.
pub fn file(dir: &Path, req: &Req) -> Reply {
    let name = req.path.rsplit('/').next().unwrap_or_default();
    let Ok(bytes) = std::fs::read(dir.join(name)) else {
        return Reply::Full("404 Not Found", String::new(), Vec::new());
    };
    match req.range.map(|r| r as usize) {
        Some(from) if from < bytes.len() => Reply::Full(
            "206 Partial Content",
            format!("Content-Range: bytes {from}-{}/{}\r\n", bytes.len() - 1, bytes.len()),
            bytes[from..].to_vec(),
        ),
        _ => Reply::Full("200 OK", String::new(), bytes),
    }
}

/// Runs the osprey binary with `args` against `hub` (the cache at `cache`, stalls detected after one
/// second), failing the test if it runs past `limit` instead of hanging it.
pub fn osprey(args: &[&str], hub: &str, cache: &Path, token: Option<&str>, limit: Duration) -> std::process::Output {
    let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_osprey"));
    c.args(args)
        .env("HF_ENDPOINT", hub)
        .env("HF_HUB_CACHE", cache)
        .env("HF_HOME", cache.join("home"))
        .env("OSPREY_HUB_STALL_SECS", "1")
        .env_remove("HF_HUB_OFFLINE")
        .env_remove("HF_TOKEN")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    if let Some(t) = token {
        c.env("HF_TOKEN", t);
    }
    let mut child = c.spawn().expect("run osprey");
    let started = std::time::Instant::now();
    while child.try_wait().expect("wait").is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().expect("output");
            panic!("osprey {args:?} ran past {limit:?}: {}", String::from_utf8_lossy(&out.stderr));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("output")
}
