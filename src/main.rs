//! `osprey`: the command line. It only wires crates together; every behaviour lives in a crate.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use osprey_bench::{bench_forward, bench_vision, ForwardBench};
use osprey_models::vision::VisionTower;
use osprey_models::Model;

mod run;

#[derive(Parser, Debug)]
#[command(name = "osprey", version, about = "Serve Qwen multimodal MoE models larger than RAM from one home machine")]
struct Cli {
    /// Compute threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Compute device: cpu (default); cuda:N once the CUDA backend lands. `serve` also reads it from
    /// the settings file.
    #[arg(long, global = true)]
    device: Option<String>,
    /// Activations of the matmuls: int8 (the fast default: int8 for NVFP4 decode, bf16 for bf16
    /// matmuls and NVFP4 prefill on CPUs with AVX512-BF16; a small documented drift) or f32 (exact).
    #[arg(long, global = true)]
    activations: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(clap::Args, Debug, Default)]
struct ServeArgs {
    /// Settings file (TOML, see config/osprey.toml); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model directory, or a Hugging Face id (`org/name[@revision]`) in the local HF cache (default: the
    /// embedded tiny model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Id clients send as `model`.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Listen address.
    #[arg(long)]
    host: Option<String>,
    /// Listen port.
    #[arg(long)]
    port: Option<u16>,
    /// Require `Authorization: Bearer <key>` on /v1 routes.
    #[arg(long)]
    api_key: Option<String>,
    /// Override the model's context length.
    #[arg(long)]
    context_len: Option<usize>,
    /// Prompt tokens per sequence per step (prefill chunk).
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// Tokens per step over all sequences.
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Concurrent sequences.
    #[arg(long)]
    max_running_requests: Option<usize>,
    /// KV capacity in tokens.
    #[arg(long)]
    kv_capacity_tokens: Option<usize>,
    /// Vision encoder cache in MiB.
    #[arg(long)]
    vision_cache_mb: Option<usize>,
    /// Turn the prefix cache off.
    #[arg(long)]
    disable_prefix_cache: bool,
    /// Prefix cache budget (KV pages + recurrent snapshots) in MiB.
    #[arg(long)]
    prefix_cache_mb: Option<f64>,
    /// MiB of live tensors (activations, states, KV) the compute backend may hold; past it a request
    /// gets 503 out_of_memory and the engine goes on.
    #[arg(long)]
    device_memory_mb: Option<f64>,
    /// Element type of the KV cache: `f32` (default, exact) or `bf16` (half the KV memory).
    #[arg(long)]
    kv_cache_dtype: Option<String>,
    /// Draft tokens per decode step from the checkpoint's MTP head (speculative decoding; 0: off).
    #[arg(long)]
    speculative_tokens: Option<usize>,
    /// Prefix cache page size in tokens.
    #[arg(long)]
    page_size: Option<usize>,
    /// Recurrent-state snapshot grid in tokens (a multiple of the page size).
    #[arg(long)]
    snapshot_interval: Option<usize>,
    /// Stream routed experts from disk, keeping at most this many GB of them in RAM.
    #[arg(long)]
    expert_ram_gb: Option<f64>,
    /// Stream routed experts from disk, keeping at most this many experts per layer in RAM.
    #[arg(long)]
    expert_ram_experts: Option<usize>,
    /// RAM for cached PLE table rows in GB, all layers together (qwen4_exp; default 1).
    #[arg(long)]
    ple_ram_gb: Option<f64>,
    /// Expert reader: auto, io_uring or pread.
    #[arg(long)]
    expert_reader: Option<String>,
    /// Expert eviction policy: lru or lfu.
    #[arg(long)]
    expert_policy: Option<String>,
    /// Images + videos per request.
    #[arg(long)]
    max_media_per_request: Option<usize>,
    /// Bytes per media item.
    #[arg(long)]
    max_media_bytes: Option<usize>,
    /// Declared pixels per image or frame (checked before decoding).
    #[arg(long)]
    max_image_pixels: Option<u64>,
    /// Frames per video.
    #[arg(long)]
    max_video_frames: Option<usize>,
    /// Hosts whose http(s) media URLs may be fetched (comma-separated).
    #[arg(long, value_delimiter = ',')]
    allowed_media_domains: Option<Vec<String>>,
    /// Directory under which file:// media may be read.
    #[arg(long)]
    allowed_local_media_path: Option<PathBuf>,
    /// Host names clients may use in `Host` without an API key, besides localhost and IP addresses
    /// (comma-separated; defeats DNS rebinding).
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Option<Vec<String>>,
    /// Browser origins allowed to call the API, e.g. `https://chat.example` (comma-separated, `*` for
    /// any; default none).
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Option<Vec<String>>,
    /// Seconds running generations may go on after SIGTERM / SIGINT before they are ended (default 30).
    #[arg(long)]
    shutdown_grace_secs: Option<u64>,
    /// Most requests waiting for admission; more get 503 with Retry-After (default 256; 0: no limit).
    #[arg(long)]
    max_queued_requests: Option<usize>,
    /// Seconds a request may wait for admission before it gets 503 with Retry-After (default: no limit).
    #[arg(long)]
    max_queue_wait_secs: Option<f64>,
    /// Seconds a client has to send its whole request body; then 408 and the connection is closed
    /// (default 30).
    #[arg(long)]
    body_timeout_secs: Option<f64>,
    /// Longest a request may run from arrival, queue included; then it ends with finish_reason
    /// "timeout" (504 deadline_exceeded before its first token). Requests may ask for less with
    /// `deadline_secs`. Default: no limit.
    #[arg(long)]
    request_deadline_secs: Option<f64>,
    /// Seconds an idle keep-alive connection, or one that has not sent its request head, stays open
    /// (default 5).
    #[arg(long)]
    idle_timeout_secs: Option<f64>,
    /// Tokenizer worker threads per lane (media prompts; text prompts and detokenization) (default 2).
    #[arg(long)]
    tokenizer_workers: Option<usize>,
    /// Most pixels of all images and video frames of one request, by declared size (default 192000000,
    /// ~576 MB decoded).
    #[arg(long)]
    max_request_pixels: Option<u64>,
    /// Most responses `/v1/responses` keeps for `previous_response_id` (default 1024; 0 keeps none).
    #[arg(long)]
    max_stored_responses: Option<usize>,
    /// Most MiB of conversations kept for `previous_response_id`, media included (default 256).
    #[arg(long)]
    max_stored_response_mb: Option<f64>,
    /// Do not serve the web page (the chat at `/` and the engine view at `/dashboard`).
    #[arg(long)]
    no_webui: bool,
}

impl ServeArgs {
    fn settings(&self) -> osprey::Settings {
        osprey::Settings {
            model: self.model.clone(),
            served_model_name: self.served_model_name.clone(),
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key.clone(),
            http_workers: None,
            context_len: self.context_len,
            max_prefill_tokens: self.max_prefill_tokens,
            max_batch_tokens: self.max_batch_tokens,
            max_running_requests: self.max_running_requests,
            kv_capacity_tokens: self.kv_capacity_tokens,
            vision_cache_mb: self.vision_cache_mb,
            disable_prefix_cache: self.disable_prefix_cache.then_some(true),
            prefix_cache_mb: self.prefix_cache_mb,
            device_memory_mb: self.device_memory_mb,
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            speculative_tokens: self.speculative_tokens,
            page_size: self.page_size,
            snapshot_interval: self.snapshot_interval,
            expert_ram_gb: self.expert_ram_gb,
            expert_ram_experts: self.expert_ram_experts,
            expert_reader: self.expert_reader.clone(),
            ple_ram_gb: self.ple_ram_gb,
            expert_policy: self.expert_policy.clone(),
            max_media_per_request: self.max_media_per_request,
            max_media_bytes: self.max_media_bytes,
            max_image_pixels: self.max_image_pixels,
            max_video_frames: self.max_video_frames,
            allowed_media_domains: self.allowed_media_domains.clone(),
            allowed_local_media_path: self.allowed_local_media_path.clone(),
            allowed_hosts: self.allowed_hosts.clone(),
            allowed_origins: self.allowed_origins.clone(),
            shutdown_grace_secs: self.shutdown_grace_secs,
            max_queued_requests: self.max_queued_requests,
            max_queue_wait_secs: self.max_queue_wait_secs,
            body_timeout_secs: self.body_timeout_secs,
            request_deadline_secs: self.request_deadline_secs,
            idle_timeout_secs: self.idle_timeout_secs,
            tokenizer_workers: self.tokenizer_workers,
            max_request_pixels: self.max_request_pixels,
            max_stored_responses: self.max_stored_responses,
            max_stored_response_mb: self.max_stored_response_mb,
            no_webui: self.no_webui.then_some(true),
            device: None,
            activations: None,
        }
    }
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8080).
    Serve(Box<ServeArgs>),
    /// Load a model directory, run one prompt (text, images, videos) and print the greedy continuation.
    Run(run::RunArgs),
    /// Convert a dense checkpoint into an NVFP4 (ModelOpt layout) checkpoint.
    Quantize {
        /// Source model directory.
        #[arg(long)]
        model: PathBuf,
        /// Output directory.
        #[arg(long)]
        out: PathBuf,
        /// Quantise every decoder linear (not routers, embeddings, lm_head, norms, vision), not only experts.
        #[arg(long)]
        all_linear: bool,
        /// Quantise the (untied) lm_head as well: it is read whole for every token.
        #[arg(long)]
        lm_head: bool,
    },
    /// Download a model by Hugging Face id (`org/name[@revision]`) into the Hugging Face cache without
    /// serving it: only the files a model needs, resumable; `HF_TOKEN` for gated repositories.
    Pull {
        /// The model's id.
        id: String,
    },
    /// Measure the runtime.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Subcommand, Debug)]
enum BenchCommand {
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
    Serve {
        /// Base URL (http://host:port).
        #[arg(long)]
        url: String,
        /// `model` field of the requests.
        #[arg(long)]
        model: Option<String>,
        /// text, conversation (multi-turn about an image), preamble-image (long text then an image),
        /// video.
        #[arg(long, default_value = "text")]
        scenario: String,
        /// Requests (conversation: turns).
        #[arg(long, default_value_t = 8)]
        requests: usize,
        /// Requests in flight at once.
        #[arg(long, default_value_t = 1)]
        concurrency: usize,
        /// Poisson arrivals at this many requests per second instead (seeded).
        #[arg(long)]
        rate: Option<f64>,
        /// Seed of the media, prompts and arrivals.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// `max_tokens` of each request.
        #[arg(long, default_value_t = 32)]
        max_tokens: usize,
        /// Bearer token.
        #[arg(long)]
        api_key: Option<String>,
        /// Per-request timeout in seconds.
        #[arg(long, default_value_t = 300.0)]
        timeout_secs: f64,
        /// Write the report (every sample, the command line, version and machine) as JSON here.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The served checkpoint's directory, when the server runs on this machine: its disk's random-read
        /// bandwidth (as expert misses read it) is measured at the start and recorded with the machine.
        #[arg(long)]
        disk_dir: Option<PathBuf>,
        /// A JSON file holding a `response_format` object sent with every request (structured output:
        /// the run then measures constrained decoding; osprey reports its mask time).
        #[arg(long)]
        response_format: Option<PathBuf>,
    },
    /// Decode with routed experts streamed from disk under a RAM budget (one budget per process, so the
    /// peak RSS is that budget's); compares eviction policies on the recorded routing trace.
    Experts {
        /// MoE model directory (NVFP4 or dense).
        #[arg(long)]
        model: PathBuf,
        /// Budget as a fraction of all expert bytes.
        #[arg(long, default_value_t = 1.0)]
        budget: f64,
        /// Prompt tokens before decoding.
        #[arg(long, default_value_t = 64)]
        prompt_len: usize,
        /// Decode steps measured.
        #[arg(long, default_value_t = 32)]
        decode_tokens: usize,
        /// Baseline: compute routed experts only once all of a layer's are read (no overlap of resident
        /// experts with the reads).
        #[arg(long)]
        wait_all: bool,
        /// PLE row budget as a fraction of the tables' rows (models with PLE, qwen4_exp).
        #[arg(long, default_value_t = 1.0)]
        ple_budget: f64,
        /// Write the routing trace the run recorded (JSON) for `bench replay`.
        #[arg(long)]
        trace_out: Option<PathBuf>,
        /// A sweep instead of one budget: comma-separated fractions, each run in its own process (so
        /// each peak RSS is that budget's), after measuring the disk's read bandwidth; the runs go to
        /// stdout as JSON lines, and with `--out` into one JSON file with the machine.
        #[arg(long)]
        budgets: Option<String>,
        /// With `--budgets`: the sweep's JSON file.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Eviction policies compared on a recorded routing trace at several budgets, without the model.
    Replay {
        /// A trace written by `bench experts --trace-out`.
        #[arg(long)]
        trace: PathBuf,
        /// Budgets as fractions of all experts, comma-separated.
        #[arg(long, default_value = "1,0.5,0.25,0.1")]
        budgets: String,
    },
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

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().context("thread pool")?;
    }
    match cli.command {
        Command::Serve(a) => serve(*a, cli.device, cli.activations),
        Command::Quantize { model, out, all_linear, lm_head } => {
            let opts = osprey_models::QuantizeOptions { all_linear, lm_head };
            let mut progress = osprey::Progress::new("quantizing");
            osprey_models::quantize_dir(&osprey::hub::resolve(&model)?, &out, opts, &mut |d, n| progress.update(d, n))?;
            tracing::info!(out = %out.display(), "wrote the NVFP4 checkpoint");
            Ok(())
        }
        Command::Pull { id } => {
            let dir = osprey::hub::pull_id(&id)?;
            println!("{}", dir.display());
            Ok(())
        }
        Command::Run(mut a) => {
            a.model = osprey::hub::resolve(&a.model)?;
            let backend = osprey::open_backend(cli.device.as_deref(), cli.activations.as_deref())?;
            let load = || -> Result<osprey_models::Model> {
                let cfg = osprey_models::ModelConfig::from_dir(&a.model)?;
                let ck = osprey_models::Checkpoint::open(&a.model)?;
                let opts = osprey_models::LoadOptions { draft_head: a.speculative_tokens > 0, ..Default::default() };
                Ok(osprey_models::load_with_options(&cfg, &ck, opts, backend.clone(), &mut |_, _| {})?)
            };
            let m = load().with_context(|| format!("loading {}", a.model.display()))?;
            run::run(a, m, backend)
        }
        Command::Bench(BenchCommand::Forward { model, prompt_len, decode_tokens, repeats }) => {
            let model = load(&model, cli.device.as_deref(), cli.activations.as_deref())?;
            let mut driver = osprey_runner::Driver::new(model, 16);
            let report = bench_forward(&mut driver, ForwardBench { prompt_len, decode_tokens, repeats })?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Bench(BenchCommand::Verify { model, prompt_len, drafts, repeats }) => {
            let model = load(&model, cli.device.as_deref(), cli.activations.as_deref())?;
            let report = osprey_bench::bench_verify(&model, osprey_bench::VerifyBench { prompt_len, drafts, repeats })?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Bench(BenchCommand::Experts {
            model,
            prompt_len,
            decode_tokens,
            wait_all,
            ple_budget,
            budgets: Some(budgets),
            out,
            ..
        }) => {
            let disk = osprey_bench::measure_disk_read(&model, 3.0).context("measuring the disk")?;
            eprintln!("disk random-read bandwidth {disk:.2} GB/s (O_DIRECT 512 KiB reads over the checkpoint)");
            let mut runs = Vec::new();
            for b in budgets.split(',') {
                let b: f64 = b.trim().parse().with_context(|| format!("budget {b:?}"))?;
                let mut cmd = std::process::Command::new(std::env::current_exe()?);
                if let Some(t) = cli.threads {
                    cmd.arg("--threads").arg(t.to_string());
                }
                cmd.args(["bench", "experts", "--model"]).arg(&model);
                cmd.args(["--budget", &b.to_string(), "--ple-budget", &(b * ple_budget).to_string()]);
                cmd.args(["--prompt-len", &prompt_len.to_string(), "--decode-tokens", &decode_tokens.to_string()]);
                if wait_all {
                    cmd.arg("--wait-all");
                }
                let o = cmd.stderr(std::process::Stdio::null()).output().context("running a budget")?;
                anyhow::ensure!(o.status.success(), "the run at budget {b} failed");
                let line = String::from_utf8_lossy(&o.stdout).trim().to_string();
                println!("{line}");
                runs.push(serde_json::from_str::<serde_json::Value>(&line)?);
            }
            if let Some(path) = out {
                write_run(&path, osprey_bench::machine(), Some(disk), "runs", serde_json::to_value(&runs)?)?;
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Experts {
            model,
            budget,
            prompt_len,
            decode_tokens,
            wait_all,
            ple_budget,
            trace_out,
            budgets: None,
            ..
        }) => {
            let backend = osprey::open_backend(cli.device.as_deref(), cli.activations.as_deref())?;
            let run = osprey_bench::ExpertsRun {
                fraction: budget,
                ple_fraction: ple_budget,
                prompt_len,
                decode_tokens,
                wait_all,
            };
            let (report, trace) = osprey_bench::bench_experts_traced(&model, run, backend)?;
            if let Some(path) = trace_out {
                std::fs::write(&path, serde_json::to_string(&trace)?)
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
        Command::Bench(BenchCommand::Serve {
            url,
            model,
            scenario,
            requests,
            concurrency,
            rate,
            seed,
            max_tokens,
            api_key,
            timeout_secs,
            out,
            disk_dir,
            response_format,
        }) => {
            let disk = match &disk_dir {
                Some(d) => Some(osprey_bench::measure_disk_read(d, 3.0).context("measuring the disk")?),
                None => None,
            };
            let machine = out.as_ref().map(|_| osprey_bench::machine());
            let opts = osprey_bench::serve::ServeOptions {
                url: url.trim_end_matches('/').to_string(),
                model,
                scenario: scenario.parse().map_err(anyhow::Error::msg)?,
                requests,
                concurrency,
                rate,
                seed,
                max_tokens,
                api_key,
                timeout_secs,
                response_format: response_format
                    .map(|p| -> anyhow::Result<serde_json::Value> {
                        let text = std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?;
                        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", p.display()))
                    })
                    .transpose()?,
            };
            let report = osprey_bench::serve::run(&opts).map_err(anyhow::Error::msg)?;
            print!("{}", osprey_bench::serve::table(&report));
            if let Some(path) = out {
                write_run(&path, machine, disk, "report", serde_json::to_value(&report)?)?;
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Synth { out, geometry, layers, seed }) => {
            let g = osprey_bench::synth::geometry(&geometry).with_context(|| {
                format!("unknown geometry {geometry:?} (qwen3.5-35b-a3b, qwen3.8-flash-next, tiny, tiny-flash)")
            })?;
            let report = osprey_bench::synth::synth(&out, g, layers.max(1), seed)
                .with_context(|| format!("writing {}", out.display()))?;
            println!("{}", serde_json::to_string(&report)?);
            Ok(())
        }
        Command::Bench(BenchCommand::Replay { trace, budgets }) => {
            let text = std::fs::read_to_string(&trace).with_context(|| format!("reading {}", trace.display()))?;
            let t: osprey_bench::TraceFile =
                serde_json::from_str(&text).with_context(|| format!("{} is not a routing trace", trace.display()))?;
            let fractions: Vec<f64> = budgets
                .split(',')
                .map(|b| b.trim().parse::<f64>().with_context(|| format!("budget {b:?}")))
                .collect::<Result<_>>()?;
            for (f, p) in osprey_bench::replay(&t, &fractions) {
                println!("{}", serde_json::json!({"budget_fraction": f, "policies": p}));
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Chart { out, files }) => {
            for p in osprey_bench::chart::charts(&files, &out).map_err(anyhow::Error::msg)? {
                println!("{}", p.display());
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Report { dir, update }) => {
            let block = osprey_bench::report::render(&dir).map_err(anyhow::Error::msg)?;
            match update {
                None => print!("{block}"),
                Some(doc) => {
                    let text = std::fs::read_to_string(&doc).with_context(|| format!("reading {}", doc.display()))?;
                    let new = osprey_bench::report::splice(&text, &block).map_err(anyhow::Error::msg)?;
                    std::fs::write(&doc, new).with_context(|| format!("writing {}", doc.display()))?;
                }
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Compare { a, b }) => {
            let read = |p: &PathBuf| -> Result<serde_json::Value> {
                let text = std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?;
                serde_json::from_str(&text).with_context(|| format!("{} is not JSON", p.display()))
            };
            print!("{}", osprey_bench::compare(&read(&a)?, &read(&b)?));
            Ok(())
        }
        Command::Bench(BenchCommand::Membw { mib }) => {
            let bw = osprey_bench::measure_read_bandwidth(mib << 20, 5);
            println!("{}", serde_json::json!({ "read_gb_s": bw / 1e9, "mib": mib }));
            Ok(())
        }
        Command::Bench(BenchCommand::Vision { model, sizes, repeats }) => {
            let backend = osprey::open_backend(cli.device.as_deref(), cli.activations.as_deref())?;
            let tower = VisionTower::from_dir(&model, backend)?.context("the model has no vision tower")?;
            let proc = osprey_models::vision::ProcessorConfig::from_dir(&model)?;
            for size in sizes {
                let (w, h) = size.split_once('x').context("sizes are WxH")?;
                let report = bench_vision(&tower, &proc.image, w.parse()?, h.parse()?, repeats)?;
                println!("{}", serde_json::to_string_pretty(&report)?);
            }
            Ok(())
        }
    }
}

/// A bench run's JSON file: the command line, osprey's version, the machine (and the disk's bandwidth
/// when measured) beside the results under `key`.
fn write_run(
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

fn load(dir: &std::path::Path, device: Option<&str>, activations: Option<&str>) -> Result<Model> {
    let t0 = Instant::now();
    let dir = &osprey::hub::resolve(dir)?;
    let backend = osprey::open_backend(device, activations)?;
    let m = osprey_models::load_on(dir, backend).with_context(|| format!("loading {}", dir.display()))?;
    tracing::info!(model = %dir.display(), family = m.info().family, layers = m.info().num_layers, secs = t0.elapsed().as_secs_f64(), "model loaded");
    Ok(m)
}

fn serve(a: ServeArgs, device: Option<String>, activations: Option<String>) -> Result<()> {
    let file = match &a.config {
        Some(p) => osprey::Settings::from_file(p)?,
        None => osprey::Settings::default(),
    };
    let settings = file.overlay(&osprey::Settings { device, activations, ..a.settings() });
    let dir = osprey::model_dir(&settings)?;
    actix_web::rt::System::new().block_on(osprey::serve_until_signal(&settings, &dir))
}
