//! The hub's HTTP requests, each bounded: a connect timeout; a read that waits longer than the stall
//! time fails; a body that brings fewer than [`FLOOR_BYTES`] in any stall window fails (a hub dripping
//! a byte a second is caught in one window); the file list is capped at [`MAX_LISTING`] bytes and has a
//! total deadline; a file is never read past its listed size. Redirects are followed here, at most
//! [`MAX_REDIRECTS`], never from https to http, and the token goes only to the endpoint's own origin (the
//! hub sends weights to a CDN on another host, which needs none).

use std::io::{Read, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use sha1::Digest as _;

use super::listing::{shown, Digest, RemoteFile};
use super::Hub;

/// Largest file list read from the hub (a repository with a thousand files lists in ~300 KB).
pub const MAX_LISTING: u64 = 16 << 20;
/// Fewest bytes a body must bring in each stall window.
pub const FLOOR_BYTES: u64 = 64 << 10;
/// Most redirects one request follows.
pub const MAX_REDIRECTS: usize = 5;

/// The hub's HTTP client for one pull.
pub struct Client<'h> {
    hub: &'h Hub,
    agent: ureq::Agent,
    origin: url::Origin,
}

impl std::fmt::Debug for Client<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client").field("endpoint", &self.hub.endpoint).finish_non_exhaustive()
    }
}

/// A failed request's status, for [`super::explain`].
#[derive(Debug)]
pub struct Status(pub u16);

impl std::fmt::Display for Status {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}", self.0)
    }
}

impl std::error::Error for Status {}

impl<'h> Client<'h> {
    /// A client for `hub`, its timeouts from `hub.stall`.
    pub fn new(hub: &'h Hub) -> Result<Self> {
        let endpoint = url::Url::parse(&hub.endpoint).with_context(|| format!("HF_ENDPOINT {}", hub.endpoint))?;
        if !matches!(endpoint.scheme(), "http" | "https") {
            bail!("HF_ENDPOINT {} is not an http(s) address", hub.endpoint);
        }
        let agent = ureq::AgentBuilder::new()
            .timeout_connect(hub.stall.min(Duration::from_secs(10)))
            .timeout_read(hub.stall)
            .timeout_write(hub.stall)
            .redirects(0)
            .user_agent(concat!("osprey/", env!("CARGO_PKG_VERSION")))
            .build();
        Ok(Client { hub, agent, origin: endpoint.origin() })
    }

    /// `GET path` on the endpoint, redirects followed; `range` asks for the bytes from that offset; the
    /// whole exchange within `deadline` when given.
    fn get(&self, path: &str, range: Option<u64>, deadline: Option<Duration>) -> Result<ureq::Response> {
        let mut url = url::Url::parse(&format!("{}{path}", self.hub.endpoint.trim_end_matches('/')))?;
        for _ in 0..=MAX_REDIRECTS {
            let mut req = self.agent.request_url("GET", &url);
            if let Some(d) = deadline {
                req = req.timeout(d);
            }
            if let Some(from) = range {
                req = req.set("Range", &format!("bytes={from}-"));
            }
            // The token only for the endpoint's own origin, never a host a redirect names.
            if let Some(t) = self.hub.token.as_deref().filter(|_| url.origin() == self.origin) {
                req = req.set("Authorization", &format!("Bearer {t}"));
            }
            let resp = match req.call() {
                Ok(r) => r,
                Err(ureq::Error::Status(code, _)) => return Err(anyhow!(Status(code))),
                Err(e) => return Err(anyhow!("{e}")),
            };
            if !(300..400).contains(&resp.status()) {
                return Ok(resp);
            }
            let to = resp.header("location").ok_or_else(|| anyhow!("HTTP {} without a location", resp.status()))?;
            let next = url.join(to).map_err(|e| anyhow!("redirect to {}: {e}", shown(to)))?;
            if !matches!(next.scheme(), "http" | "https") || (url.scheme() == "https" && next.scheme() == "http") {
                bail!("refused a redirect from {url} to {}", shown(next.as_str()));
            }
            url = next;
        }
        bail!("more than {MAX_REDIRECTS} redirects")
    }

    /// The file list of `id` at `revision` (at most [`MAX_LISTING`] bytes).
    pub fn listing(&self, id: &str, revision: &str) -> Result<Vec<u8>> {
        let path = format!("/api/models/{id}/revision/{}?blobs=true", encode(revision));
        let resp = self.get(&path, None, Some(self.hub.stall * 4))?;
        let mut body = Vec::new();
        Guarded::new(resp.into_reader(), self.hub.stall)
            .take(MAX_LISTING + 1)
            .read_to_end(&mut body)
            .context("reading the hub's file list")?;
        if body.len() as u64 > MAX_LISTING {
            bail!("{id}@{revision}: the hub's file list is over {MAX_LISTING} bytes; refused");
        }
        Ok(body)
    }

    /// Downloads `file` of `id` at `commit` into `blob`, through `blob.part` (kept when the transfer is
    /// cut, resumed by the next call): the bytes are checked against the listed size and digest before
    /// the blob takes its name. `progress` hears (bytes done, total).
    pub fn download(
        &self,
        (id, commit): (&str, &str),
        file: &RemoteFile,
        blob: &Path,
        progress: &mut dyn FnMut(u64, u64),
    ) -> Result<()> {
        let part = blob.with_extension("part");
        let mut have = std::fs::metadata(&part).map(|m| m.len()).unwrap_or(0);
        if have > file.size {
            have = 0;
        }
        let path = format!("/{id}/resolve/{commit}/{}", encode(&file.name));
        let resp = self.get(&path, (have > 0 && have < file.size).then_some(have), None)?;
        let mut hash = Hasher::new(&file.digest, file.size);
        let mut out = match (resp.status(), have) {
            (206, h) if h > 0 && content_range(&resp) == Some((h, file.size)) => {
                // Resuming: the kept bytes count toward the digest.
                std::io::copy(&mut std::fs::File::open(&part)?.take(h), &mut hash)?;
                std::fs::OpenOptions::new().append(true).open(&part)?
            }
            (200, _) => {
                have = 0;
                std::fs::File::create(&part)?
            }
            (s, h) => {
                // Not what was asked: the kept bytes cannot be trusted to continue; the next pull starts over.
                if h > 0 {
                    let _ = std::fs::remove_file(&part);
                }
                bail!("the hub answered HTTP {s} for {} (expected 200, or 206 from byte {h})", file.name)
            }
        };
        progress(have, file.size);
        // One byte past the listed size is read, to tell a longer file from a whole one.
        let mut body = Guarded::new(resp.into_reader(), self.hub.stall).take(file.size - have + 1);
        let mut buf = vec![0u8; 1 << 16];
        loop {
            let n = body.read(&mut buf).with_context(|| format!("{} cut at byte {have}", file.name))?;
            if n == 0 {
                break;
            }
            have += n as u64;
            if have > file.size {
                drop(out);
                let _ = std::fs::remove_file(&part);
                bail!("{} is longer than the {} bytes the hub listed; refused", file.name, file.size);
            }
            out.write_all(&buf[..n])?;
            hash.write_all(&buf[..n])?;
            progress(have, file.size);
        }
        out.sync_all()?;
        if have < file.size {
            bail!("{} ended at byte {have} of {}; the next pull resumes it", file.name, file.size);
        }
        if let Err(e) = hash.check(&file.digest) {
            let _ = std::fs::remove_file(&part);
            bail!("{}: {e}; refused", file.name);
        }
        std::fs::rename(&part, blob)?;
        Ok(())
    }
}

/// `Content-Range: bytes FROM-END/TOTAL` as (FROM, TOTAL).
fn content_range(resp: &ureq::Response) -> Option<(u64, u64)> {
    let v = resp.header("content-range")?.strip_prefix("bytes ")?;
    let (span, total) = v.split_once('/')?;
    let (from, _) = span.split_once('-')?;
    Some((from.trim().parse().ok()?, total.trim().parse().ok()?))
}

/// A path segment with everything but unreserved characters percent-encoded.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// A body that must bring [`FLOOR_BYTES`] in every `window` (a drip fails within one window).
struct Guarded<R> {
    inner: R,
    window: Duration,
    started: Instant,
    got: u64,
}

impl<R: Read> Guarded<R> {
    fn new(inner: R, window: Duration) -> Self {
        Guarded { inner, window, started: Instant::now(), got: 0 }
    }
}

impl<R: Read> Read for Guarded<R> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.got += n as u64;
        if self.started.elapsed() >= self.window {
            if self.got < FLOOR_BYTES && n > 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!(
                        "the hub sent {} bytes in {:.1} s (slower than the floor)",
                        self.got,
                        self.window.as_secs_f64()
                    ),
                ));
            }
            (self.started, self.got) = (Instant::now(), 0);
        }
        Ok(n)
    }
}

/// The digest of the bytes so far.
enum Hasher {
    Sha256(sha2::Sha256),
    GitSha1(sha1::Sha1),
}

impl Hasher {
    fn new(d: &Digest, size: u64) -> Self {
        match d {
            Digest::Sha256(_) => Hasher::Sha256(sha2::Sha256::new()),
            Digest::GitSha1(_) => {
                let mut h = sha1::Sha1::new();
                h.update(format!("blob {size}\0").as_bytes());
                Hasher::GitSha1(h)
            }
        }
    }

    fn check(self, want: &Digest) -> Result<()> {
        let got = match self {
            Hasher::Sha256(h) => hex(&h.finalize()),
            Hasher::GitSha1(h) => hex(&h.finalize()),
        };
        if got == want.hex() {
            Ok(())
        } else {
            bail!("its bytes hash to {got}, not the listed {}", want.hex())
        }
    }
}

impl Write for Hasher {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        match self {
            Hasher::Sha256(h) => h.update(b),
            Hasher::GitSha1(h) => h.update(b),
        }
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn git_blob_ids_and_sha256_are_checked_as_the_hub_computes_them() {
        // `git hash-object` of "{}\n" and sha256 of "abc".
        let mut h = Hasher::new(&Digest::GitSha1(String::new()), 3);
        h.write_all(b"{}\n").expect("hash");
        assert!(h.check(&Digest::GitSha1("0967ef424bce6791893e9a57bb952f80fd536e93".into())).is_ok());
        let mut h = Hasher::new(&Digest::Sha256(String::new()), 3);
        h.write_all(b"abc").expect("hash");
        let abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        assert!(h.check(&Digest::Sha256(abc.into())).is_ok());
        let mut h = Hasher::new(&Digest::Sha256(String::new()), 3);
        h.write_all(b"abd").expect("hash");
        assert!(h.check(&Digest::Sha256(abc.into())).is_err());
        assert_eq!(encode("refs/pr/1"), "refs%2Fpr%2F1");
        assert_eq!(encode("model-00001-of-00002.safetensors"), "model-00001-of-00002.safetensors");
    }
}
