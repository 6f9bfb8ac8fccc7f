//! # osprey-server — the HTTP endpoint (OpenAI, Anthropic and Ollama APIs, and the web page)
//!
//! Brief overview: actix-web routes the OpenAI API (`POST /v1/chat/completions`, `/v1/completions`,
//! `/v1/responses` with `GET`/`DELETE /v1/responses/{id}`, `GET /v1/models` and `/v1/models/{id}`), the
//! Anthropic Messages API (`POST /v1/messages`, `/v1/messages/count_tokens`), the Ollama API
//! (`POST /api/chat`, `/api/generate`, `/api/show`, `GET /api/tags`, `/api/ps`, `/api/version`), the
//! engine's state (`GET /health`, `/metrics`, `/v1/engine/stats`) and the web page (`/`, `/dashboard`,
//! `/webui/{file}`, `/favicon.ico`). Every front end translates its body into one chat request
//! (`handlers::prepare_chat`): validated, rendered and tokenized by the tokenizer actor, run by the
//! scheduler actor, its token events streamed back (SSE, NDJSON or one JSON body) through one answer
//! (`answer.rs`: reasoning, text and tool calls). The server owns only its HTTP metrics; it talks to the
//! engine through `osprey-protocol` senders. Errors become OpenAI error envelopes in one place
//! ([`ApiError`]); the Anthropic and Ollama front ends rewrap them in their own shapes.

mod answer;
mod body;
mod check;
pub mod config;
mod edge;
mod error;
mod generate;
mod grammar;
mod handlers;
mod liveness;
mod messages;
mod metrics;
mod ollama;
mod peer;
mod responses;
mod schema;
mod state;
mod store;
mod text;
pub mod tools;
mod validate;
mod webui;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64};

use actix_web::dev::Server;
use actix_web::{web, App, HttpRequest, HttpServer};
use osprey_protocol::ErrorCode;
use tokio::sync::watch;

pub use body::Endpoint;
pub use check::check_body;
pub use config::{Limits, ModelAbout, ServerConfig};
pub use error::ApiError;
pub use metrics::Metrics;
pub use state::{AppState, Engine, Phase};
pub use validate::schema_grammar;
pub use webui::{total_bytes as webui_bytes, CSP as WEBUI_CSP};

/// A forced call of a tool whose parameters are `schema`, as the grammar the tokenizer compiles, after the
/// same schema gate as every other path (the `schema` fuzz target's tool entry).
pub fn tool_call_grammar(
    schema: &serde_json::Value,
    parallel: bool,
) -> Result<osprey_protocol::constraint::Grammar, ApiError> {
    let tools = tools::parse_chat_tools(Some(
        &serde_json::json!([{"type": "function", "function": {"name": "f", "parameters": schema}}]),
    ))?;
    Ok(osprey_protocol::constraint::Grammar::Lark(grammar::call_grammar(&tools, None, parallel)))
}

/// A bound server: await `server`; send [`Phase`]s on `phase` to drain it.
pub struct Bound {
    /// The running server (to be awaited).
    pub server: Server,
    /// The bound address (port 0 picks one).
    pub addr: SocketAddr,
    /// Drives a graceful shutdown (dropping it leaves the server serving).
    pub phase: watch::Sender<Phase>,
    /// The actors behind it: [`Engine::stopped`] resolves when one of them dies.
    pub engine: Engine,
}

impl std::fmt::Debug for Bound {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bound").field("addr", &self.addr).finish()
    }
}

/// Binds the HTTP server. On a graceful stop, connections still open after `shutdown_grace_secs` + 10 s
/// are closed.
pub fn bind(cfg: ServerConfig, engine: Engine, addr: &str, workers: usize) -> std::io::Result<Bound> {
    let (phase_tx, phase) = watch::channel(Phase::Serving);
    let limits_store = (cfg.limits.max_stored_responses, cfg.limits.max_stored_response_bytes);
    let shutdown_timeout = cfg.shutdown_grace_secs.saturating_add(10);
    let idle = cfg.idle_timeout_secs;
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
    let state = web::Data::new(AppState {
        cfg,
        engine: engine.clone(),
        metrics: Metrics::default(),
        next_id: AtomicU64::new(1),
        ready: AtomicBool::new(true),
        created,
        phase,
        responses: store::ResponseStore::new(limits_store.0, limits_store.1),
    });
    let webui_on = state.cfg.webui;
    let edge = std::sync::Arc::new(edge::EdgePolicy {
        allowed_hosts: state.cfg.allowed_hosts.clone(),
        allowed_origins: state.cfg.allowed_origins.clone(),
        api_key_set: state.cfg.api_key.is_some(),
    });
    let server = HttpServer::new(move || {
        let edge = edge.clone();
        App::new()
            .app_data(state.clone())
            .wrap_fn(move |req, srv| {
                if let Some(resp) = edge.intercept(req.method(), req.headers()) {
                    let r = req.into_response(resp).map_into_right_body();
                    return futures_util::future::Either::Left(futures_util::future::ready(Ok(r)));
                }
                let origin = req.headers().get(actix_web::http::header::ORIGIN).cloned();
                let peer = req.conn_data::<peer::PeerSocket>().cloned();
                let fut = actix_web::dev::Service::call(&srv, req);
                let edge = edge.clone();
                futures_util::future::Either::Right(async move {
                    // A client that hangs up before its answer is ready takes the work with it: the handler
                    // (and the generation it awaits) is dropped at once (peer.rs). Streams return their
                    // response at once and notice a departure on their next write.
                    let res = match peer {
                        Some(p) => tokio::select! {
                            r = fut => r,
                            () = peer::hung_up(&p) => Err(ApiError::new(ErrorCode::RequestTimeout, "the client left").into()),
                        },
                        None => fut.await,
                    };
                    let mut res = res?;
                    edge.decorate(origin.as_ref(), res.headers_mut());
                    Ok(res.map_into_left_body())
                })
            })
            .configure(|c| routes(c, webui_on))
            .default_service(web::to(|req: HttpRequest| async move {
                shaped(&req, ApiError::new(ErrorCode::NotFound, "no such endpoint").param("path"))
            }))
    })
    .on_connect(peer::on_connect)
    .workers(workers.max(1))
    // An idle keep-alive connection, and one that does not finish its request head, is closed after
    // this long; bodies have their own limit (`body.rs`).
    .keep_alive(std::time::Duration::from_secs_f64(idle.max(0.001)))
    .client_request_timeout(std::time::Duration::from_secs_f64(idle.max(0.001)))
    // A client that closes its side has left (HTTP clients never half-close while they wait for an
    // answer): the connection ends and a streamed answer's body is dropped, which `handlers::pump`
    // sees at once, so a stream abandoned while queued is cancelled before its prefill (issue 49).
    .h1_allow_half_closed(false)
    .disable_signals()
    .shutdown_timeout(shutdown_timeout)
    .bind(addr)?;
    let bound = server.addrs().first().copied().ok_or_else(|| std::io::Error::other("no address bound"))?;
    Ok(Bound { server: server.run(), addr: bound, phase: phase_tx, engine })
}

/// An error for a request no API's handler shapes (an unknown path, a wrong method, a model lookup) in
/// the shape its client reads: Ollama's `{"error": "…"}` under `/api/` (the `ollama` client's
/// `ResponseError.error` was a dict), Anthropic's envelope when the request carries `anthropic-version`
/// (every Anthropic SDK call does), else OpenAI's.
fn shaped(req: &HttpRequest, e: ApiError) -> actix_web::HttpResponse {
    use actix_web::ResponseError;
    if req.path().starts_with("/api/") {
        ollama::OllamaError::from(e).error_response()
    } else if req.headers().contains_key("anthropic-version") {
        messages::AnthropicError::from(e).error_response()
    } else {
        e.error_response()
    }
}

/// 405 naming the allowed methods, in the client's shape.
fn not_allowed(req: &HttpRequest, allowed: &'static str) -> actix_web::HttpResponse {
    edge::allow(shaped(req, edge::method_not_allowed(allowed)), allowed)
}

/// `GET /v1/models/{id}`, its errors in the client's shape.
async fn model_shaped(state: web::Data<AppState>, req: HttpRequest, id: web::Path<String>) -> actix_web::HttpResponse {
    match handlers::model(state, req.clone(), id).await {
        Ok(r) => r,
        Err(e) => shaped(&req, e),
    }
}

/// Every route: the OpenAI, Anthropic and Ollama APIs, the engine's state and, unless turned off, the web
/// page. A known path asked with another method is 405 naming the allowed ones.
fn routes(cfg: &mut web::ServiceConfig, webui_on: bool) {
    let post = |path: &'static str| {
        web::resource(path).default_service(web::to(|req: HttpRequest| async move { not_allowed(&req, "POST") }))
    };
    let get = |path: &'static str| {
        web::resource(path).default_service(web::to(|req: HttpRequest| async move { not_allowed(&req, "GET") }))
    };
    cfg.service(post("/v1/chat/completions").route(web::post().to(handlers::chat)))
        .service(post("/v1/completions").route(web::post().to(handlers::completions)))
        .service(post("/v1/responses").route(web::post().to(responses::create)))
        .service(
            web::resource("/v1/responses/{id}")
                .route(web::get().to(responses::get))
                .route(web::delete().to(responses::delete))
                .default_service(web::to(|req: HttpRequest| async move { not_allowed(&req, "GET, DELETE") })),
        )
        .service(post("/v1/messages").route(web::post().to(messages::create)))
        .service(post("/v1/messages/count_tokens").route(web::post().to(messages::count_tokens)))
        .service(post("/api/chat").route(web::post().to(ollama::chat)))
        .service(post("/api/generate").route(web::post().to(ollama::generate)))
        .service(post("/api/show").route(web::post().to(ollama::show)))
        .service(get("/api/tags").route(web::get().to(ollama::tags)))
        .service(get("/api/ps").route(web::get().to(ollama::ps)))
        .service(get("/api/version").route(web::get().to(ollama::version)))
        .service(get("/v1/models").route(web::get().to(handlers::models)))
        .service(get("/v1/models/{id}").route(web::get().to(model_shaped)))
        .service(get("/health").route(web::get().to(handlers::health)))
        .service(get("/metrics").route(web::get().to(handlers::metrics)))
        .service(get("/v1/engine/stats").route(web::get().to(webui::stats)))
        .configure(|c| {
            if webui_on {
                c.service(get("/").route(web::get().to(webui::chat)).route(web::head().to(webui::chat)))
                    .service(get("/favicon.ico").route(web::get().to(webui::favicon)))
                    .service(get("/dashboard").route(web::get().to(webui::dashboard)))
                    .service(get("/webui/{file}").route(web::get().to(webui::asset)));
            }
        });
}

impl ApiError {
    fn error_response_owned(self) -> actix_web::HttpResponse {
        actix_web::ResponseError::error_response(&self)
    }
}
