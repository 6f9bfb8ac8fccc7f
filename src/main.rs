//! `osprey`: the command line. It only wires crates together; every behaviour lives in a crate.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};
use osprey_bench::{bench_forward, bench_vision, ForwardBench};
use osprey_models::vision::VisionTower;
use osprey_models::Qwen35;

mod run;

#[derive(Parser, Debug)]
#[command(name = "osprey", version, about = "Serve Qwen multimodal MoE models larger than RAM from one home machine")]
struct Cli {
    /// Compute threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Load a model directory, run one prompt (text, images, videos) and print the greedy continuation.
    Run(run::RunArgs),
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
        Command::Run(a) => {
            let m = load(&a.model)?;
            run::run(a, &m)
        }
        Command::Bench(BenchCommand::Forward { model, prompt_len, decode_tokens, repeats }) => {
            let m = load(&model)?;
            let report = bench_forward(&m, ForwardBench { prompt_len, decode_tokens, repeats })?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(())
        }
        Command::Bench(BenchCommand::Membw { mib }) => {
            let bw = osprey_bench::measure_read_bandwidth(mib << 20, 5);
            println!("{}", serde_json::json!({ "read_gb_s": bw / 1e9, "mib": mib }));
            Ok(())
        }
        Command::Bench(BenchCommand::Vision { model, sizes, repeats }) => {
            let tower = VisionTower::from_dir(&model)?.context("the model has no vision tower")?;
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

fn load(dir: &std::path::Path) -> Result<Qwen35> {
    let t0 = Instant::now();
    let m = Qwen35::load(dir).with_context(|| format!("loading {}", dir.display()))?;
    tracing::info!(model = %dir.display(), layers = m.config().num_hidden_layers, secs = t0.elapsed().as_secs_f64(), "model loaded");
    Ok(m)
}
