//! `osprey`: the command line. It only parses and dispatches (`commands/`: one module per command); every
//! behaviour lives in a crate.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand};

mod commands;

use commands::bench::BenchCommand;
use commands::serve::ServeArgs;
use commands::Global;

#[derive(Parser, Debug)]
#[command(name = "osprey", version, about = "Serve Qwen multimodal MoE models larger than RAM from one home machine")]
struct Cli {
    /// Compute threads (default: all cores).
    #[arg(long, global = true)]
    threads: Option<usize>,
    /// Compute device: cpu (default); cuda:N (a build with --features cuda); cuda-emu (the CUDA kernels
    /// on the CPU, a test device). `serve` also reads it from the settings file.
    #[arg(long, global = true)]
    device: Option<String>,
    /// Activations of the matmuls: int8 (the fast default: int8 for NVFP4 matmuls, bf16 for bf16
    /// matmuls on CPUs with AVX512-BF16; a small documented drift) or f32 (exact).
    #[arg(long, global = true)]
    activations: Option<String>,
    /// The prefill GEMM at the fast precision: auto (default: per weight class and band of rows, the
    /// fastest kernel this CPU has, measured at start-up and cached per CPU model), amx, amx-int8, int8,
    /// bf16 or f32 (the best it may use). For measuring one kernel against another, or forcing a fallback.
    #[arg(long, global = true)]
    gemm: Option<String>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Serve the OpenAI-compatible API (default: the embedded model on 127.0.0.1:8080).
    Serve(Box<ServeArgs>),
    /// Load a model directory, run one prompt (text, images, videos) and print the greedy continuation.
    Run(commands::run::RunArgs),
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

fn main() -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Some(t) = cli.threads {
        rayon::ThreadPoolBuilder::new().num_threads(t).build_global().context("thread pool")?;
    }
    match cli.gemm.as_deref() {
        // `auto` (the default): the prefill GEMMs measured on this CPU, for the commands that run a model.
        None | Some("auto") => {
            let runs_a_model = match &cli.command {
                Command::Serve(_) | Command::Run(_) => true,
                Command::Bench(b) => b.runs_a_model(),
                _ => false,
            };
            if runs_a_model {
                osprey::gemm_calibration::auto();
            }
        }
        Some(g) => osprey_kernels::set_gemm_ceiling(g.parse().map_err(|e: String| anyhow::anyhow!("--gemm {e}"))?),
    }
    let g = Global { threads: cli.threads, device: cli.device, activations: cli.activations, gemm: cli.gemm };
    match cli.command {
        Command::Serve(a) => commands::serve::run(*a, &g),
        Command::Run(a) => commands::run_one(a, &g),
        Command::Quantize { model, out, all_linear, lm_head } => commands::quantize(&model, &out, all_linear, lm_head),
        Command::Pull { id } => commands::pull(&id),
        Command::Bench(b) => commands::bench::run(b, &g),
    }
}
