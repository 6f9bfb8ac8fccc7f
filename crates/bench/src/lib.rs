//! # osprey-bench — measurements
//!
//! Brief overview: today the synchronous model benchmarks behind `osprey bench forward` (prefill
//! throughput of one prompt chunk and greedy decode throughput on any checkpoint, with the weight bytes
//! each decode token reads and the bandwidth that implies) and `osprey bench vision` (preprocessing and
//! vision-tower encoding time per image size), `osprey bench experts` (decode under expert and PLE RAM
//! budgets) and `osprey bench serve` ([`serve`]: a load generator for any OpenAI-compatible server).
//! Numbers go to `docs/benchmarks.md`, never into tests.

mod batch;
pub mod chart;
mod compare;
mod experts;
pub mod predict;
pub mod report;
mod rng;
pub mod roofline;
pub mod serve;
pub mod synth;
mod verify;

pub use batch::{bench_batch, BatchBench, BatchReport, BatchRow};
pub use compare::compare;
pub use verify::{bench_verify, VerifyBench, VerifyReport, VerifyRow};

use std::time::Instant;

pub use experts::{
    bench_experts, bench_experts_traced, measure_disk_read, replay, ExpertsReport, ExpertsRun, GuessAccuracy,
    PolicyHitRates, Prefetch, PrefetchReport, TraceFile,
};

use osprey_models::vision::{preprocess_image, ImageParams, RgbImage, VisionTower};
use std::sync::Arc;

use osprey_models::CausalLm;
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_protocol::RequestError;
use osprey_runner::{Driver, GenerateOptions, NoMedia};
use serde::Serialize;

/// What to run.
#[derive(Clone, Copy, Debug)]
pub struct ForwardBench {
    /// Prompt tokens, prefilled as one chunk.
    pub prompt_len: usize,
    /// Greedy decode steps after the prompt.
    pub decode_tokens: usize,
    /// Measured repetitions (the median is reported); one unmeasured warm-up run precedes them.
    pub repeats: usize,
}

/// Results (medians over repeats).
#[derive(Clone, Debug, Serialize)]
pub struct ForwardReport {
    /// Prompt tokens.
    pub prompt_len: usize,
    /// Decode steps.
    pub decode_tokens: usize,
    /// Prefill seconds for the whole prompt.
    pub prefill_s: f64,
    /// Prompt tokens per second.
    pub prefill_tok_s: f64,
    /// Decode tokens per second.
    pub decode_tok_s: f64,
    /// Weight bytes one decode token reads: dense part + top-k experts of every MoE layer.
    pub bytes_per_decode_token: u64,
    /// `bytes_per_decode_token × decode_tok_s`.
    pub decode_weight_gb_s: f64,
    /// On a compute device: what the prefill asked of it (the last repetition).
    pub device_prefill: Option<DeviceWork>,
    /// On a compute device: what one decode token asked of it (the last repetition, averaged).
    pub device_per_decode_token: Option<DeviceWork>,
}

/// What a stretch of work asked of the compute device ([`osprey_models::backend::DeviceStats`]'s counts,
/// over the stretch, divided by its tokens where per token).
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DeviceWork {
    /// Kernel launches.
    pub launches: f64,
    /// Calls that blocked the host until the device caught up.
    pub host_waits: f64,
    /// Device allocations.
    pub allocations: f64,
    /// Device frees.
    pub frees: f64,
    /// Bytes host → device.
    pub bytes_to_device: f64,
    /// Bytes device → host.
    pub bytes_from_device: f64,
    /// Launches per kernel, most first.
    pub kernels: Vec<(String, f64)>,
}

impl DeviceWork {
    /// The counts between `before` and `after`, divided by `per` (1: the stretch's totals). `None` on a
    /// backend without a device.
    pub fn between(
        before: &osprey_models::backend::DeviceStats,
        after: &osprey_models::backend::DeviceStats,
        per: usize,
    ) -> Option<DeviceWork> {
        after.memory_total?;
        let per = per.max(1) as f64;
        let d = |a: u64, b: u64| a.saturating_sub(b) as f64 / per;
        let mut kernels: Vec<(String, f64)> = after
            .kernels
            .iter()
            .map(|(k, n)| {
                let was = before.kernels.iter().find(|(b, _)| b == k).map_or(0, |(_, m)| *m);
                (k.clone(), d(*n, was))
            })
            .filter(|(_, n)| *n > 0.0)
            .collect();
        kernels.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        Some(DeviceWork {
            launches: d(after.launches, before.launches),
            host_waits: d(after.host_waits, before.host_waits),
            allocations: d(after.allocations, before.allocations),
            frees: d(after.frees, before.frees),
            bytes_to_device: d(after.bytes_to_device, before.bytes_to_device),
            bytes_from_device: d(after.bytes_from_device, before.bytes_from_device),
            kernels,
        })
    }
}

/// The deterministic prompt both osprey and tools/bench_transformers.py use.
pub fn bench_prompt(n: usize, vocab: usize) -> Vec<u32> {
    let span = vocab.saturating_sub(64).max(1);
    (0..n).map(|i| ((i * 7919 + 13) % span) as u32).collect()
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Errors of the benchmarks.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Loading or running the model.
    #[error(transparent)]
    Model(#[from] osprey_models::Error),
    /// The generation driver refused or failed.
    #[error(transparent)]
    Engine(#[from] RequestError),
    /// A results file or directory could not be read or written.
    #[error("{}: {source}", path.display())]
    Io {
        /// The file or directory.
        path: std::path::PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// A results file or document is not what the command reads (where, and why).
    #[error("{0}")]
    Input(String),
    /// Drawing a chart failed.
    #[error("chart: {0}")]
    Chart(String),
    /// The server under load could not be reached, or answered no request.
    #[error("{url}: {reason}")]
    Server {
        /// The server's base URL.
        url: String,
        /// What went wrong.
        reason: String,
    },
}

impl Error {
    /// An I/O failure on `path`.
    pub(crate) fn io(path: &std::path::Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
        move |source| Error::Io { path: path.to_path_buf(), source }
    }
}

/// Result alias of this crate.
pub type Result<T> = std::result::Result<T, Error>;

/// A text prompt for the driver.
fn text_prompt(ids: Vec<u32>) -> Arc<PreparedPrompt> {
    Arc::new(PreparedPrompt::text(ids))
}

/// Greedy decoding, as every engine is compared.
fn greedy() -> SamplingParams {
    SamplingParams { temperature: 0.0, ..SamplingParams::default() }
}

/// Runs the benchmark through the generation driver (the code path of the server's runner): the prompt
/// prefilled as one chunk, then `decode_tokens` greedy decode forwards.
pub fn bench_forward(driver: &mut Driver, b: ForwardBench) -> Result<ForwardReport> {
    let prompt = text_prompt(bench_prompt(b.prompt_len, driver.model().info().vocab_size));
    // The first token comes from the prefill; each further token costs one decode forward.
    let opts =
        GenerateOptions { chunk: b.prompt_len.max(1), max_tokens: b.decode_tokens + 1, stop_token_ids: Vec::new() };
    let (mut prefill, mut decode) = (Vec::new(), Vec::new());
    let backend = driver.model().backend().clone();
    let mut device = (None, None);
    for rep in 0..=b.repeats {
        let start = backend.stats();
        let mut first = None;
        let g = driver
            .generate_observed(prompt.clone(), greedy(), &opts, &mut NoMedia, &mut || first = Some(backend.stats()))?;
        if rep > 0 {
            prefill.push(g.prefill_secs);
            decode.push(g.decode_secs);
        }
        if let Some(first) = first.filter(|_| rep == b.repeats) {
            let end = backend.stats();
            device = (DeviceWork::between(&start, &first, 1), DeviceWork::between(&first, &end, b.decode_tokens));
        }
    }
    let model = driver.model();
    let (p, d) = (median(prefill), median(decode));
    let (dense, per_expert) = model.weight_bytes();
    let moe_layers = if per_expert > 0 { model.info().moe_layers } else { 0 };
    let top_k = model.info().experts_per_token;
    let bytes = (dense + moe_layers * top_k * per_expert) as u64;
    let decode_tok_s = b.decode_tokens as f64 / d.max(1e-12);
    Ok(ForwardReport {
        prompt_len: b.prompt_len,
        decode_tokens: b.decode_tokens,
        prefill_s: p,
        prefill_tok_s: b.prompt_len as f64 / p.max(1e-12),
        decode_tok_s,
        bytes_per_decode_token: bytes,
        decode_weight_gb_s: bytes as f64 * decode_tok_s / 1e9,
        device_prefill: device.0,
        device_per_decode_token: device.1,
    })
}

/// Vision encoding of one image size (medians).
#[derive(Clone, Debug, Serialize)]
pub struct VisionReport {
    /// Input width.
    pub width: usize,
    /// Input height.
    pub height: usize,
    /// `[t, h, w]` in patches after smart_resize.
    pub grid: [usize; 3],
    /// Soft tokens the decoder receives.
    pub tokens: usize,
    /// Resize + normalise + patchify seconds.
    pub preprocess_s: f64,
    /// Tower seconds (patch embed → merger).
    pub encode_s: f64,
    /// The compute backend and the GEMMs its matmuls take (the caller fills it in).
    pub kernels: String,
}

/// The deterministic test image both osprey and tools/bench_vision_transformers.py use.
pub fn bench_image(width: usize, height: usize) -> RgbImage {
    let mut data = Vec::with_capacity(width * height * 3);
    for y in 0..height {
        for x in 0..width {
            data.extend_from_slice(&[(x * 255 / width) as u8, (y * 255 / height) as u8, ((x + y) * 7 % 256) as u8]);
        }
    }
    RgbImage { width, height, data }
}

/// Times preprocessing and encoding of a `width`×`height` image.
pub fn bench_vision(
    tower: &VisionTower,
    p: &ImageParams,
    width: usize,
    height: usize,
    repeats: usize,
) -> Result<VisionReport> {
    let img = bench_image(width, height);
    let (mut pre, mut enc) = (Vec::new(), Vec::new());
    let mut grid = [0; 3];
    for rep in 0..=repeats {
        let t0 = Instant::now();
        let patches = preprocess_image(&img, p)?;
        let t1 = Instant::now();
        tower.encode(&patches.rows, patches.grid)?;
        let t2 = Instant::now();
        grid = patches.grid;
        if rep > 0 {
            pre.push((t1 - t0).as_secs_f64());
            enc.push((t2 - t1).as_secs_f64());
        }
    }
    let m = tower.config().spatial_merge_size;
    Ok(VisionReport {
        width,
        height,
        grid,
        tokens: grid.iter().product::<usize>() / (m * m),
        preprocess_s: median(pre),
        encode_s: median(enc),
        kernels: String::new(),
    })
}

/// Sustained read bandwidth of this machine: every thread of the pool sums its share of a large buffer
/// (16 independent lanes, so the loop is vectorised and memory-bound). Bytes per second, best of `repeats`.
pub fn measure_read_bandwidth(bytes: usize, repeats: usize) -> f64 {
    use rayon::prelude::*;
    let buf: Vec<f32> = (0..bytes / 4).map(|i| (i % 7) as f32).collect();
    let mut best = 0f64;
    for _ in 0..repeats.max(1) {
        let t0 = Instant::now();
        let total: f32 = buf
            .par_chunks(1 << 20)
            .map(|c| {
                let mut acc = [0f32; 16];
                for block in c.chunks_exact(16) {
                    for (a, b) in acc.iter_mut().zip(block) {
                        *a += b;
                    }
                }
                acc.iter().sum::<f32>()
            })
            .sum();
        let secs = t0.elapsed().as_secs_f64();
        std::hint::black_box(total);
        best = best.max(bytes as f64 / secs);
    }
    best
}

/// The machine a benchmark ran on, for its JSON.
#[derive(Clone, Debug, Serialize)]
pub struct Machine {
    /// `model name` of /proc/cpuinfo.
    pub cpu: String,
    /// The SIMD flags the kernels look at.
    pub flags: Vec<String>,
    /// Logical cores.
    pub cores: usize,
    /// `MemTotal` in bytes.
    pub ram_bytes: u64,
    /// Memory read bandwidth measured now (GB/s).
    pub read_gb_s: f64,
}

/// Reads the machine's description and measures its memory bandwidth (a second or so).
pub fn machine() -> Machine {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let field = |name: &str| {
        cpuinfo.lines().find(|l| l.starts_with(name)).and_then(|l| l.split(':').nth(1)).unwrap_or("").trim().to_string()
    };
    let wanted = ["avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni"];
    let flags = field("flags").split(' ').filter(|f| wanted.contains(f)).map(str::to_string).collect();
    let mem = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    let ram_kb = mem
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(0);
    Machine {
        cpu: field("model name"),
        flags,
        cores: std::thread::available_parallelism().map_or(1, |n| n.get()),
        ram_bytes: ram_kb * 1024,
        read_gb_s: measure_read_bandwidth(256 << 20, 3) / 1e9,
    }
}
