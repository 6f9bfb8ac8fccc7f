//! `osprey`: the command line. It only wires crates together; every behaviour lives in a crate.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use osprey_bench::{bench_forward, ForwardBench};
use osprey_models::{LogitsWanted, Qwen35, SeqInput, SeqStep};
use osprey_tokenizer::TextTokenizer;

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
    /// Load a model directory, run one prompt and print the greedy continuation.
    Run(RunArgs),
    /// Measure the runtime.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Args, Debug)]
struct RunArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json).
    #[arg(long)]
    model: PathBuf,
    /// Prompt text, tokenized as is (write special tokens literally, e.g. `<|im_start|>user\n...`).
    #[arg(long, conflicts_with = "ids")]
    prompt: Option<String>,
    /// Prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    ids: Option<Vec<u32>>,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    max_tokens: usize,
    /// Prefill chunk size (tokens per forward).
    #[arg(long, default_value_t = 512)]
    chunk: usize,
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
        Command::Run(a) => run(a),
        Command::Bench(BenchCommand::Forward { model, prompt_len, decode_tokens, repeats }) => {
            let m = load(&model)?;
            let report = bench_forward(&m, ForwardBench { prompt_len, decode_tokens, repeats })?;
            println!("{}", serde_json::to_string_pretty(&report)?);
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

fn run(a: RunArgs) -> Result<()> {
    let model = load(&a.model)?;
    let tok = TextTokenizer::from_dir(&a.model).ok();
    let ids = match (&a.prompt, &a.ids) {
        (Some(p), _) => tok.as_ref().context("--prompt needs tokenizer.json in the model directory")?.encode(p)?,
        (None, Some(ids)) => ids.clone(),
        (None, None) => bail!("give --prompt or --ids"),
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let eos: Vec<u32> = model.config().eos_token_id.as_ref().map(|e| e.to_vec()).unwrap_or_default();
    let mut st = model.new_state();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for (i, chunk) in ids.chunks(a.chunk.max(1)).enumerate() {
        let last = (i + 1) * a.chunk.max(1) >= ids.len();
        let input =
            SeqInput { logits: if last { LogitsWanted::Last } else { LogitsWanted::None }, ..SeqInput::text(chunk) };
        logits = model.forward(&mut [SeqStep { state: &mut st, input }], false)?.logits.remove(0);
    }
    let ttft = t0.elapsed();
    let mut out = Vec::new();
    for _ in 0..a.max_tokens {
        let next = logits.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map(|(i, _)| i as u32).unwrap_or(0);
        out.push(next);
        if eos.contains(&next) {
            break;
        }
        logits =
            model.forward(&mut [SeqStep { state: &mut st, input: SeqInput::text(&[next]) }], false)?.logits.remove(0);
    }
    let total = t0.elapsed();
    println!("prompt tokens: {}", ids.len());
    println!("generated ids: {out:?}");
    if let Some(t) = &tok {
        println!("generated text: {:?}", t.decode(&out, false)?);
    }
    eprintln!("ttft {:.3}s, {} tokens in {:.3}s", ttft.as_secs_f64(), out.len(), total.as_secs_f64());
    Ok(())
}
