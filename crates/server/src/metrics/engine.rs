//! The engine's metrics: one table, [`ENGINE`], declares each (name, help, type, and where its value lives
//! in the actors' snapshot); a prometheus-client collector turns it into samples on each scrape.

use osprey_protocol::experts::{LayerStats, ResidencyStats};
use osprey_protocol::prefix::PrefixStats;
use osprey_protocol::scheduler::SchedulerStats;
use osprey_protocol::vision::VisionStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric, MetricEncoder};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;

/// What the engine's actors reported for one scrape.
#[derive(Debug, Default)]
pub struct Engine {
    /// The scheduler's (and through it the runner's) counters.
    pub scheduler: SchedulerStats,
    /// The vision encoder's cache.
    pub vision: VisionStats,
    /// The prefix cache.
    pub prefix: PrefixStats,
    /// Expert residency, when experts stream from disk.
    pub experts: Option<ResidencyStats>,
    /// Stored responses for `previous_response_id`: (count, bytes).
    pub responses: (u64, u64),
}

/// One scrape's engine metrics: the snapshot, and the generation rate since the previous scrape.
#[derive(Debug)]
pub(super) struct Scrape {
    engine: Engine,
    rate: f64,
}

impl Scrape {
    pub(super) fn new(engine: Engine, rate: f64) -> Self {
        Scrape { engine, rate }
    }
}

/// A sample's value: an integer (written as one) or a float.
#[derive(Clone, Copy, Debug)]
enum N {
    U(u64),
    F(f64),
}

/// One engine metric's samples in a scrape.
enum Samples {
    /// Its group is absent (the CPU backend has no device; no speculation; no disk tier).
    Absent,
    One(N),
    /// One sample per value of a label, numbered from 0.
    By(&'static str, Vec<N>),
    /// One sample per named value of a label.
    Named(&'static str, Vec<(String, N)>),
}

/// Counter (its name without `_total`, which the encoder adds) or gauge.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Counter,
    Gauge,
}

/// One engine metric: name, help, type, and its samples in a scrape.
struct Decl {
    name: &'static str,
    help: &'static str,
    kind: Kind,
    value: fn(&Scrape) -> Samples,
}

const fn counter(name: &'static str, help: &'static str, value: fn(&Scrape) -> Samples) -> Decl {
    Decl { name, help, kind: Kind::Counter, value }
}

const fn gauge(name: &'static str, help: &'static str, value: fn(&Scrape) -> Samples) -> Decl {
    Decl { name, help, kind: Kind::Gauge, value }
}

fn u(v: impl TryInto<u64>) -> Samples {
    Samples::One(N::U(v.try_into().unwrap_or(u64::MAX)))
}

fn f(v: f64) -> Samples {
    Samples::One(N::F(v))
}

/// This process's resident memory, from `/proc/self/status` (Linux; none elsewhere).
fn resident_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let kb: u64 = s.lines().find(|l| l.starts_with("VmRSS:"))?.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

fn per_layer(s: &Scrape, v: fn(&LayerStats) -> N) -> Samples {
    match &s.engine.experts {
        Some(e) => Samples::By("layer", e.layers.iter().map(v).collect()),
        None => Samples::Absent,
    }
}

fn experts(s: &Scrape, v: fn(&ResidencyStats) -> N) -> Samples {
    s.engine.experts.as_ref().map_or(Samples::Absent, |e| Samples::One(v(e)))
}

fn device(s: &Scrape, v: fn(&osprey_protocol::runner::DeviceCounters) -> u64) -> Samples {
    s.engine.scheduler.device.as_ref().map_or(Samples::Absent, |d| u(v(d)))
}

fn spec(s: &Scrape, v: fn(&osprey_protocol::runner::SpecCounters) -> N) -> Samples {
    s.engine.scheduler.spec.as_ref().map_or(Samples::Absent, |c| Samples::One(v(c)))
}

/// Every engine metric, in the order of the exposition; the model family's own metrics follow.
const ENGINE: &[Decl] = &[
    gauge("osprey_queue_length", "Requests waiting for admission.", |s| u(s.engine.scheduler.waiting)),
    gauge("osprey_running_sequences", "Sequences being computed.", |s| u(s.engine.scheduler.running)),
    gauge("osprey_kv_tokens", "Tokens held in KV by running sequences.", |s| u(s.engine.scheduler.kv_tokens)),
    gauge("osprey_kv_capacity_tokens", "KV capacity in tokens.", |s| u(s.engine.scheduler.kv_capacity)),
    gauge("osprey_kv_pages_total", "Pages in the KV pool.", |s| u(s.engine.scheduler.kv_pages_total)),
    gauge("osprey_kv_pages_used", "KV pages held by sequences or the prefix cache.", |s| {
        u(s.engine.scheduler.kv_pages_total.saturating_sub(s.engine.scheduler.kv_pages_free))
    }),
    gauge("osprey_kv_pages_free", "KV pages nobody holds.", |s| u(s.engine.scheduler.kv_pages_free)),
    counter("osprey_expert_slot_hits", "Routed experts a step found in a compute-backend slot (no transfer).", |s| {
        u(s.engine.scheduler.expert_slots.hits)
    }),
    counter("osprey_expert_slot_misses", "Routed experts uploaded into a compute-backend slot.", |s| {
        u(s.engine.scheduler.expert_slots.misses)
    }),
    counter("osprey_expert_slot_waves", "Expert waves run (one routed-experts op each).", |s| {
        u(s.engine.scheduler.expert_slots.waves)
    }),
    gauge("osprey_expert_slots", "Compute-backend expert slots over every MoE layer.", |s| {
        u(s.engine.scheduler.expert_slots.slots)
    }),
    gauge("osprey_expert_slots_filled", "Expert slots holding an expert.", |s| {
        u(s.engine.scheduler.expert_slots.filled)
    }),
    counter("osprey_expert_slot_prefetch_issued", "Guessed experts uploaded into a slot before their layer.", |s| {
        u(s.engine.scheduler.expert_slots.guesses)
    }),
    counter("osprey_expert_slot_prefetch_used", "Guessed experts uploaded ahead that their layer used.", |s| {
        u(s.engine.scheduler.expert_slots.guesses_used)
    }),
    counter(
        "osprey_expert_slot_prefetch_wasted",
        "Guessed experts uploaded ahead that their layer passed over.",
        |s| u(s.engine.scheduler.expert_slots.guesses_wasted),
    ),
    gauge("osprey_device_memory_bytes", "Bytes of compute-device memory.", |s| device(s, |d| d.memory_total)),
    gauge("osprey_device_memory_free_bytes", "Bytes of compute-device memory not allocated.", |s| {
        device(s, |d| d.memory_free)
    }),
    counter("osprey_device_upload_bytes", "Bytes copied host to device.", |s| device(s, |d| d.bytes_to_device)),
    counter("osprey_device_download_bytes", "Bytes copied device to host.", |s| device(s, |d| d.bytes_from_device)),
    counter("osprey_device_launches", "Kernel launches on the compute device.", |s| device(s, |d| d.launches)),
    counter("osprey_device_kernel_launches", "Kernel launches on the compute device, per kernel.", |s| {
        s.engine.scheduler.device.as_ref().map_or(Samples::Absent, |d| {
            Samples::Named("kernel", d.kernels.iter().map(|(k, n)| (k.clone(), N::U(*n))).collect())
        })
    }),
    counter("osprey_device_host_waits", "Calls that blocked the host until the device caught up.", |s| {
        device(s, |d| d.host_waits)
    }),
    counter("osprey_device_allocations", "Device memory allocations.", |s| device(s, |d| d.allocations)),
    counter("osprey_device_frees", "Device memory frees.", |s| device(s, |d| d.frees)),
    counter("osprey_grammar_masks", "Token masks computed for constrained decoding.", |s| {
        u(s.engine.scheduler.grammar.masks)
    }),
    counter("osprey_grammar_mask_seconds", "Seconds spent computing token masks.", |s| {
        f(s.engine.scheduler.grammar.nanos as f64 * 1e-9)
    }),
    counter("osprey_spec_drafted", "Tokens drafted by the MTP head.", |s| spec(s, |c| N::U(c.drafted))),
    counter("osprey_spec_accepted", "Drafted tokens the main model accepted.", |s| spec(s, |c| N::U(c.accepted))),
    counter(
        "osprey_spec_verifications",
        "Speculative steps of a sequence (its drafts verified in one main forward).",
        |s| spec(s, |c| N::U(c.forwards)),
    ),
    counter("osprey_spec_emitted_tokens", "Tokens the speculative steps emitted.", |s| spec(s, |c| N::U(c.emitted))),
    gauge(
        "osprey_spec_tokens_per_forward",
        "Tokens per speculative step of a sequence (per pass over the main weights).",
        |s| spec(s, |c| N::F(c.tokens_per_forward())),
    ),
    gauge("osprey_spec_acceptance_rate", "Accepted over drafted tokens, per draft position.", |s| {
        s.engine.scheduler.spec.as_ref().map_or(Samples::Absent, |c| {
            let rates = c.drafted_at.iter().zip(&c.accepted_at).map(|(&d, &a)| N::F(ratio(a, d)));
            Samples::By("position", rates.collect())
        })
    }),
    gauge(
        "osprey_kv_pages_shared",
        "KV pages of running sequences shared with the prefix cache or another sequence.",
        |s| u(s.engine.scheduler.kv_pages_shared),
    ),
    counter("osprey_overloaded", "Requests refused with 503 overloaded (queue full, or waited too long).", |s| {
        u(s.engine.scheduler.overloaded_total)
    }),
    counter("osprey_preemptions", "Sequences preempted (and later recomputed) because KV pages ran out.", |s| {
        u(s.engine.scheduler.preemptions_total)
    }),
    counter("osprey_prompt_tokens", "Prompt tokens computed.", |s| u(s.engine.scheduler.prompt_tokens_total)),
    counter("osprey_generated_tokens", "Tokens generated.", |s| u(s.engine.scheduler.generated_tokens_total)),
    counter("osprey_cancelled", "Sequences cancelled because the client left or a stop string matched.", |s| {
        u(s.engine.scheduler.cancelled_total)
    }),
    counter("osprey_steps", "Engine steps executed.", |s| u(s.engine.scheduler.steps_total)),
    gauge("osprey_generation_tokens_per_second", "Tokens generated per second since the previous scrape.", |s| {
        f(s.rate)
    }),
    gauge("osprey_prefix_cache_hit_rate", "Fraction of prompt tokens served from the prefix cache.", |s| {
        let c = &s.engine.scheduler;
        f(ratio(c.cached_tokens_total, c.prompt_tokens_total + c.cached_tokens_total))
    }),
    counter("osprey_prefix_cache_cached_tokens", "Prompt tokens served from the prefix cache.", |s| {
        u(s.engine.scheduler.cached_tokens_total)
    }),
    counter("osprey_prefix_cache_lookups", "Prefix-cache lookups.", |s| u(s.engine.prefix.lookups)),
    counter("osprey_prefix_cache_hits", "Prefix-cache lookups that reused at least one page.", |s| {
        u(s.engine.prefix.hits)
    }),
    counter("osprey_prefix_cache_evictions", "Prefix-cache nodes evicted.", |s| u(s.engine.prefix.evictions)),
    gauge("osprey_prefix_cache_bytes", "Bytes held by the prefix cache (KV pages + snapshots).", |s| {
        u(s.engine.prefix.bytes)
    }),
    gauge(
        "osprey_prefix_cache_device_bytes",
        "Of the prefix cache's bytes, KV pages (the compute device's memory).",
        |s| u(s.engine.prefix.device_bytes),
    ),
    gauge(
        "osprey_prefix_cache_host_bytes",
        "Of the prefix cache's bytes, recurrent-state snapshots (host memory).",
        |s| u(s.engine.prefix.host_bytes),
    ),
    gauge("osprey_prefix_cache_nodes", "Pages in the prefix tree.", |s| u(s.engine.prefix.nodes)),
    gauge("osprey_vision_cache_hit_rate", "Fraction of media encodes served from the encoder cache.", |s| {
        let v = &s.engine.vision;
        f(ratio(v.hits, v.hits + v.misses))
    }),
    gauge("osprey_vision_cache_bytes", "Bytes held by the encoder cache.", |s| u(s.engine.vision.cached_bytes)),
    counter("osprey_vision_cache_hits", "Media encodes served from the encoder cache.", |s| u(s.engine.vision.hits)),
    counter("osprey_vision_cache_misses", "Media items the vision encoder computed.", |s| u(s.engine.vision.misses)),
    gauge("osprey_prefix_cache_snapshots", "Recurrent-state snapshots the prefix cache holds.", |s| {
        u(s.engine.prefix.snapshots)
    }),
    gauge("osprey_process_resident_bytes", "The server process's resident memory (VmRSS).", |_| {
        resident_bytes().map_or(Samples::Absent, u)
    }),
    counter("osprey_expert_hits", "Expert accesses served from RAM.", |s| per_layer(s, |l| N::U(l.hits))),
    counter("osprey_expert_misses", "Expert accesses read from disk.", |s| per_layer(s, |l| N::U(l.misses))),
    counter("osprey_expert_bytes_read", "Bytes of experts read from disk.", |s| per_layer(s, |l| N::U(l.bytes_read))),
    counter("osprey_expert_read_seconds", "Seconds spent in expert read batches.", |s| {
        per_layer(s, |l| N::F(l.read_secs))
    }),
    counter("osprey_expert_read_batches", "Expert read batches (one per layer step with misses).", |s| {
        per_layer(s, |l| N::U(l.batches))
    }),
    gauge("osprey_expert_residency", "Fraction of expert accesses served from RAM.", |s| {
        experts(s, |e| {
            let (h, m) = e.layers.iter().fold((0, 0), |(h, m), l| (h + l.hits, m + l.misses));
            N::F(if h + m == 0 { 1.0 } else { ratio(h, h + m) })
        })
    }),
    counter("osprey_expert_stall_seconds", "Seconds the runner waited for experts after the shared expert.", |s| {
        experts(s, |e| N::F(e.stall_secs))
    }),
    gauge("osprey_expert_resident_bytes", "Bytes of experts held in RAM.", |s| experts(s, |e| N::U(e.resident_bytes))),
    gauge("osprey_expert_peak_bytes", "Most bytes of experts held in RAM at once, guesses being read included.", |s| {
        experts(s, |e| N::U(e.peak_bytes))
    }),
    gauge("osprey_expert_resident", "Experts held in RAM.", |s| experts(s, |e| N::U(e.resident_experts))),
    counter("osprey_expert_evictions", "Experts evicted.", |s| experts(s, |e| N::U(e.evictions))),
    gauge("osprey_expert_arena_slots", "Slots of the host arena experts are read into.", |s| {
        experts(s, |e| N::U(e.arena_slots))
    }),
    gauge("osprey_expert_arena_used", "Host arena slots holding an expert.", |s| experts(s, |e| N::U(e.arena_used))),
    gauge(
        "osprey_expert_arena_registered",
        "1 when the host arena is registered with io_uring (reads into fixed buffers).",
        |s| experts(s, |e| N::U(u64::from(e.arena_registered))),
    ),
    counter("osprey_expert_prefetch_issued", "Guessed experts read ahead of their layer.", |s| {
        experts(s, |e| N::U(e.prefetch.issued))
    }),
    counter("osprey_expert_prefetch_used", "Guessed experts their layer then used.", |s| {
        experts(s, |e| N::U(e.prefetch.used))
    }),
    counter("osprey_expert_prefetch_wasted", "Guessed experts read that their layer did not use.", |s| {
        experts(s, |e| N::U(e.prefetch.wasted))
    }),
    counter("osprey_expert_prefetch_wasted_bytes", "Bytes read for guesses their layer did not use.", |s| {
        experts(s, |e| N::U(e.prefetch.wasted_bytes))
    }),
    counter(
        "osprey_expert_prefetch_cancelled",
        "Guesses dropped before or while being read because their layer came first (it reads what it needs).",
        |s| experts(s, |e| N::U(e.prefetch.cancelled)),
    ),
    counter(
        "osprey_expert_prefetch_gated",
        "Guesses not read: their measured precision was below the disk's break-even.",
        |s| experts(s, |e| N::U(e.prefetch.gated)),
    ),
    gauge("osprey_expert_prefetch_accuracy", "Fraction of the guessed experts read that their layer used.", |s| {
        experts(s, |e| N::F(ratio(e.prefetch.used, e.prefetch.issued)))
    }),
    gauge("osprey_responses_stored", "Responses kept for previous_response_id.", |s| u(s.engine.responses.0)),
    gauge("osprey_responses_stored_bytes", "Bytes of the stored conversations.", |s| u(s.engine.responses.1)),
];

impl Collector for Scrape {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for d in ENGINE {
            encode(&mut enc, d.name, d.help, d.kind, (d.value)(self))?;
        }
        // The model family's own metrics, by the names it gives them (a counter's ends in `_total`).
        for m in &self.engine.scheduler.family {
            let (kind, name) = match m.name.strip_suffix("_total") {
                Some(n) if m.counter => (Kind::Counter, n),
                _ => (if m.counter { Kind::Counter } else { Kind::Gauge }, m.name.as_str()),
            };
            encode(&mut enc, name, &m.help, kind, Samples::One(N::F(m.value)))?;
        }
        Ok(())
    }
}

fn encode(enc: &mut DescriptorEncoder, name: &str, help: &str, kind: Kind, s: Samples) -> Result<(), std::fmt::Error> {
    let t = if kind == Kind::Counter { MetricType::Counter } else { MetricType::Gauge };
    match s {
        Samples::Absent => Ok(()),
        Samples::One(v) => value(kind, v, enc.encode_descriptor(name, help, None, t)?),
        Samples::By(label, vs) => {
            let named = vs.into_iter().enumerate().map(|(i, v)| (i.to_string(), v)).collect();
            encode(enc, name, help, kind, Samples::Named(label, named))
        }
        Samples::Named(label, vs) => {
            let mut m = enc.encode_descriptor(name, help, None, t)?;
            for (l, v) in vs {
                value(kind, v, m.encode_family(&[(label, l.as_str())])?)?;
            }
            Ok(())
        }
    }
}

fn value(kind: Kind, v: N, m: MetricEncoder) -> Result<(), std::fmt::Error> {
    match (kind, v) {
        (Kind::Counter, N::U(v)) => ConstCounter::new(v).encode(m),
        (Kind::Counter, N::F(v)) => ConstCounter::new(v).encode(m),
        (Kind::Gauge, N::U(v)) => ConstGauge::new(v).encode(m),
        (Kind::Gauge, N::F(v)) => ConstGauge::new(v).encode(m),
    }
}
