//! `osprey bench …`: the measurements (docs/bench.md). Each subcommand is a function here; the work is in
//! `osprey-bench`.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Subcommand;
use osprey_bench::{bench_forward, bench_vision, ForwardBench};
use osprey_models::vision::VisionTower;
use osprey_models::Model;

use super::Global;

#[derive(Subcommand, Debug)]
pub enum BenchCommand {
    /// Prefill and decode throughput of the model runtime (no server).
    Forward {
        /// Model directory.
        #[arg(long)]
        model: PathBuf,
        /// Prompt tokens (one prefill chunk).
        #[arg(long, default_value_t = 512)]
        prompt_len: usize,
        /// Greedy decode steps.
        #[arg(long, default_value_t = 32)]
        decode_tokens: usize,
        /// Measured repetitions (median reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
    /// Decode steps of several sequences at once, as a server at that concurrency runs them (no HTTP,
    /// tokenizer or scheduler): per batch size, the step's time, tokens per second and distinct routed
    /// experts per MoE layer
    Batch {
        /// Model directory.
        #[arg(long)]
        model: PathBuf,
        /// Batch sizes, comma-separated, each on fresh sequences.
        #[arg(long, value_delimiter = ',', default_value = "1,2,4,8")]
        batch: Vec<usize>,
        /// Prompt tokens per sequence (each prefilled alone).
        #[arg(long, default_value_t = 64)]
        prompt_len: usize,
        /// Timed decode steps per batch size (median reported).
        #[arg(long, default_value_t = 16)]
        decode_steps: usize,
    },
    /// The cost side of speculative decoding: a verification forward of K + 1 tokens against one decode
    /// step, after the same prompt (docs/speculative.md).
    Verify {
        /// Model directory.
        #[arg(long)]
        model: PathBuf,
        /// Prompt tokens before the measured forwards.
        #[arg(long, default_value_t = 512)]
        prompt_len: usize,
        /// Largest number of drafts K.
        #[arg(long, default_value_t = 4)]
        drafts: usize,
        /// Measured repetitions (median reported).
        #[arg(long, default_value_t = 5)]
        repeats: usize,
    },
    /// Writes a synthetic checkpoint of a real model's layer geometry (NVFP4 experts, bf16 rest), to
    /// measure the disk tier at real expert sizes without Python or real weights.
    Synth {
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Layer geometry: qwen3.5-35b-a3b, qwen3.8-flash-next, tiny or tiny-flash.
        #[arg(long, default_value = "qwen3.5-35b-a3b")]
        geometry: String,
        /// Decoder layers (every fourth is full attention).
        #[arg(long, default_value_t = 4)]
        layers: usize,
        /// Seed of the values.
        #[arg(long, default_value_t = 7)]
        seed: u64,
        /// Vision blocks (of the real widths; Qwen3.5's tower has 27): 0 writes a text-only checkpoint.
        #[arg(long, default_value_t = 0)]
        vision_layers: usize,
        /// `max_position_embeddings` (Qwen3.5's is 262144).
        #[arg(long, default_value_t = 32768)]
        context: usize,
    },
    /// SVG charts from bench JSON files: TTFT per request / turn and latency distributions from a
    /// `bench serve --out` file; decode tok/s and residency vs budget from `bench experts` lines.
    Chart {
        /// Directory for the SVG files.
        #[arg(long)]
        out: PathBuf,
        /// The JSON files.
        files: Vec<PathBuf>,
    },
    /// The committed runs of a directory (bench JSON files, JSON-lines from the side-by-side scripts,
    /// their charts) as Markdown; `--update FILE` rewrites FILE's generated block with it.
    Report {
        /// Directory of runs (docs/runs).
        dir: PathBuf,
        /// A Markdown file whose `bench report` block is replaced (docs/benchmarks.md).
        #[arg(long)]
        update: Option<PathBuf>,
    },
    /// The ratios B / A of every number two bench JSON files share.
    Compare {
        /// The baseline run.
        a: PathBuf,
        /// The run compared with it.
        b: PathBuf,
    },
    /// A load generator for any OpenAI-compatible chat endpoint: TTFT, inter-token latency, output
    /// tok/s, cached prompt tokens, errors by code; against osprey also how its counters moved.
    Serve(ServeBenchArgs),
    /// Decode with routed experts streamed from disk under a RAM budget (one budget per process, so the
    /// peak RSS is that budget's); compares eviction policies on the recorded routing trace.
    Experts(ExpertsArgs),
    /// Eviction policies compared on a recorded routing trace at several budgets, without the model.
    Replay {
        /// A trace written by `bench experts --trace-out`.
        #[arg(long)]
        trace: PathBuf,
        /// Budgets as fractions of all experts, comma-separated.
        #[arg(long, default_value = "1,0.5,0.25,0.1")]
        budgets: String,
    },
    /// The speed model of the CUDA backend on named cards: each step's kernels measured on the emulated
    /// device (bytes, declared FLOPs, launches, host waits) and priced against the card's roofline.
    Roofline(super::roofline::RooflineArgs),
    /// Sustained DRAM read bandwidth with the compute threads (the decode roofline's denominator).
    Membw {
        /// Buffer size in MiB (well above the last-level cache).
        #[arg(long, default_value_t = 1024)]
        mib: usize,
    },
    /// Vision tower encoding time for images of the given sizes (WxH).
    Vision {
        /// Model directory with a vision tower.
        #[arg(long)]
        model: PathBuf,
        /// Image sizes as WxH.
        #[arg(long, value_delimiter = ',', default_value = "448x448,1024x768")]
        sizes: Vec<String>,
        /// Measured repetitions (median reported).
        #[arg(long, default_value_t = 3)]
        repeats: usize,
    },
}

/// `osprey bench experts`.
#[derive(clap::Args, Debug)]
pub struct ExpertsArgs {
    /// MoE model directory (NVFP4 or dense).
    #[arg(long)]
    pub model: PathBuf,
    /// Budget as a fraction of all expert bytes.
    #[arg(long, default_value_t = 1.0)]
    pub budget: f64,
    /// Prompt tokens before decoding.
    #[arg(long, default_value_t = 64)]
    pub prompt_len: usize,
    /// Decode steps measured.
    #[arg(long, default_value_t = 32)]
    pub decode_tokens: usize,
    /// Baseline: compute routed experts only once all of a layer's are read (no overlap of resident
    /// experts with the reads).
    #[arg(long)]
    pub wait_all: bool,
    /// Warm the budget up before the prompt (`--expert-warmup`); the report gives the warm-up's seconds.
    #[arg(long)]
    pub warmup: bool,
    /// PLE row budget as a fraction of the tables' rows (models with PLE, qwen4_exp).
    #[arg(long, default_value_t = 1.0)]
    pub ple_budget: f64,
    /// Write the routing trace the run recorded (JSON) for `bench replay` and `--prefetch oracle`.
    #[arg(long)]
    pub trace_out: Option<PathBuf>,
    /// Read experts ahead: off, router, previous, union (as `serve --expert-prefetch`), oracle (the
    /// next layer's true experts from `--trace-in`: the pipeline's ceiling), or wrong / wrong-unscored
    /// (as many experts the next layer does not route to: what a wrong guess costs, scored by its measured
    /// precision or claimed sure).
    #[arg(long, default_value = "off")]
    pub prefetch: String,
    /// Experts per token the router guess adds beyond top-k.
    #[arg(long, default_value_t = 2)]
    pub prefetch_margin: usize,
    /// MoE layers ahead each layer guesses (as `serve --expert-prefetch-depth`).
    #[arg(long, default_value_t = 1)]
    pub prefetch_depth: usize,
    /// With `--prefetch oracle`: a trace of the same prompt (`--trace-out` of an earlier run).
    #[arg(long)]
    pub trace_in: Option<PathBuf>,
    /// A sweep instead of one budget: comma-separated fractions, each run in its own process (so
    /// each peak RSS is that budget's), after measuring the disk's read bandwidth; the runs go to
    /// stdout as JSON lines, and with `--out` into one JSON file with the machine.
    #[arg(long)]
    pub budgets: Option<String>,
    /// With `--budgets`: the sweep's JSON file.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// `osprey bench serve`.
#[derive(clap::Args, Debug)]
pub struct ServeBenchArgs {
    /// Base URL (http://host:port).
    #[arg(long)]
    pub url: String,
    /// `model` field of the requests.
    #[arg(long)]
    pub model: Option<String>,
    /// text, conversation (multi-turn about an image), preamble-image (long text then an image),
    /// video, long-images (a conversation of images to `--context-tokens`, per-turn server gauges).
    #[arg(long, default_value = "text")]
    pub scenario: String,
    /// Requests (conversation: turns; long-images: the most turns, `--context-tokens` ending it first).
    #[arg(long, default_value_t = 8)]
    pub requests: usize,
    /// long-images: end at the first turn whose prompt holds this many tokens (8k, 32k, 64k).
    #[arg(long)]
    pub context_tokens: Option<usize>,
    /// long-images: each image as a sentence of as many words as it has tokens (a text-only peer,
    /// e.g. llama-server, gets the same conversation and context growth).
    #[arg(long)]
    pub text_only: bool,
    /// long-images: after each turn, send its message alone with fresh media of the same sizes (a cold
    /// request of the same content at the same moment; its TTFT goes beside the turn's).
    #[arg(long)]
    pub cold_reference: bool,
    /// Requests in flight at once.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Poisson arrivals at this many requests per second instead (seeded).
    #[arg(long)]
    pub rate: Option<f64>,
    /// Seed of the media, prompts and arrivals.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// `max_tokens` of each request.
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// Bearer token.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Per-request timeout in seconds.
    #[arg(long, default_value_t = 300.0)]
    pub timeout_secs: f64,
    /// Write the report (every sample, the command line, version and machine) as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The served checkpoint's directory, when the server runs on this machine: its disk's random-read
    /// bandwidth (as expert misses read it) is measured at the start and recorded with the machine.
    #[arg(long)]
    pub disk_dir: Option<PathBuf>,
    /// A JSON file holding a `response_format` object sent with every request (structured output:
    /// the run then measures constrained decoding; osprey reports its mask time).
    #[arg(long)]
    pub response_format: Option<PathBuf>,
}

/// Runs `osprey bench …`.
impl BenchCommand {
    /// Whether it runs a model's matmuls here (so `--gemm auto` is measured first); the others write,
    /// read or chart files, load another server, or time memory.
    pub fn runs_a_model(&self) -> bool {
        matches!(
            self,
            BenchCommand::Forward { .. }
                | BenchCommand::Batch { .. }
                | BenchCommand::Verify { .. }
                | BenchCommand::Experts(_)
                | BenchCommand::Vision { .. }
        )
    }
}

pub fn run(cmd: BenchCommand, g: &Global) -> Result<()> {
    match cmd {
        BenchCommand::Forward { model, prompt_len, decode_tokens, repeats } => {
            let mut driver = osprey_runner::Driver::new(load(&model, g)?, 16);
            let report = bench_forward(&mut driver, ForwardBench { prompt_len, decode_tokens, repeats })?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        BenchCommand::Batch { model, batch, prompt_len, decode_steps } => {
            let model = load(&model, g)?;
            let b = osprey_bench::BatchBench { batches: batch, prompt_len, decode_steps };
            println!("{}", serde_json::to_string_pretty(&osprey_bench::bench_batch(&model, &b)?)?);
            Ok(())
        }
        BenchCommand::Verify { model, prompt_len, drafts, repeats } => {
            let model = load(&model, g)?;
            let report = osprey_bench::bench_verify(&model, osprey_bench::VerifyBench { prompt_len, drafts, repeats })?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        BenchCommand::Experts(a) if a.budgets.is_some() => experts_sweep(a, g),
        BenchCommand::Experts(a) => experts(a, g),
        BenchCommand::Serve(a) => serve(a),
        BenchCommand::Synth { out, geometry, layers, seed, vision_layers, context } => {
            let geo = osprey_bench::synth::geometry(&geometry).with_context(|| {
                format!("unknown geometry {geometry:?} (qwen3.5-35b-a3b, qwen3.8-flash-next, tiny, tiny-flash)")
            })?;
            let o = osprey_bench::synth::Options { vision_layers, context: context.max(1) };
            let report = osprey_bench::synth::synth_with(&out, geo, layers.max(1), seed, o)
                .with_context(|| format!("writing {}", out.display()))?;
            // The embedded model's tokenizer and chat template, so the checkpoint can be served.
            osprey::default_model::write_tokenizer_files(&out)?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
        BenchCommand::Replay { trace, budgets } => replay(&trace, &budgets),
        BenchCommand::Chart { out, files } => {
            for p in osprey_bench::chart::charts(&files, &out)? {
                println!("{}", p.display());
            }
            Ok(())
        }
        BenchCommand::Report { dir, update } => report(&dir, update.as_deref()),
        BenchCommand::Compare { a, b } => {
            print!("{}", osprey_bench::compare(&read_json(&a)?, &read_json(&b)?));
            Ok(())
        }
        BenchCommand::Roofline(a) => super::roofline::run(a, g),
        BenchCommand::Membw { mib } => {
            let bw = osprey_bench::measure_read_bandwidth(mib << 20, 5);
            println!("{}", serde_json::json!({ "read_gb_s": bw / 1e9, "mib": mib }));
            Ok(())
        }
        BenchCommand::Vision { model, sizes, repeats } => vision(&model, &sizes, repeats, g),
    }
}

fn read_json(p: &Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
    serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))
}

/// `bench experts --budgets a,b,…`: each budget in a fresh process (a cold page cache and a new
/// residency manager per point), with this run's global flags, after measuring the disk.
fn experts_sweep(a: ExpertsArgs, g: &Global) -> Result<()> {
    let disk = osprey_bench::measure_disk_read(&a.model, 3.0).context("measuring the disk")?;
    eprintln!("disk random-read bandwidth {disk:.2} GB/s (O_DIRECT 512 KiB reads over the checkpoint)");
    let mut runs = Vec::new();
    for b in a.budgets.as_deref().unwrap_or_default().split(',') {
        let b: f64 = b.trim().parse().with_context(|| format!("budget {b:?}"))?;
        let mut cmd = std::process::Command::new(std::env::current_exe()?);
        cmd.args(g.args());
        cmd.args(["bench", "experts", "--model"]).arg(&a.model);
        cmd.args(["--budget", &b.to_string(), "--ple-budget", &(b * a.ple_budget).to_string()]);
        cmd.args(["--prompt-len", &a.prompt_len.to_string(), "--decode-tokens", &a.decode_tokens.to_string()]);
        if a.wait_all {
            cmd.arg("--wait-all");
        }
        if a.warmup {
            cmd.arg("--warmup");
        }
        cmd.args(["--prefetch", &a.prefetch, "--prefetch-margin", &a.prefetch_margin.to_string()]);
        cmd.args(["--prefetch-depth", &a.prefetch_depth.to_string()]);
        if let Some(t) = &a.trace_in {
            cmd.arg("--trace-in").arg(t);
        }
        let o = cmd.stderr(std::process::Stdio::null()).output().context("running a budget")?;
        anyhow::ensure!(o.status.success(), "the run at budget {b} failed");
        let line = String::from_utf8_lossy(&o.stdout).trim().to_string();
        println!("{line}");
        runs.push(serde_json::from_str::<serde_json::Value>(&line)?);
    }
    if let Some(path) = a.out {
        write_run(&path, osprey_bench::machine(), Some(disk), "runs", serde_json::to_value(&runs)?)?;
    }
    Ok(())
}

/// `bench experts` at one budget.
fn experts(a: ExpertsArgs, g: &Global) -> Result<()> {
    let backend = osprey::open_backend(g.device.as_deref(), g.activations.as_deref())?;
    let run = osprey_bench::ExpertsRun {
        fraction: a.budget,
        ple_fraction: a.ple_budget,
        prompt_len: a.prompt_len,
        decode_tokens: a.decode_tokens,
        wait_all: a.wait_all,
        warmup: a.warmup,
        prefetch: match a.prefetch.as_str() {
            "oracle" => {
                let path = a.trace_in.as_ref().context("--prefetch oracle needs --trace-in (a --trace-out file)")?;
                osprey_bench::Prefetch::Oracle(serde_json::from_value(read_json(path)?)?)
            }
            name @ ("wrong" | "wrong-unscored") => {
                let path = a.trace_in.as_ref().context("--prefetch wrong needs --trace-in (a --trace-out file)")?;
                osprey_bench::Prefetch::Wrong(serde_json::from_value(read_json(path)?)?, name == "wrong")
            }
            "off" => osprey_bench::Prefetch::Off,
            name => osprey_bench::Prefetch::Policy(name.to_string(), a.prefetch_margin),
        },
        prefetch_depth: a.prefetch_depth,
    };
    let (report, trace) = osprey_bench::bench_experts_traced(&a.model, run, backend)?;
    if let Some(path) = a.trace_out {
        std::fs::write(&path, serde_json::to_string(&trace)?).with_context(|| format!("writing {}", path.display()))?;
    }
    println!("{}", serde_json::to_string(&report)?);
    Ok(())
}

/// `bench serve`: a load generator for any OpenAI-compatible server.
fn serve(a: ServeBenchArgs) -> Result<()> {
    let disk = match &a.disk_dir {
        Some(d) => Some(osprey_bench::measure_disk_read(d, 3.0).context("measuring the disk")?),
        None => None,
    };
    let machine = a.out.as_ref().map(|_| osprey_bench::machine());
    let response_format = match &a.response_format {
        Some(p) => Some(read_json(p)?),
        None => None,
    };
    let opts = osprey_bench::serve::ServeOptions {
        url: a.url.trim_end_matches('/').to_string(),
        model: a.model,
        scenario: a.scenario.parse().map_err(anyhow::Error::msg)?,
        requests: a.requests,
        concurrency: a.concurrency,
        rate: a.rate,
        seed: a.seed,
        max_tokens: a.max_tokens,
        api_key: a.api_key,
        timeout_secs: a.timeout_secs,
        response_format,
        context_tokens: a.context_tokens,
        text_only: a.text_only,
        cold_reference: a.cold_reference,
    };
    let report = osprey_bench::serve::run(&opts)?;
    print!("{}", osprey_bench::serve::table(&report));
    if let Some(path) = a.out {
        write_run(&path, machine, disk, "report", serde_json::to_value(&report)?)?;
    }
    Ok(())
}

/// `bench replay`: a routing trace under expert budgets and policies.
fn replay(trace: &Path, budgets: &str) -> Result<()> {
    let text = std::fs::read_to_string(trace).with_context(|| format!("reading {}", trace.display()))?;
    let t: osprey_bench::TraceFile =
        serde_json::from_str(&text).with_context(|| format!("{} is not a routing trace", trace.display()))?;
    let fractions: Vec<f64> = budgets
        .split(',')
        .map(|b| b.trim().parse::<f64>().with_context(|| format!("budget {b:?}")))
        .collect::<Result<_>>()?;
    for (f, p) in osprey_bench::replay(&t, &fractions) {
        println!("{}", serde_json::json!({"budget_fraction": f, "policies": p}));
    }
    for a in osprey_bench::predict::evaluate_all(&t) {
        println!("{}", serde_json::json!({"predictor": a}));
    }
    Ok(())
}

/// `bench report`: the committed runs as the benchmarks document's block (printed, or spliced in).
fn report(dir: &Path, update: Option<&Path>) -> Result<()> {
    let block = osprey_bench::report::render(dir)?;
    match update {
        None => print!("{block}"),
        Some(doc) => {
            let text = std::fs::read_to_string(doc).with_context(|| format!("reading {}", doc.display()))?;
            let new = osprey_bench::report::splice(&text, &block)?;
            std::fs::write(doc, new).with_context(|| format!("writing {}", doc.display()))?;
        }
    }
    Ok(())
}

/// `bench vision`: the vision tower at each size.
fn vision(model: &Path, sizes: &[String], repeats: usize, g: &Global) -> Result<()> {
    let backend = osprey::open_backend(g.device.as_deref(), g.activations.as_deref())?;
    let kernels = backend.describe();
    let tower = VisionTower::from_dir(model, backend)?.context("the model has no vision tower")?;
    let proc = osprey_models::vision::ProcessorConfig::from_dir(model)?;
    for size in sizes {
        let (w, h) = size.split_once('x').context("sizes are WxH")?;
        let mut report = bench_vision(&tower, &proc.image, w.parse()?, h.parse()?, repeats)?;
        report.kernels = kernels.clone();
        println!("{}", serde_json::to_string_pretty(&report)?);
    }
    Ok(())
}

/// A bench run's JSON file: the command line, osprey's version, the machine (and the disk's bandwidth
/// when measured) beside the results under `key`.
pub(crate) fn write_run(
    path: &std::path::Path,
    machine: impl serde::Serialize,
    disk_read_gb_s: Option<f64>,
    key: &str,
    results: serde_json::Value,
) -> Result<()> {
    let mut doc = serde_json::json!({
        "command": std::env::args().collect::<Vec<_>>(),
        "osprey_version": env!("CARGO_PKG_VERSION"),
        "machine": machine,
        "disk_read_gb_s": disk_read_gb_s,
    });
    doc[key] = results;
    std::fs::write(path, serde_json::to_string_pretty(&doc)?).with_context(|| format!("writing {}", path.display()))
}

/// A model for a benchmark, by directory or Hugging Face id, on the global device.
fn load(dir: &Path, g: &Global) -> Result<Model> {
    let t0 = Instant::now();
    let dir = &osprey::hub::resolve(dir)?;
    let backend = osprey::open_backend(g.device.as_deref(), g.activations.as_deref())?;
    let m = osprey_models::load_on(dir, backend).with_context(|| format!("loading {}", dir.display()))?;
    tracing::info!(model = %dir.display(), family = m.info().family, layers = m.info().num_layers, secs = t0.elapsed().as_secs_f64(), "model loaded");
    Ok(m)
}
