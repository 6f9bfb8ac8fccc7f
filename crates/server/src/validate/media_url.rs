//! Media URLs into bytes: `data:` URLs decoded, `http(s)` fetched only from allow-listed hosts, `file://`
//! read only under the allowed directory; every size bounded.
//!
//! Each remote URL is parsed once, by the `url` crate (WHATWG rules, the parser the HTTP client uses),
//! and the parsed value is what is checked and what is fetched: `http://127.0.0.1:8093\@allowed.example/`
//! is a URL whose host is 127.0.0.1 (a backslash ends the authority of an http URL), so it is refused,
//! where a hand-split string once saw `allowed.example`. Redirects are followed by hand, at most
//! [`MAX_REDIRECTS`], each target parsed and checked against the allow-list again (http(s) only).
//! Local files: only regular files (a FIFO or device would block a worker), opened without following a
//! final symlink, read within a deadline; a path outside the allowed directory is refused the same way
//! whether it exists or not.

use std::io::Read;
use std::net::IpAddr;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine;
use osprey_protocol::ErrorCode;
use url::{Host, Url};

use crate::config::Limits;
use crate::error::bad;
use crate::error::ApiError;

/// Redirect hops followed for one remote media URL.
pub const MAX_REDIRECTS: usize = 3;
/// Time for one remote fetch, or one local read, from the first byte asked to the last received.
pub const FETCH_DEADLINE: Duration = Duration::from_secs(20);

/// What a part expects, for the declared type of a `data:` URL.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MediaKind {
    /// An image (or a frame of a video given as frames).
    Image,
    /// A video file (an animated image is one too).
    Video,
}

/// Fetches or decodes a media URL under the limits (blocking: called off the async threads).
pub fn resolve_url(url: &str, limits: &Limits, kind: MediaKind, param: &str) -> Result<Vec<u8>, ApiError> {
    if let Some(rest) = url.strip_prefix("data:") {
        return data_url(rest, limits, kind, param);
    }
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https://") {
        return fetch_remote(url, limits, param);
    }
    if lower.starts_with("file://") {
        return read_local(url, limits, param);
    }
    Err(bad(
        ErrorCode::InvalidMedia,
        "media URLs must be data:, http(s):// (allow-listed) or file:// (allowed path)",
        param,
    ))
}

fn too_big(n: usize, limits: &Limits, param: &str) -> ApiError {
    bad(
        ErrorCode::MediaTooLarge,
        format!("media item is {n} bytes, more than the limit of {}", limits.max_media_bytes),
        param,
    )
}

/// `data:<mime>;base64,<payload>`: the declared type must be the part's kind (`image/*`; a video also
/// `video/*`) or the generic `application/octet-stream`; anything else (`text/plain`) is refused rather
/// than decoded as an image.
fn data_url(rest: &str, limits: &Limits, kind: MediaKind, param: &str) -> Result<Vec<u8>, ApiError> {
    let (meta, payload) =
        rest.split_once(',').ok_or_else(|| bad(ErrorCode::InvalidMedia, "malformed data URL (no comma)", param))?;
    let Some(mime) = meta.strip_suffix(";base64") else {
        return Err(bad(ErrorCode::InvalidMedia, "data URLs must be base64-encoded (`data:<mime>;base64,...`)", param));
    };
    let mime = mime.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    let fits = mime.starts_with("image/")
        || mime == "application/octet-stream"
        || (kind == MediaKind::Video && mime.starts_with("video/"));
    if !fits {
        let want = if kind == MediaKind::Video { "video/* or image/*" } else { "image/*" };
        return Err(bad(
            ErrorCode::InvalidMedia,
            format!(
                "the data URL declares `{}`; this part takes {want}",
                if mime.is_empty() { "no type" } else { &mime }
            ),
            param,
        ));
    }
    if payload.len() / 4 * 3 > limits.max_media_bytes + 3 {
        return Err(too_big(payload.len() / 4 * 3, limits, param));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.trim())
        .map_err(|e| bad(ErrorCode::InvalidMedia, format!("malformed base64 in data URL: {e}"), param))?;
    if bytes.len() > limits.max_media_bytes {
        return Err(too_big(bytes.len(), limits, param));
    }
    Ok(bytes)
}

/// Whether `host` is on the allow-list: names compare without case, addresses by value (`::1`, `[::1]`
/// and `0:0::1` are one entry).
fn allowed_host(host: &Host<&str>, allowed: &[String]) -> bool {
    allowed.iter().any(|entry| {
        let entry = entry.trim().trim_start_matches('[').trim_end_matches(']');
        match (host, entry.parse::<IpAddr>()) {
            (Host::Domain(d), Err(_)) => d.trim_end_matches('.').eq_ignore_ascii_case(entry.trim_end_matches('.')),
            (Host::Ipv4(a), Ok(IpAddr::V4(b))) => *a == b,
            (Host::Ipv6(a), Ok(IpAddr::V6(b))) => *a == b,
            _ => false,
        }
    })
}

/// Parses and checks one remote URL: http(s), no credentials, an allow-listed host.
fn checked_remote(url: &Url, limits: &Limits, param: &str) -> Result<(), ApiError> {
    if !matches!(url.scheme(), "http" | "https") {
        return Err(bad(ErrorCode::MediaUrlNotAllowed, "remote media is fetched over http(s) only", param));
    }
    if !url.username().is_empty() || url.password().is_some() {
        return Err(bad(ErrorCode::MediaUrlNotAllowed, "media URLs with credentials are not fetched", param));
    }
    let host = url.host().ok_or_else(|| bad(ErrorCode::InvalidMedia, "the media URL has no host", param))?;
    if !allowed_host(&host, &limits.allowed_media_domains) {
        return Err(bad(
            ErrorCode::MediaUrlNotAllowed,
            format!("fetching media from `{host}` is not allowed; send a data: URL or start the server with --allowed-media-domains"),
            param,
        ));
    }
    Ok(())
}

/// Whether `ip` is a public address: not loopback, private, link-local, shared (CGNAT), unique-local,
/// documentation, benchmarking, multicast, broadcast, reserved or unspecified (an IPv4-mapped IPv6
/// address as its IPv4 one).
fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(a) => {
            let [o0, o1, o2, _] = a.octets();
            !(a.is_loopback()
                || a.is_private()
                || a.is_link_local()
                || a.is_unspecified()
                || a.is_broadcast()
                || a.is_documentation()
                || a.is_multicast()
                || o0 == 0
                || o0 >= 240
                || (o0 == 100 && (64..128).contains(&o1))
                || (o0 == 192 && o1 == 0 && o2 == 0)
                || (o0 == 198 && (18..20).contains(&o1)))
        }
        IpAddr::V6(a) => {
            if let Some(v4) = a.to_ipv4_mapped() {
                return is_public(IpAddr::V4(v4));
            }
            let s = a.segments();
            !(a.is_loopback()
                || a.is_unspecified()
                || a.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00
                || (s[0] & 0xffc0) == 0xfe80
                || (s[0] == 0x2001 && s[1] == 0x0db8))
        }
    }
}

/// Resolves a media host for the fetch and keeps the addresses it may connect to: public ones, and
/// those the allow-list names as addresses. The fetch connects to what this returns, so the address
/// checked is the address used (an allow-listed name that resolved to 127.0.0.1 was fetched; a name
/// that resolves differently the second time cannot pass the check with one address and connect to
/// another).
struct PinnedResolver {
    listed: Vec<IpAddr>,
    refused: std::sync::Arc<std::sync::Mutex<Option<String>>>,
}

impl ureq::Resolver for PinnedResolver {
    fn resolve(&self, netloc: &str) -> std::io::Result<Vec<std::net::SocketAddr>> {
        use std::net::ToSocketAddrs;
        let all: Vec<std::net::SocketAddr> = netloc.to_socket_addrs()?.collect();
        let ok: Vec<_> = all.iter().copied().filter(|a| self.listed.contains(&a.ip()) || is_public(a.ip())).collect();
        if ok.is_empty() {
            let shown: Vec<String> = all.iter().take(4).map(|a| a.ip().to_string()).collect();
            let why = format!(
                "`{netloc}` resolves to {} only, which is not public; list the address in --allowed-media-domains to fetch from it",
                shown.join(", ")
            );
            if let Ok(mut r) = self.refused.lock() {
                *r = Some(why.clone());
            }
            return Err(std::io::Error::new(std::io::ErrorKind::PermissionDenied, why));
        }
        Ok(ok)
    }
}

fn fetch_remote(raw: &str, limits: &Limits, param: &str) -> Result<Vec<u8>, ApiError> {
    let mut url =
        Url::parse(raw).map_err(|e| bad(ErrorCode::InvalidMedia, format!("malformed media URL: {e}"), param))?;
    let refused = std::sync::Arc::new(std::sync::Mutex::new(None));
    let listed = limits
        .allowed_media_domains
        .iter()
        .filter_map(|e| e.trim().trim_start_matches('[').trim_end_matches(']').parse().ok())
        .collect();
    let agent = ureq::AgentBuilder::new()
        .redirects(0)
        .timeout(FETCH_DEADLINE)
        .resolver(PinnedResolver { listed, refused: refused.clone() })
        .build();
    let failed = |e: String| bad(ErrorCode::InvalidMedia, format!("fetching the media URL failed: {e}"), param);
    let started = Instant::now();
    for _ in 0..=MAX_REDIRECTS {
        checked_remote(&url, limits, param)?;
        let resp = match agent.request_url("GET", &url).call() {
            Ok(r) => r,
            Err(ureq::Error::Status(code, _)) => return Err(failed(format!("the server answered {code}"))),
            Err(e) => {
                if let Some(why) = refused.lock().ok().and_then(|mut r| r.take()) {
                    return Err(bad(ErrorCode::MediaUrlNotAllowed, why, param));
                }
                return Err(failed(e.kind().to_string()));
            }
        };
        if (300..400).contains(&resp.status()) {
            let loc = resp.header("location").ok_or_else(|| failed(format!("{} without a Location", resp.status())))?;
            url = url.join(loc).map_err(|_| failed("a redirect to a malformed URL".into()))?;
            continue;
        }
        let mut bytes = Vec::new();
        let mut reader = resp.into_reader().take(limits.max_media_bytes as u64 + 1);
        read_until(&mut reader, &mut bytes, started + FETCH_DEADLINE).map_err(|e| failed(e.to_string()))?;
        if bytes.len() > limits.max_media_bytes {
            return Err(too_big(bytes.len(), limits, param));
        }
        return Ok(bytes);
    }
    Err(failed(format!("more than {MAX_REDIRECTS} redirects")))
}

/// Reads `r` to its end in 1 MiB steps, failing once `deadline` passes.
fn read_until(r: &mut impl Read, out: &mut Vec<u8>, deadline: Instant) -> std::io::Result<()> {
    let mut buf = vec![0u8; 1 << 20];
    loop {
        if Instant::now() > deadline {
            return Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "reading the media took too long"));
        }
        match r.read(&mut buf)? {
            0 => return Ok(()),
            n => out.extend_from_slice(&buf[..n]),
        }
    }
}

/// `path` with `.` and `..` resolved lexically (no file system access).
fn lexical(path: &Path) -> PathBuf {
    let mut out = PathBuf::new();
    for c in path.components() {
        match c {
            Component::ParentDir => {
                out.pop();
            }
            Component::CurDir => {}
            c => out.push(c),
        }
    }
    out
}

fn read_local(raw: &str, limits: &Limits, param: &str) -> Result<Vec<u8>, ApiError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    // One answer for every path outside the allowed directory, there or not: no existence oracle.
    let denied =
        || bad(ErrorCode::MediaUrlNotAllowed, "local files are only read under --allowed-local-media-path", param);
    let unreadable = || bad(ErrorCode::InvalidMedia, "cannot read the media file", param);
    let root = limits.allowed_local_media_path.as_ref().ok_or_else(denied)?;
    let root = root.canonicalize().map_err(|_| denied())?;
    let url = Url::parse(raw).map_err(|_| denied())?;
    let path = url.to_file_path().map_err(|_| denied())?;
    if !lexical(&path).starts_with(&root) {
        return Err(denied());
    }
    // Inside the directory by name; symlinks may still lead out, so the real path decides.
    let real = path.canonicalize().map_err(|_| unreadable())?;
    if !real.starts_with(&root) {
        return Err(denied());
    }
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK | libc::O_NOFOLLOW)
        .open(&real)
        .map_err(|_| unreadable())?;
    let meta = file.metadata().map_err(|_| unreadable())?;
    let ft = meta.file_type();
    if !ft.is_file() || ft.is_fifo() || ft.is_char_device() || ft.is_block_device() || ft.is_socket() {
        return Err(bad(ErrorCode::InvalidMedia, "local media must be a regular file", param));
    }
    if meta.len() as usize > limits.max_media_bytes {
        return Err(too_big(meta.len() as usize, limits, param));
    }
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    let mut reader = (&file).take(limits.max_media_bytes as u64 + 1);
    read_until(&mut reader, &mut bytes, Instant::now() + FETCH_DEADLINE).map_err(|_| unreadable())?;
    if bytes.len() > limits.max_media_bytes {
        return Err(too_big(bytes.len(), limits, param));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(hosts: &[&str]) -> Limits {
        Limits { allowed_media_domains: hosts.iter().map(|s| s.to_string()).collect(), ..Limits::default() }
    }

    fn code(r: Result<Vec<u8>, ApiError>) -> String {
        r.err().map(|e| e.0.code.as_str().to_string()).unwrap_or_else(|| "ok".into())
    }

    #[test]
    fn the_checked_host_is_the_parsed_host() {
        let l = limits(&["allowed.example"]);
        for url in [
            "http://127.0.0.1:8093\\@allowed.example/../red.png",
            "http://127.0.0.1:8093\\\\@allowed.example/red.png",
            "http://allowed.example@127.0.0.1/red.png",
            "http://allowed.example.evil.test/red.png",
            "HTTP://127.0.0.1/red.png",
        ] {
            let u = Url::parse(url).expect("parses");
            assert_eq!(code(checked_remote(&u, &l, "p").map(|_| Vec::new())), "media_url_not_allowed", "{url}");
        }
        let ok = Url::parse("http://ALLOWED.example./x.png").expect("parses");
        assert!(checked_remote(&ok, &l, "p").is_ok());
    }

    /// Issue 49: an allow-listed name that resolves to a loopback or private address is not fetched
    /// (the address is checked and pinned by the resolver); the address itself on the list allows it.
    #[test]
    fn an_allowed_name_that_resolves_to_a_private_address_is_refused() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let port = listener.local_addr().expect("addr").port();
        std::thread::spawn(move || {
            for conn in listener.incoming().take(1) {
                use std::io::Write;
                let Ok(mut c) = conn else { continue };
                let mut buf = [0u8; 1024];
                let _ = std::io::Read::read(&mut c, &mut buf);
                let _ = c.write_all(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nPNG!");
            }
        });
        let url = format!("http://localhost:{port}/red.png");
        let e = resolve_url(&url, &limits(&["localhost"]), MediaKind::Image, "p").expect_err("loopback by name");
        assert_eq!(e.0.code.as_str(), "media_url_not_allowed", "{e}");
        assert!(e.0.message.contains("not public"), "{e}");
        let got =
            resolve_url(&url, &limits(&["localhost", "127.0.0.1"]), MediaKind::Image, "p").expect("listed address");
        assert_eq!(got, b"PNG!");
        for (ip, public) in [
            ("127.0.0.1", false),
            ("10.1.2.3", false),
            ("192.168.0.1", false),
            ("100.64.0.1", false),
            ("169.254.169.254", false),
            ("::1", false),
            ("fd00::1", false),
            ("::ffff:127.0.0.1", false),
            ("8.8.8.8", true),
            ("2606:4700::1", true),
        ] {
            assert_eq!(is_public(ip.parse().expect("ip")), public, "{ip}");
        }
    }

    #[test]
    fn ipv6_hosts_compare_by_address() {
        let u = Url::parse("http://[::1]:9/x.png").expect("parses");
        assert!(checked_remote(&u, &limits(&["::1"]), "p").is_ok());
        assert!(checked_remote(&u, &limits(&["[0:0::1]"]), "p").is_ok());
        assert!(checked_remote(&u, &limits(&["["]), "p").is_err());
        assert!(checked_remote(&u, &limits(&["127.0.0.1"]), "p").is_err());
    }

    #[test]
    fn data_urls_must_declare_a_media_type() {
        let l = Limits::default();
        assert_eq!(code(resolve_url("data:text/plain;base64,iVBORw0K", &l, MediaKind::Image, "p")), "invalid_media");
        assert_eq!(code(resolve_url("data:;base64,iVBORw0K", &l, MediaKind::Image, "p")), "invalid_media");
        assert_eq!(code(resolve_url("data:video/mp4;base64,AAAA", &l, MediaKind::Image, "p")), "invalid_media");
        assert_eq!(code(resolve_url("data:video/mp4;base64,AAAA", &l, MediaKind::Video, "p")), "ok");
        assert_eq!(code(resolve_url("data:image/png;base64,AAAA", &l, MediaKind::Image, "p")), "ok");
    }

    #[test]
    fn lexical_paths_resolve_dot_dot() {
        assert_eq!(lexical(Path::new("/a/b/../../etc/passwd")), PathBuf::from("/etc/passwd"));
        assert_eq!(lexical(Path::new("/a/./b/../c")), PathBuf::from("/a/c"));
    }
}
