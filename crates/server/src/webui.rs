//! The web page: a chat at `/` and a live engine view at `/dashboard`, plain HTML, CSS and JavaScript
//! compiled into the binary (`crates/server/webui/`, ~35 KB), and `/v1/engine/stats`, the JSON the
//! engine view polls. The page loads nothing from elsewhere: every response carries a
//! Content-Security-Policy that allows this origin only (images also as `data:`/`blob:`, which attached
//! media are), and the page talks to the same API with the same key, Host and CORS rules.

use actix_web::http::header;
use actix_web::{web, HttpRequest, HttpResponse};
use serde_json::{json, Value};

use crate::handlers::{check_key, engine_snapshot};
use crate::{ApiError, AppState};

/// The policy every page and asset is served with: nothing but this origin (and inline media data).
pub const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; \
media-src 'self' blob:; connect-src 'self'; form-action 'none'; frame-ancestors 'none'; base-uri 'none'";

const ASSETS: &[(&str, &str, &str)] = &[
    ("index.html", "text/html; charset=utf-8", include_str!("../webui/index.html")),
    ("dashboard.html", "text/html; charset=utf-8", include_str!("../webui/dashboard.html")),
    ("style.css", "text/css; charset=utf-8", include_str!("../webui/style.css")),
    ("common.js", "text/javascript; charset=utf-8", include_str!("../webui/common.js")),
    ("markdown.js", "text/javascript; charset=utf-8", include_str!("../webui/markdown.js")),
    ("chat.js", "text/javascript; charset=utf-8", include_str!("../webui/chat.js")),
    ("dashboard.js", "text/javascript; charset=utf-8", include_str!("../webui/dashboard.js")),
    ("favicon.svg", "image/svg+xml", include_str!("../webui/favicon.svg")),
];

fn serve(name: &str) -> HttpResponse {
    match ASSETS.iter().find(|(n, _, _)| *n == name) {
        Some((_, kind, body)) => HttpResponse::Ok()
            .insert_header((header::CONTENT_TYPE, *kind))
            .insert_header((header::CONTENT_SECURITY_POLICY, CSP))
            .insert_header((header::X_CONTENT_TYPE_OPTIONS, "nosniff"))
            .insert_header((header::REFERRER_POLICY, "no-referrer"))
            .insert_header((header::CACHE_CONTROL, "no-cache"))
            .body(*body),
        None => ApiError::new(osprey_protocol::ErrorCode::NotFound, "no such file").error_response_owned(),
    }
}

/// `GET /`: the chat.
pub async fn chat() -> HttpResponse {
    serve("index.html")
}

/// `GET /favicon.ico`, which browsers ask for whatever the page links: the page's icon.
pub async fn favicon() -> HttpResponse {
    serve("favicon.svg")
}

/// `GET /dashboard`: the engine view.
pub async fn dashboard() -> HttpResponse {
    serve("dashboard.html")
}

/// `GET /webui/{file}`: the scripts and the style sheet.
pub async fn asset(name: web::Path<String>) -> HttpResponse {
    serve(name.as_str())
}

/// Bytes of every page and asset together (the page's weight, held under 200 KB by a test).
pub fn total_bytes() -> usize {
    ASSETS.iter().map(|(_, _, b)| b.len()).sum()
}

/// `GET /v1/engine/stats`: what the engine view draws, from the actors' own counters (one query each).
pub async fn stats(state: web::Data<AppState>, req: HttpRequest) -> Result<HttpResponse, ApiError> {
    check_key(&state, &req)?;
    let snap = engine_snapshot(&state).await?;
    let (s, p) = (&snap.scheduler, &snap.prefix);
    let m = &state.metrics;
    let experts = snap.experts.as_ref().map(|e| {
        let (h, mi, bytes) =
            e.layers.iter().fold((0u64, 0u64, 0u64), |(h, m, b), l| (h + l.hits, m + l.misses, b + l.bytes_read));
        json!({
            "residency": if h + mi == 0 { 1.0 } else { h as f64 / (h + mi) as f64 },
            "bytes_read": bytes,
            "resident_bytes": e.resident_bytes,
            "resident_experts": e.resident_experts,
            "evictions": e.evictions,
            "stall_secs": e.stall_secs,
            "reader": e.reader,
            "decoder_layers": state.cfg.about.decoder_layers,
            "layers": e.layers.iter().zip(e.experts.iter().map(Some).chain(std::iter::repeat(None))).map(|(l, x)| json!({
                "hits": l.hits, "misses": l.misses, "bytes_read": l.bytes_read,
                "experts": x.map_or(0, |x| x.count),
                "resident": x.map(|x| x.resident.clone()).unwrap_or_default(),
                "expert_hits": x.map(|x| x.hits.clone()).unwrap_or_default(),
                "expert_misses": x.map(|x| x.misses.clone()).unwrap_or_default(),
            })).collect::<Vec<Value>>(),
        })
    });
    let (requests, failed) = m.requests_and_failures();
    let now =
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0);
    Ok(HttpResponse::Ok().json(json!({
        "time": now,
        "model": state.cfg.model_id,
        "healthy": state.engine.stopped_actor().is_none(),
        "requests": {"running": s.running, "waiting": s.waiting, "total": requests, "failed": failed,
            "preemptions": s.preemptions_total, "cancelled": s.cancelled_total},
        "tokens": {"prompt_total": s.prompt_tokens_total, "generated_total": s.generated_tokens_total,
            "cached_total": s.cached_tokens_total},
        "ttft_recent": m.recent_ttft(),
        "kv": {"pages_total": s.kv_pages_total, "pages_free": s.kv_pages_free, "pages_shared": s.kv_pages_shared,
            "pages_running": s.kv_pages_running,
            "capacity_tokens": s.kv_capacity},
        "prefix_cache": {"lookups": p.lookups, "hits": p.hits, "cached_tokens": s.cached_tokens_total, "bytes": p.bytes,
            "budget": p.budget, "nodes": p.nodes, "evictions": p.evictions, "resumed": p.resumed},
        "vision_cache": {"hits": snap.vision.hits, "misses": snap.vision.misses, "bytes": snap.vision.cached_bytes},
        "experts": experts,
        "family": s.family.iter().map(|m| (m.name.clone(), json!(m.value))).collect::<serde_json::Map<_, _>>(),
        "grammar": {"masks": s.grammar.masks, "mask_seconds": s.grammar.nanos as f64 * 1e-9},
    })))
}
