//! HTTP-side metrics (owned by the server; engine gauges are asked from the scheduler per scrape) and the
//! Prometheus text rendering.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use osprey_protocol::prefix::PrefixStats;
use osprey_protocol::scheduler::SchedulerStats;
use osprey_protocol::vision::VisionStats;

const BUCKETS: [f64; 12] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0];

/// A fixed-bucket histogram of seconds.
#[derive(Debug, Default)]
pub struct Histogram {
    counts: [AtomicU64; BUCKETS.len()],
    count: AtomicU64,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// Records one observation.
    pub fn observe(&self, secs: f64) {
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            if secs <= *b {
                c.fetch_add(1, Ordering::Relaxed);
            }
        }
        self.count.fetch_add(1, Ordering::Relaxed);
        self.sum_micros.fetch_add((secs * 1e6) as u64, Ordering::Relaxed);
    }

    fn render(&self, name: &str, help: &str, out: &mut String) {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} histogram\n"));
        for (b, c) in BUCKETS.iter().zip(&self.counts) {
            out.push_str(&format!("{name}_bucket{{le=\"{b}\"}} {}\n", c.load(Ordering::Relaxed)));
        }
        let n = self.count.load(Ordering::Relaxed);
        out.push_str(&format!("{name}_bucket{{le=\"+Inf\"}} {n}\n"));
        out.push_str(&format!("{name}_sum {}\n", self.sum_micros.load(Ordering::Relaxed) as f64 / 1e6));
        out.push_str(&format!("{name}_count {n}\n"));
    }
}

/// Counters of the HTTP layer.
#[derive(Debug)]
pub struct Metrics {
    /// Requests that returned a response (any status), per endpoint.
    pub chat_requests: AtomicU64,
    /// Completion requests.
    pub completion_requests: AtomicU64,
    /// Responses API requests.
    pub responses_requests: AtomicU64,
    /// Anthropic Messages requests (count_tokens included).
    pub messages_requests: AtomicU64,
    /// `/api/chat` and `/api/generate` requests (the Ollama API).
    pub ollama_requests: AtomicU64,
    /// Requests answered with an error.
    pub failed_requests: AtomicU64,
    /// Time to first token.
    pub ttft: Histogram,
    /// Time between consecutive tokens.
    pub itl: Histogram,
    /// Generations ended by their deadline.
    pub deadlines: AtomicU64,
    last_scrape: Mutex<Option<(Instant, u64)>>,
    /// The last [`RECENT_TTFT`] times to first token: (seconds since the epoch, seconds).
    recent: Mutex<std::collections::VecDeque<(f64, f64)>>,
}

/// Times to first token the engine view gets.
const RECENT_TTFT: usize = 64;

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            chat_requests: AtomicU64::new(0),
            completion_requests: AtomicU64::new(0),
            responses_requests: AtomicU64::new(0),
            messages_requests: AtomicU64::new(0),
            ollama_requests: AtomicU64::new(0),
            failed_requests: AtomicU64::new(0),
            ttft: Histogram::default(),
            itl: Histogram::default(),
            deadlines: AtomicU64::new(0),
            last_scrape: Mutex::new(None),
            recent: Mutex::new(std::collections::VecDeque::new()),
        }
    }
}

fn gauge(out: &mut String, name: &str, help: &str, kind: &str, v: f64) {
    out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"));
}

impl Metrics {
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

    /// Prometheus exposition text: the HTTP layer's metrics, then the engine's (scheduler, PLE and
    /// speculation when the model has them, counters, caches), in this order.
    pub fn render(&self, s: &SchedulerStats, v: &VisionStats, p: &PrefixStats) -> String {
        let mut out = String::new();
        self.render_http(&mut out);
        render_scheduler(s, &mut out);
        render_family_and_spec(s, &mut out);
        self.render_counters(s, &mut out);
        render_caches(s, v, p, &mut out);
        out
    }

    fn render_http(&self, out: &mut String) {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed) as f64;
        out.push_str(
            "# HELP osprey_requests_total Requests received, by endpoint.\n# TYPE osprey_requests_total counter\n",
        );
        out.push_str(&format!("osprey_requests_total{{endpoint=\"chat\"}} {}\n", ld(&self.chat_requests)));
        out.push_str(&format!("osprey_requests_total{{endpoint=\"completions\"}} {}\n", ld(&self.completion_requests)));
        out.push_str(&format!("osprey_requests_total{{endpoint=\"responses\"}} {}\n", ld(&self.responses_requests)));
        out.push_str(&format!("osprey_requests_total{{endpoint=\"messages\"}} {}\n", ld(&self.messages_requests)));
        out.push_str(&format!("osprey_requests_total{{endpoint=\"ollama\"}} {}\n", ld(&self.ollama_requests)));
        gauge(
            out,
            "osprey_requests_failed_total",
            "Requests answered with an error.",
            "counter",
            ld(&self.failed_requests),
        );
        self.ttft.render("osprey_time_to_first_token_seconds", "Time from request arrival to the first token.", out);
        self.itl.render("osprey_inter_token_latency_seconds", "Time between consecutive tokens of a request.", out);
        gauge(
            out,
            "osprey_deadline_exceeded_total",
            "Generations ended because their deadline passed.",
            "counter",
            ld(&self.deadlines),
        );
    }

    /// The engine's counters and the generation rate since the previous scrape.
    fn render_counters(&self, s: &SchedulerStats, out: &mut String) {
        gauge(
            out,
            "osprey_kv_pages_shared",
            "KV pages of running sequences shared with the prefix cache or another sequence.",
            "gauge",
            s.kv_pages_shared as f64,
        );
        gauge(
            out,
            "osprey_overloaded_total",
            "Requests refused with 503 overloaded (queue full, or waited too long).",
            "counter",
            s.overloaded_total as f64,
        );
        gauge(
            out,
            "osprey_preemptions_total",
            "Sequences preempted (and later recomputed) because KV pages ran out.",
            "counter",
            s.preemptions_total as f64,
        );
        gauge(out, "osprey_prompt_tokens_total", "Prompt tokens computed.", "counter", s.prompt_tokens_total as f64);
        gauge(out, "osprey_generated_tokens_total", "Tokens generated.", "counter", s.generated_tokens_total as f64);
        gauge(
            out,
            "osprey_cancelled_total",
            "Sequences cancelled because the client left or a stop string matched.",
            "counter",
            s.cancelled_total as f64,
        );
        gauge(out, "osprey_steps_total", "Engine steps executed.", "counter", s.steps_total as f64);
        let now = Instant::now();
        let rate = {
            let mut last = self.last_scrape.lock().unwrap_or_else(|p| p.into_inner());
            let r = match *last {
                Some((t, n)) if now > t => {
                    (s.generated_tokens_total.saturating_sub(n)) as f64 / (now - t).as_secs_f64()
                }
                _ => 0.0,
            };
            *last = Some((now, s.generated_tokens_total));
            r
        };
        gauge(
            out,
            "osprey_generation_tokens_per_second",
            "Tokens generated per second since the previous scrape.",
            "gauge",
            rate,
        );
    }
}

/// Queue, running sequences, KV and expert slots.
fn render_scheduler(s: &SchedulerStats, out: &mut String) {
    gauge(out, "osprey_queue_length", "Requests waiting for admission.", "gauge", s.waiting as f64);
    gauge(out, "osprey_running_sequences", "Sequences being computed.", "gauge", s.running as f64);
    gauge(out, "osprey_kv_tokens", "Tokens held in KV by running sequences.", "gauge", s.kv_tokens as f64);
    gauge(out, "osprey_kv_capacity_tokens", "KV capacity in tokens.", "gauge", s.kv_capacity as f64);
    let used = s.kv_pages_total.saturating_sub(s.kv_pages_free);
    gauge(out, "osprey_kv_pages_total", "Pages in the KV pool.", "gauge", s.kv_pages_total as f64);
    gauge(out, "osprey_kv_pages_used", "KV pages held by sequences or the prefix cache.", "gauge", used as f64);
    gauge(out, "osprey_kv_pages_free", "KV pages nobody holds.", "gauge", s.kv_pages_free as f64);
    let slots = s.expert_slots;
    gauge(
        out,
        "osprey_expert_slot_hits_total",
        "Routed experts a step found in a compute-backend slot (no transfer).",
        "counter",
        slots.hits as f64,
    );
    gauge(
        out,
        "osprey_expert_slot_misses_total",
        "Routed experts uploaded into a compute-backend slot.",
        "counter",
        slots.misses as f64,
    );
    gauge(
        out,
        "osprey_expert_slot_waves_total",
        "Expert waves run (one routed-experts op each).",
        "counter",
        slots.waves as f64,
    );
    gauge(
        out,
        "osprey_expert_slots",
        "Compute-backend expert slots over every MoE layer.",
        "gauge",
        slots.slots as f64,
    );
    gauge(out, "osprey_expert_slots_filled", "Expert slots holding an expert.", "gauge", slots.filled as f64);
    if let Some(d) = s.device {
        for (name, help, kind, v) in [
            ("osprey_device_memory_bytes", "Bytes of compute-device memory.", "gauge", d.memory_total),
            (
                "osprey_device_memory_free_bytes",
                "Bytes of compute-device memory not allocated.",
                "gauge",
                d.memory_free,
            ),
            ("osprey_device_upload_bytes_total", "Bytes copied host to device.", "counter", d.bytes_to_device),
            ("osprey_device_download_bytes_total", "Bytes copied device to host.", "counter", d.bytes_from_device),
        ] {
            gauge(out, name, help, kind, v as f64);
        }
    }
}

/// The model family's own metrics (by name) and speculative decoding, for the models that have them.
fn render_family_and_spec(s: &SchedulerStats, out: &mut String) {
    for m in &s.family {
        gauge(out, &m.name, &m.help, if m.counter { "counter" } else { "gauge" }, m.value);
    }
    let g = s.grammar;
    gauge(
        out,
        "osprey_grammar_masks_total",
        "Token masks computed for constrained decoding.",
        "counter",
        g.masks as f64,
    );
    gauge(
        out,
        "osprey_grammar_mask_seconds_total",
        "Seconds spent computing token masks.",
        "counter",
        g.nanos as f64 * 1e-9,
    );
    if let Some(c) = s.spec {
        for (name, help, kind, v) in [
            ("osprey_spec_drafted_total", "Tokens drafted by the MTP head.", "counter", c.drafted as f64),
            ("osprey_spec_accepted_total", "Drafted tokens the main model accepted.", "counter", c.accepted as f64),
            (
                "osprey_spec_verifications_total",
                "Speculative steps of a sequence (its drafts verified in one main forward).",
                "counter",
                c.forwards as f64,
            ),
            ("osprey_spec_emitted_tokens_total", "Tokens the speculative steps emitted.", "counter", c.emitted as f64),
            (
                "osprey_spec_tokens_per_forward",
                "Tokens per speculative step of a sequence (per pass over the main weights).",
                "gauge",
                c.tokens_per_forward(),
            ),
        ] {
            gauge(out, name, help, kind, v);
        }
        out.push_str("# HELP osprey_spec_acceptance_rate Accepted over drafted tokens, per draft position.\n");
        out.push_str("# TYPE osprey_spec_acceptance_rate gauge\n");
        for (i, (&d, &a)) in c.drafted_at.iter().zip(&c.accepted_at).enumerate() {
            let rate = if d == 0 { 0.0 } else { a as f64 / d as f64 };
            out.push_str(&format!("osprey_spec_acceptance_rate{{position=\"{i}\"}} {rate}\n"));
        }
    }
}

/// Prefix and vision caches.
fn render_caches(s: &SchedulerStats, v: &VisionStats, p: &PrefixStats, out: &mut String) {
    let prefix_rate = if s.prompt_tokens_total + s.cached_tokens_total > 0 {
        s.cached_tokens_total as f64 / (s.prompt_tokens_total + s.cached_tokens_total) as f64
    } else {
        0.0
    };
    gauge(
        out,
        "osprey_prefix_cache_hit_rate",
        "Fraction of prompt tokens served from the prefix cache.",
        "gauge",
        prefix_rate,
    );
    gauge(
        out,
        "osprey_prefix_cache_cached_tokens_total",
        "Prompt tokens served from the prefix cache.",
        "counter",
        s.cached_tokens_total as f64,
    );
    gauge(out, "osprey_prefix_cache_lookups_total", "Prefix-cache lookups.", "counter", p.lookups as f64);
    gauge(
        out,
        "osprey_prefix_cache_hits_total",
        "Prefix-cache lookups that reused at least one page.",
        "counter",
        p.hits as f64,
    );
    gauge(out, "osprey_prefix_cache_evictions_total", "Prefix-cache nodes evicted.", "counter", p.evictions as f64);
    gauge(
        out,
        "osprey_prefix_cache_bytes",
        "Bytes held by the prefix cache (KV pages + snapshots).",
        "gauge",
        p.bytes as f64,
    );
    gauge(
        out,
        "osprey_prefix_cache_device_bytes",
        "Of the prefix cache's bytes, KV pages (the compute device's memory).",
        "gauge",
        p.device_bytes as f64,
    );
    gauge(
        out,
        "osprey_prefix_cache_host_bytes",
        "Of the prefix cache's bytes, recurrent-state snapshots (host memory).",
        "gauge",
        p.host_bytes as f64,
    );
    gauge(out, "osprey_prefix_cache_nodes", "Pages in the prefix tree.", "gauge", p.nodes as f64);
    let vt = v.hits + v.misses;
    gauge(
        out,
        "osprey_vision_cache_hit_rate",
        "Fraction of media encodes served from the encoder cache.",
        "gauge",
        if vt > 0 { v.hits as f64 / vt as f64 } else { 0.0 },
    );
    gauge(out, "osprey_vision_cache_bytes", "Bytes held by the encoder cache.", "gauge", v.cached_bytes as f64);
}

/// Expert residency metrics: per layer and total hits, misses, bytes read, read time, stall, residency.
pub fn render_experts(e: &osprey_protocol::experts::ResidencyStats) -> String {
    let mut out = String::new();
    let metric = |out: &mut String,
                  name: &str,
                  help: &str,
                  kind: &str,
                  per: &dyn Fn(&osprey_protocol::experts::LayerStats) -> f64| {
        out.push_str(&format!("# HELP {name} {help}\n# TYPE {name} {kind}\n"));
        for (i, l) in e.layers.iter().enumerate() {
            out.push_str(&format!("{name}{{layer=\"{i}\"}} {}\n", per(l)));
        }
    };
    metric(&mut out, "osprey_expert_hits_total", "Expert accesses served from RAM.", "counter", &|l| l.hits as f64);
    metric(&mut out, "osprey_expert_misses_total", "Expert accesses read from disk.", "counter", &|l| l.misses as f64);
    metric(&mut out, "osprey_expert_bytes_read_total", "Bytes of experts read from disk.", "counter", &|l| {
        l.bytes_read as f64
    });
    metric(&mut out, "osprey_expert_read_seconds_total", "Seconds spent in expert read batches.", "counter", &|l| {
        l.read_secs
    });
    metric(
        &mut out,
        "osprey_expert_read_batches_total",
        "Expert read batches (one per layer step with misses).",
        "counter",
        &|l| l.batches as f64,
    );
    let (h, m) = e.layers.iter().fold((0u64, 0u64), |(h, m), l| (h + l.hits, m + l.misses));
    let residency = if h + m == 0 { 1.0 } else { h as f64 / (h + m) as f64 };
    gauge(&mut out, "osprey_expert_residency", "Fraction of expert accesses served from RAM.", "gauge", residency);
    gauge(
        &mut out,
        "osprey_expert_stall_seconds_total",
        "Seconds the runner waited for experts after the shared expert.",
        "counter",
        e.stall_secs,
    );
    gauge(&mut out, "osprey_expert_resident_bytes", "Bytes of experts held in RAM.", "gauge", e.resident_bytes as f64);
    gauge(&mut out, "osprey_expert_resident", "Experts held in RAM.", "gauge", e.resident_experts as f64);
    gauge(&mut out, "osprey_expert_evictions_total", "Experts evicted.", "counter", e.evictions as f64);
    gauge(
        &mut out,
        "osprey_expert_arena_slots",
        "Slots of the host arena experts are read into.",
        "gauge",
        e.arena_slots as f64,
    );
    gauge(&mut out, "osprey_expert_arena_used", "Host arena slots holding an expert.", "gauge", e.arena_used as f64);
    gauge(
        &mut out,
        "osprey_expert_arena_registered",
        "1 when the host arena is registered with io_uring (reads into fixed buffers).",
        "gauge",
        if e.arena_registered { 1.0 } else { 0.0 },
    );
    out
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use osprey_protocol::experts::{LayerStats, ResidencyStats};
    use osprey_protocol::prefix::PrefixStats;
    use osprey_protocol::runner::{DeviceCounters, ExpertSlots, FamilyMetric, GrammarCounters, SpecCounters};
    use osprey_protocol::scheduler::SchedulerStats;
    use osprey_protocol::vision::VisionStats;

    use super::*;

    /// The exposition of [`Metrics::render`] before the metrics moved to prometheus-client, generated by
    /// that code from [`snapshot`] (`OSPREY_WRITE_METRICS_FIXTURE=1`), never edited by hand.
    const BEFORE: &str = "fixtures/metrics_before.prom";

    /// A snapshot with every optional group present and distinct values (binary-exact fractions, so a
    /// value compares exactly after a round trip through either renderer).
    fn snapshot() -> (SchedulerStats, VisionStats, PrefixStats, ResidencyStats) {
        let s = SchedulerStats {
            waiting: 2,
            running: 3,
            kv_tokens: 300,
            kv_capacity: 4096,
            kv_pages_total: 256,
            kv_pages_free: 200,
            kv_pages_shared: 5,
            kv_pages_running: 40,
            expert_slots: ExpertSlots { hits: 11, misses: 7, waves: 9, slots: 24, filled: 20 },
            device: Some(DeviceCounters {
                memory_total: 1 << 34,
                memory_free: 1 << 33,
                bytes_to_device: 12345,
                bytes_from_device: 678,
            }),
            family: vec![
                FamilyMetric { name: "osprey_ple_hits_total".into(), help: "PLE rows in RAM.".into(), counter: true, value: 17.0 },
                FamilyMetric { name: "osprey_ple_resident_bytes".into(), help: "PLE bytes.".into(), counter: false, value: 4096.0 },
            ],
            grammar: GrammarCounters { masks: 13, nanos: 1_500_000_000 },
            spec: Some(SpecCounters {
                drafted: 40,
                accepted: 30,
                drafted_at: [20, 10, 8, 2],
                accepted_at: [18, 8, 4, 0],
                forwards: 20,
                emitted: 50,
            }),
            preemptions_total: 1,
            prompt_tokens_total: 1000,
            generated_tokens_total: 500,
            cached_tokens_total: 250,
            cancelled_total: 4,
            steps_total: 600,
            overloaded_total: 6,
        };
        let v = VisionStats { hits: 3, misses: 1, cached_bytes: 2048 };
        let p = PrefixStats {
            lookups: 8,
            hits: 4,
            cached_tokens: 250,
            evictions: 2,
            resumed: 1,
            bytes: 3 << 20,
            device_bytes: 2 << 20,
            host_bytes: 1 << 20,
            budget: 1 << 30,
            nodes: 12,
        };
        let layer = |i: u64| LayerStats { hits: 10 + i, misses: 3 + i, bytes_read: 1000 * i, read_secs: 0.25 * i as f64, batches: i };
        let e = ResidencyStats {
            layers: vec![layer(0), layer(1)],
            resident_bytes: 1 << 24,
            resident_experts: 6,
            evictions: 5,
            stall_secs: 0.5,
            arena_slots: 8,
            arena_used: 3,
            arena_registered: true,
            ..Default::default()
        };
        (s, v, p, e)
    }

    /// The HTTP layer after a few events: every endpoint, a failure, a deadline, two TTFTs, three ITLs.
    fn http() -> Metrics {
        let m = Metrics::default();
        for (c, n) in [
            (&m.chat_requests, 5),
            (&m.completion_requests, 4),
            (&m.responses_requests, 3),
            (&m.messages_requests, 2),
            (&m.ollama_requests, 1),
            (&m.failed_requests, 2),
            (&m.deadlines, 1),
        ] {
            c.fetch_add(n, Ordering::Relaxed);
        }
        m.observe_ttft(0.25);
        m.observe_ttft(2.0);
        for t in [0.015625, 0.0625, 40.0] {
            m.itl.observe(t);
        }
        m
    }

    /// All of `/metrics` for [`snapshot`], as the handler assembles it (responses usage: 3, 4096 bytes).
    fn exposition() -> String {
        let (s, v, p, e) = snapshot();
        let mut body = http().render(&s, &v, &p);
        body.push_str(&render_experts(&e));
        for (name, help, v) in [
            ("osprey_responses_stored", "Responses kept for previous_response_id.", 3),
            ("osprey_responses_stored_bytes", "Bytes of the stored conversations.", 4096),
        ] {
            body.push_str(&format!("# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}\n"));
        }
        body
    }

    /// Every sample (name with labels, in the order of the labels as written) → (value, the type and help
    /// of its family). The generation rate is left out: it depends on the time between two scrapes.
    fn samples(text: &str) -> BTreeMap<String, (f64, String, String)> {
        let (mut help, mut kind) = (BTreeMap::new(), BTreeMap::new());
        let mut out = BTreeMap::new();
        for line in text.lines().filter(|l| !l.is_empty()) {
            if let Some(r) = line.strip_prefix("# HELP ") {
                let (n, h) = r.split_once(' ').expect("help text");
                help.insert(n.to_string(), h.to_string());
            } else if let Some(r) = line.strip_prefix("# TYPE ") {
                let (n, t) = r.split_once(' ').expect("type");
                kind.insert(n.to_string(), t.to_string());
            } else if !line.starts_with('#') {
                let (sample, value) = line.rsplit_once(' ').expect("sample value");
                let name = sample.split('{').next().expect("name");
                let family = [name, name.trim_end_matches("_bucket"), name.trim_end_matches("_sum"), name.trim_end_matches("_count")]
                    .into_iter()
                    .find(|f| kind.contains_key(*f))
                    .unwrap_or_else(|| panic!("{name} has no TYPE line"));
                if family == "osprey_generation_tokens_per_second" {
                    continue;
                }
                let v: f64 = value.parse().unwrap_or_else(|_| panic!("{line}: value"));
                out.insert(sample.to_string(), (v, kind[family].clone(), help[family].clone()));
            }
        }
        out
    }

    /// Names, label sets, types, help text and values are those of the exposition before the move.
    #[test]
    fn exposition_unchanged() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(BEFORE);
        let now = exposition();
        if std::env::var_os("OSPREY_WRITE_METRICS_FIXTURE").is_some() {
            std::fs::write(&path, &now).expect("write the fixture");
        }
        let before = std::fs::read_to_string(&path).expect("the fixture");
        let (b, n) = (samples(&before), samples(&now));
        assert!(b.len() > 90, "the fixture covers every group: {} samples", b.len());
        for (k, v) in &b {
            assert_eq!(n.get(k), Some(v), "sample {k}");
        }
        assert_eq!(b.len(), n.len(), "no sample added: {:?}", n.keys().filter(|k| !b.contains_key(*k)).collect::<Vec<_>>());
    }
}
