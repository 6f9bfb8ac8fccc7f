//! Metrics through prometheus-client, rendered in the Prometheus text format 0.0.4.
//!
//! The HTTP layer's metrics are registered once, when the server starts, and updated at the event (a
//! request, a token, a deadline). The engine's counters belong to its actors (nothing is shared between
//! actors), which report them as snapshots; one table, [`ENGINE`], declares each engine metric (name,
//! help, type and where its value lives in the snapshot), and a collector turns it into samples on each
//! scrape. Names, types and help text are those dashboards and `osprey bench serve` read: the test below
//! compares the exposition with one rendered before the move to this crate.

use std::sync::Mutex;
use std::time::Instant;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;

mod engine;
#[cfg(test)]
mod tests;

pub use engine::Engine;
use engine::Scrape;

/// The `Content-Type` of `/metrics`.
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

const BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// The API a request came through (the `endpoint` label of `osprey_requests_total`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Api {
    /// `/v1/chat/completions`.
    Chat,
    /// `/v1/completions`.
    Completions,
    /// `/v1/responses`.
    Responses,
    /// `/v1/messages` (count_tokens included).
    Messages,
    /// `/api/chat` and `/api/generate`.
    Ollama,
}

impl Api {
    const ALL: [Api; 5] = [Api::Chat, Api::Completions, Api::Responses, Api::Messages, Api::Ollama];

    fn label(self) -> [(&'static str, &'static str); 1] {
        let v = match self {
            Api::Chat => "chat",
            Api::Completions => "completions",
            Api::Responses => "responses",
            Api::Messages => "messages",
            Api::Ollama => "ollama",
        };
        [("endpoint", v)]
    }
}

/// The HTTP layer's metrics, registered once in [`Metrics::default`].
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    requests: Family<[(&'static str, &'static str); 1], Counter>,
    failed: Counter,
    ttft: Histogram,
    itl: Histogram,
    deadlines: Counter,
    last_scrape: Mutex<Option<(Instant, u64)>>,
    /// The last [`RECENT_TTFT`] times to first token: (seconds since the epoch, seconds).
    recent: Mutex<std::collections::VecDeque<(f64, f64)>>,
}

/// Times to first token the engine view gets.
const RECENT_TTFT: usize = 64;

impl Default for Metrics {
    fn default() -> Self {
        let requests = Family::<[(&'static str, &'static str); 1], Counter>::default();
        for api in Api::ALL {
            drop(requests.get_or_create(&api.label()));
        }
        let (failed, deadlines) = (Counter::default(), Counter::default());
        let (ttft, itl) = (Histogram::new(BUCKETS), Histogram::new(BUCKETS));
        let mut registry = Registry::default();
        // prometheus-client appends `_total` to a counter's name and a period to its help.
        registry.register("osprey_requests", "Requests received, by endpoint", requests.clone());
        registry.register("osprey_requests_failed", "Requests answered with an error", failed.clone());
        registry.register(
            "osprey_time_to_first_token_seconds",
            "Time from request arrival to the first token",
            ttft.clone(),
        );
        registry.register(
            "osprey_inter_token_latency_seconds",
            "Time between consecutive tokens of a request",
            itl.clone(),
        );
        registry.register(
            "osprey_deadline_exceeded",
            "Generations ended because their deadline passed",
            deadlines.clone(),
        );
        Metrics {
            registry,
            requests,
            failed,
            ttft,
            itl,
            deadlines,
            last_scrape: Mutex::new(None),
            recent: Mutex::new(std::collections::VecDeque::new()),
        }
    }
}

impl Metrics {
    /// A request arrived through `api`.
    pub fn request(&self, api: Api) {
        self.requests.get_or_create(&api.label()).inc();
    }

    /// A request was answered with an error.
    pub fn failed(&self) {
        self.failed.inc();
    }

    /// A generation ended by its deadline.
    pub fn deadline(&self) {
        self.deadlines.inc();
    }

    /// Requests received over every API, and those answered with an error (the engine view).
    pub fn requests_and_failures(&self) -> (u64, u64) {
        let total = Api::ALL.iter().map(|a| self.requests.get_or_create(&a.label()).get()).sum();
        (total, self.failed.get())
    }

    /// Records the time between two tokens of a request.
    pub fn observe_itl(&self, secs: f64) {
        self.itl.observe(secs);
    }

    /// Records a request's time to first token (the histogram and the recent list).
    pub fn observe_ttft(&self, secs: f64) {
        self.ttft.observe(secs);
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64());
        let mut r = self.recent.lock().unwrap_or_else(|p| p.into_inner());
        if r.len() == RECENT_TTFT {
            r.pop_front();
        }
        r.push_back((now, secs));
    }

    /// The recent times to first token, oldest first.
    pub fn recent_ttft(&self) -> Vec<(f64, f64)> {
        self.recent.lock().unwrap_or_else(|p| p.into_inner()).iter().copied().collect()
    }

    /// Prometheus exposition text: the HTTP layer's metrics, then the engine's from `engine`.
    pub fn render(&self, engine: Engine) -> String {
        let rate = self.generation_rate(engine.scheduler.generated_tokens_total);
        let mut scrape = Registry::default();
        scrape.register_collector(Box::new(Scrape::new(engine, rate)));
        let mut out = String::new();
        // Writing into a String cannot fail, and every name and label is ours.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &scrape);
        out
    }

    /// Tokens generated per second since the previous scrape (0 on the first).
    fn generation_rate(&self, generated: u64) -> f64 {
        let now = Instant::now();
        let mut last = self.last_scrape.lock().unwrap_or_else(|p| p.into_inner());
        let r = match *last {
            Some((t, n)) if now > t => generated.saturating_sub(n) as f64 / (now - t).as_secs_f64(),
            _ => 0.0,
        };
        *last = Some((now, generated));
        r
    }
}
