//! The HTTP edge, before any handler runs: what a web page in a visitor's browser must not be able to do
//! to a server on their home network.
//!
//! - **DNS rebinding.** Without an API key, a request must name this server in `Host`: a localhost name,
//!   an IP address (the one it is bound to, say; an address literal cannot be rebound), or one of
//!   `--allowed-hosts`. A page on `attacker.example` whose name
//!   was rebound to 127.0.0.1 sends `Host: attacker.example` and is refused (403 `host_not_allowed`). With
//!   a key, the key is the defence and any `Host` is served.
//! - **CORS.** Preflights (`OPTIONS` with `Origin` and `Access-Control-Request-Method`) are answered for
//!   the origins in `--allowed-origins` (none by default; `*` allows any) and refused otherwise (403
//!   `origin_not_allowed`); responses to allowed origins carry `Access-Control-Allow-Origin`. Bodies are
//!   accepted only as `application/json` (the JSON extractor's config), which a browser cannot send
//!   cross-origin without a preflight, so a page can neither read answers nor make the server generate.
//! - A plain `OPTIONS` (no preflight) is answered 204 with `Allow`.

use actix_web::http::header::{self, HeaderValue};
use actix_web::http::Method;
use actix_web::HttpResponse;
use osprey_protocol::ErrorCode;

use crate::error::ApiError;

/// Who may talk to the server.
#[derive(Clone, Debug, Default)]
pub struct EdgePolicy {
    /// Host names (without port) requests may name when no API key is set, besides localhost names.
    pub allowed_hosts: Vec<String>,
    /// Origins (`scheme://host[:port]`, or `*`) allowed to call the API from a browser.
    pub allowed_origins: Vec<String>,
    /// An API key is required (then `Host` is not checked).
    pub api_key_set: bool,
}

const LOCAL_HOSTS: [&str; 4] = ["localhost", "127.0.0.1", "::1", "[::1]"];

/// The host name of a `Host` header value (`name[:port]`, `[v6]:port`).
fn host_name(h: &str) -> &str {
    if let Some(rest) = h.strip_prefix('[') {
        return rest.split(']').next().unwrap_or(rest);
    }
    match h.rsplit_once(':') {
        Some((name, port)) if port.chars().all(|c| c.is_ascii_digit()) => name,
        _ => h,
    }
}

impl EdgePolicy {
    /// Whether `host` (a `Host` header value) names this server.
    pub fn host_allowed(&self, host: &str) -> bool {
        if self.api_key_set {
            return true;
        }
        let name = host_name(host).to_ascii_lowercase();
        let name = name.trim_end_matches('.');
        // An IP literal cannot be rebound (rebinding needs a name the attacker controls), so the bound
        // address and any other address of this machine are fine.
        name.parse::<std::net::IpAddr>().is_ok()
            || LOCAL_HOSTS.contains(&name)
            || name.ends_with(".localhost")
            || self.allowed_hosts.iter().any(|a| host_name(a).eq_ignore_ascii_case(name))
    }

    /// Whether a browser page from `origin` may call the API.
    pub fn origin_allowed(&self, origin: &str) -> bool {
        self.allowed_origins.iter().any(|o| o == "*" || o.trim_end_matches('/').eq_ignore_ascii_case(origin))
    }

    /// The answer to a request before routing, if the edge answers it itself: a refused `Host`, a
    /// preflight, a plain `OPTIONS`.
    pub fn intercept(&self, method: &Method, headers: &header::HeaderMap) -> Option<HttpResponse> {
        let get = |name: header::HeaderName| headers.get(name).and_then(|v| v.to_str().ok());
        if let Some(host) = get(header::HOST) {
            if !self.host_allowed(host) {
                let e = ApiError::new(
                    ErrorCode::HostNotAllowed,
                    format!("this server does not answer for host `{host}` (add it with --allowed-hosts, or set an API key)"),
                );
                return Some(actix_web::ResponseError::error_response(&e));
            }
        }
        if method != Method::OPTIONS {
            return None;
        }
        let origin = get(header::ORIGIN);
        let preflight = headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
        match origin {
            Some(o) if preflight && self.origin_allowed(o) => Some(
                HttpResponse::NoContent()
                    .insert_header((header::ACCESS_CONTROL_ALLOW_ORIGIN, o))
                    .insert_header((header::ACCESS_CONTROL_ALLOW_METHODS, "GET, POST, DELETE, OPTIONS"))
                    .insert_header((header::ACCESS_CONTROL_ALLOW_HEADERS, "authorization, content-type"))
                    .insert_header((header::ACCESS_CONTROL_MAX_AGE, "600"))
                    .insert_header((header::VARY, "Origin"))
                    .finish(),
            ),
            Some(o) if preflight => {
                let e = ApiError::new(
                    ErrorCode::OriginNotAllowed,
                    format!("cross-origin requests from `{o}` are not allowed (see --allowed-origins)"),
                );
                Some(actix_web::ResponseError::error_response(&e))
            }
            _ => Some(HttpResponse::NoContent().insert_header((header::ALLOW, "GET, POST, DELETE, OPTIONS")).finish()),
        }
    }

    /// Adds the CORS headers a response to an allowed origin carries.
    pub fn decorate(&self, origin: Option<&HeaderValue>, headers: &mut header::HeaderMap) {
        if let Some(o) = origin.filter(|o| o.to_str().is_ok_and(|s| self.origin_allowed(s))) {
            headers.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, o.clone());
            headers.insert(header::VARY, HeaderValue::from_static("Origin"));
        }
    }
}

/// The 405 error for an endpoint called with the wrong method (its response gets `Allow`: [`allow`]).
pub fn method_not_allowed(allow: &'static str) -> ApiError {
    ApiError::new(ErrorCode::MethodNotAllowed, format!("this endpoint accepts {allow}")).param("method")
}

/// `r` with `Allow: allow`.
pub fn allow(mut r: HttpResponse, allow: &'static str) -> HttpResponse {
    r.headers_mut().insert(header::ALLOW, HeaderValue::from_static(allow));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_and_origins() {
        let p = EdgePolicy { allowed_hosts: vec!["box.lan".into()], ..EdgePolicy::default() };
        for ok in
            ["localhost:8080", "127.0.0.1", "[::1]:80", "LOCALHOST.", "a.localhost", "box.lan:8080", "192.168.1.5:8080"]
        {
            assert!(p.host_allowed(ok), "{ok}");
        }
        for no in ["attacker.example", "127.0.0.1.attacker.example:8080", "localhost.attacker.example"] {
            assert!(!p.host_allowed(no), "{no}");
        }
        assert!(EdgePolicy { api_key_set: true, ..EdgePolicy::default() }.host_allowed("attacker.example"));
        let o = EdgePolicy { allowed_origins: vec!["https://app.example/".into()], ..EdgePolicy::default() };
        assert!(o.origin_allowed("https://app.example"));
        assert!(!o.origin_allowed("https://evil.example"));
        assert!(!EdgePolicy::default().origin_allowed("http://localhost:3000"), "none by default");
    }
}
