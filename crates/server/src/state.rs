//! The HTTP layer's shared state ([`AppState`]: configuration, metrics, the shutdown phase, the response
//! store and the actors' inboxes), which every handler reads. Its own module so that handlers depend on
//! it, and `lib.rs` only wires routes.

use std::sync::atomic::{AtomicBool, AtomicU64};
use std::sync::Arc;

use osprey_protocol::experts::ExpertStats;
use osprey_protocol::prefix::PrefixCommand;
use osprey_protocol::scheduler::SchedulerCommand;
use osprey_protocol::tokenizer::TokenizerCommand;
use osprey_protocol::vision::VisionCommand;
use tokio::sync::mpsc::UnboundedSender;
use tokio::sync::watch;

use crate::config::ServerConfig;
use crate::metrics::Metrics;
use crate::store;

/// Where a graceful shutdown stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Serving normally.
    Serving,
    /// A signal came: no new connections or requests; running generations go on.
    Draining,
    /// The grace period is over: running generations end with an `unavailable` error (streams with an
    /// error event and `[DONE]`).
    Expired,
}

/// Shared state of the HTTP layer.
#[derive(Debug)]
pub struct AppState {
    pub(crate) cfg: ServerConfig,
    pub(crate) metrics: Metrics,
    pub(crate) next_id: AtomicU64,
    pub(crate) ready: AtomicBool,
    pub(crate) created: u64,
    pub(crate) phase: watch::Receiver<Phase>,
    /// The actors' inboxes (and `/health` asks whether every one is still open).
    pub(crate) engine: Engine,
    /// Responses kept for `previous_response_id`.
    pub(crate) responses: store::ResponseStore,
}

/// The actors the server talks to.
#[derive(Debug, Clone)]
pub struct Engine {
    /// Tokenizer actor inbox.
    pub tokenizer: UnboundedSender<TokenizerCommand>,
    /// Scheduler actor inbox.
    pub scheduler: UnboundedSender<SchedulerCommand>,
    /// Vision actor inbox (stats only), when the model has a tower.
    pub vision: Option<UnboundedSender<VisionCommand>>,
    /// Prefix-cache actor inbox (stats only), when the cache is on.
    pub prefix: Option<UnboundedSender<PrefixCommand>>,
    /// The expert residency manager's counters, when experts stream from disk.
    pub experts: Option<Arc<dyn ExpertStats>>,
}

impl AppState {
    /// Limits of a request body read at `endpoint`: chat, Responses and Messages bodies may carry media
    /// inline (`max_body_bytes`); a completion's is its prompt, at most twice what the context can hold
    /// as text plus 1 MiB.
    pub(crate) fn body_limits(&self, endpoint: crate::body::Endpoint) -> crate::body::BodyLimits {
        let all = self.cfg.limits.max_body_bytes;
        let max_bytes = match endpoint {
            crate::body::Endpoint::Completions => {
                let text = self.cfg.context_len.saturating_mul(self.cfg.max_token_bytes.max(1));
                all.min(text.saturating_mul(2).saturating_add(1 << 20))
            }
            _ => all,
        };
        crate::body::BodyLimits {
            max_bytes,
            timeout: std::time::Duration::from_secs_f64(self.cfg.body_timeout_secs.max(0.001)),
            json: crate::body::JsonLimits::for_context(self.cfg.context_len),
            any_type_without_origin: false,
        }
    }
}
