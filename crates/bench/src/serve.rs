//! `osprey bench serve`: a load generator for any OpenAI-compatible chat endpoint (osprey, llama.cpp's
//! server, vLLM, SGLang). Every request streams (`stream: true` with usage), so time to first token and
//! the gaps between content chunks are measured as a client sees them; the final usage chunk gives the
//! prompt, cached and output tokens. Media are PNG images drawn from the seed, so two runs send the same
//! bytes. Against osprey, `/metrics` is read before and after the run and the differences are reported.
//!
//! A bad URL, a refused connection or a server answering only errors ends the run with an error naming
//! the cause (a non-zero exit); every request has a timeout, so nothing hangs.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, IsTerminal, Write};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::rng::Rng;
use serde_json::{json, Value};

mod long_images;
pub use long_images::TurnStats;

/// What the run sends.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Scenario {
    /// Text requests one at a time (or `concurrency` at once, or at `rate`).
    Text,
    /// A multi-turn conversation about an image whose history grows (the prefix-cache case); turns run
    /// in order.
    Conversation,
    /// A long text preamble, then an image (the chunked-prefill case).
    PreambleImage,
    /// A short video (frames as images).
    Video,
    /// A conversation of images that grows to `context_tokens` (`long_images.rs`): turns in order, each
    /// adding one or two images or a 4-frame video, with the server's gauges after every turn.
    LongImages,
}

impl std::str::FromStr for Scenario {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "text" => Ok(Scenario::Text),
            "conversation" => Ok(Scenario::Conversation),
            "preamble-image" => Ok(Scenario::PreambleImage),
            "video" => Ok(Scenario::Video),
            "long-images" => Ok(Scenario::LongImages),
            other => {
                Err(format!("unknown scenario {other:?} (text, conversation, preamble-image, video, long-images)"))
            }
        }
    }
}

/// The run's parameters.
#[derive(Clone, Debug, Serialize)]
pub struct ServeOptions {
    /// Base URL of the server (`http://host:port`).
    pub url: String,
    /// `model` field of each request (servers that host one model ignore it).
    pub model: Option<String>,
    /// What to send.
    pub scenario: Scenario,
    /// Requests (conversation: turns).
    pub requests: usize,
    /// Requests in flight at once (ignored with `rate`).
    pub concurrency: usize,
    /// Poisson arrivals at this many requests per second (seeded), instead of a fixed concurrency.
    pub rate: Option<f64>,
    /// Seed of the media, the prompts and the arrival times.
    pub seed: u64,
    /// `max_tokens` of each request.
    pub max_tokens: usize,
    /// Bearer token, if the server wants one.
    #[serde(skip)]
    pub api_key: Option<String>,
    /// Per-request timeout in seconds.
    pub timeout_secs: f64,
    /// `response_format` sent with every request (structured output), if any.
    pub response_format: Option<Value>,
    /// Long images: end at the first turn whose prompt holds at least this many tokens.
    pub context_tokens: Option<usize>,
    /// Long images: each image as a sentence of as many words as its tokens (a text-only peer).
    pub text_only: bool,
    /// Long images: after each turn, the turn's message alone with fresh media of the same sizes (a
    /// cold request of the same content, at the same moment: its TTFT is the turn's
    /// [`TurnStats::cold_ttft_s`]). A shared machine's speed moves between minutes; a pair does not.
    pub cold_reference: bool,
}

/// One request as the client saw it.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Sample {
    /// Request number (conversation: turn).
    pub index: usize,
    /// Seconds from the start of the run to the request being sent.
    pub sent_at_s: f64,
    /// Time to the first content (or reasoning) chunk.
    pub ttft_s: Option<f64>,
    /// Gaps between later content chunks.
    pub itl_s: Vec<f64>,
    /// Time to the end of the response.
    pub total_s: f64,
    /// `usage.prompt_tokens`.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens`.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens`.
    pub output_tokens: Option<u64>,
    /// Output tokens per second after the first token.
    pub output_tok_s: Option<f64>,
    /// The error code (OpenAI `error.code`, an HTTP status, or `transport`), if the request failed.
    pub error: Option<String>,
    /// Long images: the turn's media and the server's gauges after it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub turn: Option<TurnStats>,
}

/// Percentiles of one quantity.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Percentiles {
    /// Median.
    pub p50: f64,
    /// 90th percentile.
    pub p90: f64,
    /// 99th percentile.
    pub p99: f64,
}

/// The run's summary.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Summary {
    /// Requests sent.
    pub requests: usize,
    /// Requests that failed, by code.
    pub errors: BTreeMap<String, usize>,
    /// Wall time of the run.
    pub duration_s: f64,
    /// Time to first token.
    pub ttft_s: Percentiles,
    /// Gaps between content chunks.
    pub itl_s: Percentiles,
    /// Output tokens per second per request (requests whose tokens arrived in one burst have none).
    pub output_tok_s: Percentiles,
    /// Requests of more than one token whose tokens arrived together (no rate; see `decode_rate`).
    pub burst_requests: usize,
    /// All output tokens over the run's wall time.
    pub throughput_tok_s: f64,
    /// Prompt tokens the server reported as cached, over all prompt tokens.
    pub cached_fraction: f64,
}

/// The whole report (the JSON file).
#[derive(Clone, Debug, Serialize)]
pub struct ServeReport {
    /// The options.
    pub options: ServeOptions,
    /// The server's `/v1/models` id, if it answered.
    pub server_model: Option<String>,
    /// Whether the target is osprey (it answered `/metrics` with osprey's counters).
    pub osprey: bool,
    /// Every request.
    pub samples: Vec<Sample>,
    /// Percentiles and totals.
    pub summary: Summary,
    /// Against osprey: how its counters moved over the run (expert hits, misses and bytes read, prefix
    /// cache hits, PLE rows).
    pub metrics_delta: BTreeMap<String, f64>,
}

/// A PNG of `w`×`h` pixels drawn from `seed`: a gradient with a rectangle of one colour.
pub fn synth_png(w: u32, h: u32, seed: u64) -> Vec<u8> {
    let mut rng = Rng(seed);
    let (cx, cy) = ((rng.next() % u64::from(w)) as u32, (rng.next() % u64::from(h)) as u32);
    let colour = [rng.next() as u8, rng.next() as u8, rng.next() as u8];
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        if x.abs_diff(cx) < w / 5 && y.abs_diff(cy) < h / 5 {
            image::Rgb(colour)
        } else {
            image::Rgb([(x * 255 / w.max(1)) as u8, (y * 255 / h.max(1)) as u8, ((x + y) % 256) as u8])
        }
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).expect("encoding a PNG in memory cannot fail");
    out.into_inner()
}

fn image_part(w: u32, h: u32, seed: u64) -> Value {
    use base64::Engine;
    let b64 = base64::engine::general_purpose::STANDARD.encode(synth_png(w, h, seed));
    json!({"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{b64}")}})
}

const WORDS: [&str; 16] = [
    "river", "mountain", "engine", "circuit", "garden", "harbour", "lantern", "compass", "meadow", "signal", "copper",
    "orbit", "window", "thread", "canvas", "marble",
];

fn sentence(rng: &mut Rng, words: usize) -> String {
    (0..words).map(|_| WORDS[(rng.next() % WORDS.len() as u64) as usize]).collect::<Vec<_>>().join(" ")
}

/// The messages of request `i` (for a conversation: the history up to turn `i`, with `answers` so far).
fn messages(o: &ServeOptions, i: usize, answers: &[String]) -> Value {
    let mut rng = Rng(o.seed.wrapping_add(i as u64 * 7919));
    match o.scenario {
        Scenario::Text => json!([{"role": "user", "content": format!("Tell me about {}.", sentence(&mut rng, 6))}]),
        Scenario::PreambleImage => {
            let preamble = sentence(&mut rng, 400);
            json!([{"role": "user", "content": [
                {"type": "text", "text": format!("Context: {preamble}")},
                image_part(256, 192, o.seed.wrapping_add(i as u64)),
                {"type": "text", "text": "What is in the picture?"},
            ]}])
        }
        Scenario::Video => {
            let frames: Vec<String> = (0..4u64)
                .map(|f| {
                    use base64::Engine;
                    let png = synth_png(160, 128, o.seed.wrapping_add(i as u64 * 16 + f));
                    format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(png))
                })
                .collect();
            json!([{"role": "user", "content": [
                {"type": "video", "video": frames, "fps": 2.0},
                {"type": "text", "text": "What happens in the video?"},
            ]}])
        }
        Scenario::LongImages => long_images::history(o, i, answers),
        Scenario::Conversation => {
            let mut m = vec![json!({"role": "user", "content": [
                image_part(256, 256, o.seed),
                {"type": "text", "text": "Describe the picture."},
            ]})];
            for (t, a) in answers.iter().enumerate().take(i) {
                let mut r = Rng(o.seed.wrapping_add(t as u64 * 104_729));
                m.push(json!({"role": "assistant", "content": a}));
                m.push(json!({"role": "user", "content": format!("And the {}?", sentence(&mut r, 3))}));
            }
            Value::Array(m)
        }
    }
}

fn agent(o: &ServeOptions) -> ureq::Agent {
    let t = Duration::from_secs_f64(o.timeout_secs.max(0.1));
    ureq::AgentBuilder::new().timeout_connect(Duration::from_secs(5)).timeout(t).build()
}

/// Why a GET gave no body: the server answered with an error status, or did not answer.
enum Fetch {
    Status,
    Failed(String),
}

fn get_json(a: &ureq::Agent, url: &str, key: Option<&str>) -> std::result::Result<String, Fetch> {
    let mut req = a.get(url);
    if let Some(k) = key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    match req.call() {
        Ok(r) => r.into_string().map_err(|e| Fetch::Failed(e.to_string())),
        Err(ureq::Error::Status(..)) => Err(Fetch::Status),
        Err(e) => Err(Fetch::Failed(e.to_string())),
    }
}

/// Sends one streaming request and times it.
fn one(a: &ureq::Agent, o: &ServeOptions, index: usize, msgs: Value, t0: Instant) -> (Sample, String) {
    let mut s = Sample { index, sent_at_s: t0.elapsed().as_secs_f64(), ..Sample::default() };
    let mut body = json!({"messages": msgs, "max_tokens": o.max_tokens, "temperature": 0, "stream": true,
                          "stream_options": {"include_usage": true}});
    if let Some(m) = &o.model {
        body["model"] = json!(m);
    }
    if let Some(rf) = &o.response_format {
        body["response_format"] = rf.clone();
    }
    let body = body.to_string();
    if o.scenario == Scenario::LongImages {
        s.turn = Some(TurnStats { request_bytes: body.len(), ..TurnStats::default() });
    }
    let start = Instant::now();
    let mut req = a.post(&format!("{}/v1/chat/completions", o.url)).set("Content-Type", "application/json");
    if let Some(k) = &o.api_key {
        req = req.set("Authorization", &format!("Bearer {k}"));
    }
    let resp = match req.send_string(&body) {
        Ok(r) => r,
        Err(ureq::Error::Status(code, r)) => {
            let v: Value = r.into_string().ok().and_then(|t| serde_json::from_str(&t).ok()).unwrap_or(Value::Null);
            s.error = Some(v["error"]["code"].as_str().map_or_else(|| format!("http_{code}"), str::to_string));
            s.total_s = start.elapsed().as_secs_f64();
            return (s, String::new());
        }
        Err(e) => {
            s.error = Some(format!("transport: {e}"));
            s.total_s = start.elapsed().as_secs_f64();
            return (s, String::new());
        }
    };
    let mut text = String::new();
    let mut last = None;
    for line in BufReader::new(resp.into_reader()).lines() {
        let Ok(line) = line else {
            s.error = Some("transport: the stream broke".into());
            break;
        };
        let Some(data) = line.strip_prefix("data: ") else { continue };
        if data == "[DONE]" {
            break;
        }
        let Ok(v) = serde_json::from_str::<Value>(data) else { continue };
        if let Some(e) = v.get("error") {
            s.error = Some(e["code"].as_str().unwrap_or("stream_error").to_string());
            break;
        }
        // A token's chunk carries `content` (or `reasoning_content`), possibly empty (a token that ends
        // inside a UTF-8 sequence, or that renders as nothing). The first chunk servers send at once,
        // before any token, carries the `role` with no text (osprey and vLLM send `"content": ""` with it,
        // llama.cpp `null`): it is not a token. A role chunk with text in it is one.
        let delta = &v["choices"][0]["delta"];
        let piece = delta["content"].as_str().or_else(|| delta["reasoning_content"].as_str());
        let role_only = delta.get("role").is_some() && piece.is_none_or(str::is_empty);
        if let Some(piece) = piece.filter(|_| !role_only) {
            let now = start.elapsed().as_secs_f64();
            match last {
                None => s.ttft_s = Some(now),
                Some(prev) => s.itl_s.push(now - prev),
            }
            last = Some(now);
            text.push_str(piece);
        }
        if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
            s.prompt_tokens = u["prompt_tokens"].as_u64();
            s.output_tokens = u["completion_tokens"].as_u64();
            s.cached_tokens = u["prompt_tokens_details"]["cached_tokens"].as_u64();
        }
    }
    s.total_s = start.elapsed().as_secs_f64();
    if let (Some(ttft), Some(last), Some(n)) = (s.ttft_s, last, s.output_tokens) {
        s.output_tok_s = decode_rate(ttft, last, n);
    }
    (s, text)
}

/// Gaps shorter than this per token mean the tokens arrived together (faster than 10,000 tok/s for one
/// request): the client saw a burst, not a rate.
const MIN_TOKEN_GAP_S: f64 = 1e-4;

/// A request's output tokens per second after its first: the `n - 1` later tokens over the time from the
/// first token to the last (not to the end of the response, which the usage chunk and the connection's
/// close stretch). `None` for one token, or for tokens that arrived together: dividing by that near-zero
/// interval made the percentiles' tail huge (issue 54).
fn decode_rate(first_s: f64, last_s: f64, n: u64) -> Option<f64> {
    let span = last_s - first_s;
    (n > 1 && span >= (n - 1) as f64 * MIN_TOKEN_GAP_S).then(|| (n - 1) as f64 / span)
}

fn percentiles(mut v: Vec<f64>) -> Percentiles {
    if v.is_empty() {
        return Percentiles::default();
    }
    v.sort_by(f64::total_cmp);
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    Percentiles { p50: at(0.5), p90: at(0.9), p99: at(0.99) }
}

/// osprey's counters the report follows (summed over labels).
fn osprey_counters(text: &str) -> BTreeMap<String, f64> {
    let wanted = [
        "osprey_expert_hits_total",
        "osprey_expert_misses_total",
        "osprey_expert_bytes_read_total",
        "osprey_expert_stall_seconds_total",
        "osprey_prefix_cache_hits_total",
        "osprey_prefix_cache_lookups_total",
        "osprey_prefix_cache_cached_tokens_total",
        "osprey_prompt_tokens_total",
        "osprey_generated_tokens_total",
        "osprey_ple_hits_total",
        "osprey_ple_misses_total",
        "osprey_ple_bytes_read_total",
        "osprey_spec_drafted_total",
        "osprey_spec_accepted_total",
        "osprey_spec_verifications_total",
        "osprey_spec_emitted_tokens_total",
        "osprey_grammar_masks_total",
        "osprey_grammar_mask_seconds_total",
    ];
    long_images::gauges(text).into_iter().filter(|(k, _)| wanted.contains(&k.as_str())).map(|(k, v)| (k, v.0)).collect()
}

/// Sends the scenario's requests (a conversation turn by turn; otherwise all at once for a fixed
/// concurrency, or as Poisson arrivals at `rate`) and returns their samples in request order.
fn send_load(a: &ureq::Agent, o: &ServeOptions, t0: Instant) -> Vec<Sample> {
    let n = o.requests.max(1);
    let samples = Mutex::new(Vec::with_capacity(n));
    let progress = Progress::new(n);
    if o.scenario == Scenario::LongImages {
        long_images_run(a, o, t0, &samples, &progress);
    } else if o.scenario == Scenario::Conversation {
        let mut answers = Vec::new();
        for i in 0..n {
            let (s, text) = one(a, o, i, messages(o, i, &answers), t0);
            answers.push(text);
            samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
            progress.tick();
        }
    } else {
        // Arrival times: all at once for a fixed concurrency, or Poisson at `rate`.
        let mut rng = Rng(o.seed ^ 0xA5A5);
        let mut at = 0.0;
        let arrivals: Vec<f64> = (0..n)
            .map(|_| match o.rate {
                Some(r) if r > 0.0 => {
                    at += -(1.0 - rng.unit()).ln() / r;
                    at
                }
                _ => 0.0,
            })
            .collect();
        let workers = if o.rate.is_some() { n } else { o.concurrency.clamp(1, n) };
        let next = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..workers {
                sc.spawn(|| loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    let wait = arrivals[i] - t0.elapsed().as_secs_f64();
                    if wait > 0.0 {
                        std::thread::sleep(Duration::from_secs_f64(wait));
                    }
                    let (s, _) = one(a, o, i, messages(o, i, &[]), t0);
                    samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
                    progress.tick();
                });
            }
        });
    }
    progress.done();
    let mut samples = samples.into_inner().unwrap_or_else(|e| e.into_inner());
    samples.sort_by_key(|s| s.index);
    samples
}

/// The long-images conversation turn by turn until its context (or `requests` turns, or a failed turn),
/// `/metrics` read around each turn for its [`TurnStats`].
fn long_images_run(a: &ureq::Agent, o: &ServeOptions, t0: Instant, samples: &Mutex<Vec<Sample>>, p: &Progress) {
    let scrape =
        || get_json(a, &format!("{}/metrics", o.url), o.api_key.as_deref()).ok().map(|t| long_images::gauges(&t));
    let mut answers = Vec::new();
    let mut before = scrape();
    for i in 0..o.requests.max(1) {
        let (mut s, text) = one(a, o, i, messages(o, i, &answers), t0);
        answers.push(text);
        let after = scrape();
        let mut turn = match (&before, &after) {
            (Some(b), Some(a)) => long_images::turn_stats(b, a),
            _ => TurnStats::default(),
        };
        turn.request_bytes = s.turn.as_ref().map_or(0, |t| t.request_bytes);
        turn.media_items = long_images::media_items(o, i);
        turn.new_tokens = s.prompt_tokens.map(|p| p - s.cached_tokens.unwrap_or(0).min(p));
        before = after;
        if o.cold_reference && s.error.is_none() {
            // One token: its time to the end is its time to the first token even when that token
            // streams no text (a reasoning tag, the end).
            let one_token = ServeOptions { max_tokens: 1, ..o.clone() };
            let (c, _) = one(a, &one_token, i, json!([long_images::cold_turn(o, i)]), t0);
            turn.cold_ttft_s = c.error.is_none().then(|| c.ttft_s.unwrap_or(c.total_s));
            turn.cold_cached_tokens = c.cached_tokens;
            // The next turn's deltas leave the reference out.
            before = scrape();
        }
        s.turn = Some(turn);
        let done = s.error.is_some() || o.context_tokens.is_some_and(|c| s.prompt_tokens.unwrap_or(0) >= c as u64);
        samples.lock().unwrap_or_else(|e| e.into_inner()).push(s);
        p.tick();
        if done {
            break;
        }
    }
}

/// Runs the load and returns the report; `Err` names why the run could not produce one.
pub fn run(o: &ServeOptions) -> crate::Result<ServeReport> {
    let server = |reason: String| crate::Error::Server { url: o.url.clone(), reason };
    if !(o.url.starts_with("http://") || o.url.starts_with("https://")) {
        return Err(server("expected http://host:port".into()));
    }
    let a = agent(o);
    let key = o.api_key.as_deref();
    let server_model = match get_json(&a, &format!("{}/v1/models", o.url), key) {
        Ok(t) => serde_json::from_str::<Value>(&t).ok().and_then(|v| v["data"][0]["id"].as_str().map(str::to_string)),
        Err(Fetch::Status) => None,
        Err(Fetch::Failed(e)) => return Err(server(e)),
    };
    let metrics_before = get_json(&a, &format!("{}/metrics", o.url), key).ok().map(|t| osprey_counters(&t));
    let osprey = metrics_before.as_ref().is_some_and(|m| !m.is_empty());
    let t0 = Instant::now();
    let samples = send_load(&a, o, t0);
    let duration_s = t0.elapsed().as_secs_f64();
    let mut errors = BTreeMap::new();
    for s in &samples {
        if let Some(e) = &s.error {
            let code = e.split(':').next().unwrap_or(e).to_string();
            *errors.entry(code).or_insert(0) += 1;
        }
    }
    if errors.values().sum::<usize>() == samples.len() {
        let first = samples.iter().find_map(|s| s.error.clone()).unwrap_or_default();
        return Err(server(format!(
            "every request failed ({} of {}); the first: {first}",
            samples.len(),
            samples.len()
        )));
    }
    let ok: Vec<&Sample> = samples.iter().filter(|s| s.error.is_none()).collect();
    let out_tokens: u64 = ok.iter().filter_map(|s| s.output_tokens).sum();
    let (prompt, cached) =
        ok.iter().fold((0u64, 0u64), |(p, c), s| (p + s.prompt_tokens.unwrap_or(0), c + s.cached_tokens.unwrap_or(0)));
    let summary = Summary {
        requests: samples.len(),
        errors,
        duration_s,
        ttft_s: percentiles(ok.iter().filter_map(|s| s.ttft_s).collect()),
        itl_s: percentiles(ok.iter().flat_map(|s| s.itl_s.iter().copied()).collect()),
        output_tok_s: percentiles(ok.iter().filter_map(|s| s.output_tok_s).collect()),
        burst_requests: ok
            .iter()
            .filter(|s| s.output_tok_s.is_none() && s.ttft_s.is_some() && s.output_tokens.is_some_and(|n| n > 1))
            .count(),
        throughput_tok_s: out_tokens as f64 / duration_s.max(1e-9),
        cached_fraction: if prompt > 0 { cached as f64 / prompt as f64 } else { 0.0 },
    };
    let metrics_delta = match (metrics_before, get_json(&a, &format!("{}/metrics", o.url), key).ok()) {
        (Some(before), Some(after)) if osprey => {
            let after = osprey_counters(&after);
            after.iter().map(|(k, v)| (k.clone(), v - before.get(k).copied().unwrap_or(0.0))).collect()
        }
        _ => BTreeMap::new(),
    };
    Ok(ServeReport { options: o.clone(), server_model, osprey, samples, summary, metrics_delta })
}

/// The terminal table of a report.
pub fn table(r: &ServeReport) -> String {
    let s = &r.summary;
    let ms = |v: f64| format!("{:.1}", v * 1e3);
    let mut out = format!(
        "{} · {:?} · {} requests in {:.2} s · {} errors\n",
        r.options.url,
        r.options.scenario,
        s.requests,
        s.duration_s,
        s.errors.values().sum::<usize>()
    );
    out.push_str("| quantity | p50 | p90 | p99 |\n| --- | --- | --- | --- |\n");
    for (name, p, f) in [
        ("TTFT ms", &s.ttft_s, true),
        ("inter-token ms", &s.itl_s, true),
        ("output tok/s per request", &s.output_tok_s, false),
    ] {
        let v = |x: f64| if f { ms(x) } else { format!("{x:.1}") };
        out.push_str(&format!("| {name} | {} | {} | {} |\n", v(p.p50), v(p.p90), v(p.p99)));
    }
    out.push_str(&format!(
        "throughput {:.1} tok/s · cached prompt tokens {:.0}%\n",
        s.throughput_tok_s,
        100.0 * s.cached_fraction
    ));
    if s.burst_requests > 0 {
        out.push_str(&format!(
            "{} requests' tokens arrived in one burst (no per-request rate; left out of its percentiles)\n",
            s.burst_requests
        ));
    }
    if r.samples.iter().any(|s| s.turn.is_some()) {
        out.push_str(&long_images::turn_table(&r.samples));
    }
    for (k, v) in &r.metrics_delta {
        out.push_str(&format!("{k} +{v}\n"));
    }
    let d = |k: &str| r.metrics_delta.get(k).copied().unwrap_or(0.0);
    if d("osprey_grammar_masks_total") > 0.0 {
        let per = d("osprey_grammar_mask_seconds_total") / d("osprey_grammar_masks_total");
        out.push_str(&format!(
            "grammar mask {:.1} µs per token ({:.1}% of the p50 inter-token time)\n",
            per * 1e6,
            100.0 * per / s.itl_s.p50.max(1e-12)
        ));
    }
    out
}

/// A progress bar on stderr, only when stderr is a terminal (logs stay clean).
struct Progress {
    total: usize,
    done: AtomicUsize,
    on: bool,
}

impl Progress {
    fn new(total: usize) -> Self {
        Progress { total, done: AtomicUsize::new(0), on: std::io::stderr().is_terminal() }
    }
    fn tick(&self) {
        let d = self.done.fetch_add(1, Ordering::Relaxed) + 1;
        if self.on {
            let w = 30 * d / self.total.max(1);
            eprint!("\rrequests [{}{}] {d}/{}", "=".repeat(w), " ".repeat(30 - w), self.total);
            let _ = std::io::stderr().flush();
        }
    }
    fn done(&self) {
        if self.on {
            eprintln!();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A request's rate runs from its first token to its last; tokens that arrived together give none
    /// (they gave ~10^7 tok/s, the report's p90 and p99).
    #[test]
    fn a_burst_of_tokens_has_no_rate() {
        assert_eq!(decode_rate(1.0, 2.0, 51), Some(50.0));
        assert_eq!(decode_rate(1.0, 1.0 + 1e-7, 50), None);
        assert_eq!(decode_rate(1.0, 1.0, 1), None);
        assert!(decode_rate(0.5, 0.5 + 49.0 * MIN_TOKEN_GAP_S, 50).is_some());
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let p = percentiles((1..=100).map(f64::from).collect());
        assert_eq!((p.p50, p.p90, p.p99), (50.0, 90.0, 99.0));
        assert_eq!(percentiles(vec![3.0]).p99, 3.0);
    }

    /// Options of a run of `scenario` against nothing (the message builders' tests).
    pub(super) fn options(scenario: Scenario) -> ServeOptions {
        ServeOptions {
            url: "http://x".into(),
            model: None,
            scenario,
            requests: 1,
            concurrency: 1,
            rate: None,
            seed: 3,
            max_tokens: 4,
            api_key: None,
            timeout_secs: 1.0,
            response_format: None,
            context_tokens: None,
            text_only: false,
            cold_reference: false,
        }
    }

    #[test]
    fn media_and_prompts_are_deterministic_per_seed() {
        assert_eq!(synth_png(64, 48, 7), synth_png(64, 48, 7));
        assert_ne!(synth_png(64, 48, 7), synth_png(64, 48, 8));
        let o = options(Scenario::PreambleImage);
        assert_eq!(messages(&o, 0, &[]), messages(&o, 0, &[]));
    }

    #[test]
    fn osprey_counters_sum_over_labels() {
        let m = osprey_counters(
            "# HELP x\nosprey_expert_hits_total{layer=\"0\"} 3\nosprey_expert_hits_total{layer=\"1\"} 4\nother 1\n",
        );
        assert_eq!(m.get("osprey_expert_hits_total"), Some(&7.0));
        assert_eq!(m.len(), 1);
    }
}
