//! `osprey bench roofline`: the speed model of the CUDA backend (`osprey_bench::roofline`), run on the
//! emulated device and printed per step and per kernel for named cards (docs/cuda.md, "Speed model").

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result};
use osprey_bench::roofline::{self, Priced, RooflineBench, Work};
use osprey_models::backend::AttnShape;

use super::Global;

/// A real model the measured checkpoint stands for: its decoder layers and vocabulary.
const TARGETS: &[(&str, usize, usize)] = &[
    // 30 Gated DeltaNet + 10 attention layers; Qwen3.5's tokenizer.
    ("qwen3.5-35b-a3b", 40, 248_320),
    // 36 + 12 (issue 15); the vocabulary is taken to be Qwen3.5's.
    ("qwen3.8-flash-next", 48, 248_320),
];

/// The command's arguments.
#[derive(clap::Args, Debug)]
pub struct RooflineArgs {
    /// Model directory (the speed checkpoint: `bench synth`).
    #[arg(long)]
    pub model: PathBuf,
    /// Cards to price on (docs/cuda.md's table): rtx-3090, rtx-4090, rtx-5090, l4, a100-80gb, h100-sxm.
    #[arg(long, default_value = "rtx-4090,h100-sxm")]
    pub cards: String,
    /// Also model the real checkpoint this one stands for: qwen3.5-35b-a3b or qwen3.8-flash-next (its layer
    /// count and vocabulary; the head is measured on a copy with no layer).
    #[arg(long)]
    pub scale_to: Option<String>,
    /// Sequences decoding together, one scenario each.
    #[arg(long, default_value = "1,8")]
    pub batches: String,
    /// Measured decode steps per scenario.
    #[arg(long, default_value_t = 2)]
    pub decode_tokens: usize,
    /// Prompt tokens of each decoding sequence.
    #[arg(long, default_value_t = 4)]
    pub prompt: usize,
    /// Tokens of the measured prefill chunk (0: none).
    #[arg(long, default_value_t = 512)]
    pub prefill: usize,
    /// Contexts (tokens) to model one sequence's decode at, f32 and bf16 KV each (e.g. 1024,65536): the
    /// one-sequence step with its attention measured at that context.
    #[arg(long, default_value = "")]
    pub contexts: String,
    /// Writes the measured and priced work as JSON here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Each step's work on `dir`, and the model's vocabulary.
fn measure(dir: &std::path::Path, b: &RooflineBench, g: &Global) -> Result<(Vec<(String, Work)>, usize)> {
    let precision = osprey::precision(g.activations.as_deref())?;
    let backend = osprey_backend_cuda::open_emulated_measuring(24 << 30, precision);
    let model = osprey_models::load_on(dir, backend).with_context(|| format!("loading {}", dir.display()))?;
    let vocab = model.info().vocab_size;
    let mut driver = osprey_runner::Driver::new(model, roofline::PAGE);
    Ok((roofline::measure(&mut driver, b)?, vocab))
}

pub fn run(a: RooflineArgs, g: &Global) -> Result<()> {
    let cards = a
        .cards
        .split(',')
        .map(|c| roofline::card(c.trim()).with_context(|| format!("unknown card {c:?} (docs/cuda.md's table)")))
        .collect::<Result<Vec<_>>>()?;
    let batches =
        a.batches.split(',').map(|b| b.trim().parse().context("--batches")).collect::<Result<Vec<usize>>>()?;
    let contexts = a
        .contexts
        .split(',')
        .filter(|c| !c.trim().is_empty())
        .map(|c| c.trim().parse::<usize>().context("--contexts").map(|c| c.max(a.prompt.max(1) + 2)))
        .collect::<Result<Vec<usize>>>()?;
    let cfg = osprey_models::ModelConfig::from_dir(&a.model).with_context(|| format!("{}", a.model.display()))?.text;
    let attention =
        AttnShape { heads: cfg.num_attention_heads, kv_heads: cfg.num_key_value_heads, head_dim: cfg.head_dim() };
    let b = RooflineBench {
        prompt: a.prompt.max(1),
        decode_tokens: a.decode_tokens.max(1),
        batches,
        prefill: a.prefill,
        contexts,
        attention: Some(attention),
    };
    // The head alone first: it is quick, and a checkpoint it cannot load fails before the long run.
    let head = match &a.scale_to {
        Some(name) => {
            let &(_, layers, vocab) = TARGETS
                .iter()
                .find(|t| t.0 == name)
                .with_context(|| format!("--scale-to {name}: qwen3.5-35b-a3b or qwen3.8-flash-next"))?;
            let tmp = std::env::temp_dir().join(format!("osprey-roofline-head-{}", std::process::id()));
            let (head_dir, measured_layers) = roofline::head_only(&a.model, &tmp)?;
            let head = measure(&head_dir, &b, g);
            let _ = std::fs::remove_dir_all(&tmp);
            Some((name, layers, vocab, measured_layers, head?.0))
        }
        None => None,
    };
    let (mut steps, own_vocab) = measure(&a.model, &b, g)?;
    if let Some((name, layers, vocab, measured_layers, head)) = head {
        let scaled: Vec<(String, Work)> = steps
            .iter()
            .zip(&head)
            .map(|((n, w), (_, h))| {
                (format!("{n}, {name}"), roofline::scale(w, h, measured_layers, layers, (own_vocab, vocab)))
            })
            .collect();
        steps.extend(scaled);
    }
    let priced: Vec<(String, Vec<Priced>)> = steps
        .iter()
        .map(|(n, w)| {
            (
                n.clone(),
                cards.iter().flat_map(|c| [roofline::price(w, c, false), roofline::price(w, c, true)]).collect(),
            )
        })
        .collect();
    print!("{}", tables(&steps, &priced));
    if let Some(out) = &a.out {
        let json = serde_json::json!({ "steps": steps, "priced": priced, "cards": cards });
        std::fs::write(out, serde_json::to_vec_pretty(&json)?).with_context(|| format!("writing {}", out.display()))?;
    }
    Ok(())
}

/// Per step: the modelled time on each card (eager and as a graph) against its roofline; then the
/// step's kernels priced on the first card, eagerly.
fn tables(steps: &[(String, Work)], priced: &[(String, Vec<Priced>)]) -> String {
    let mut s = String::new();
    let ms = |x: f64| x * 1e3;
    for ((name, w), (_, p)) in steps.iter().zip(priced) {
        let launches: f64 = w.kernels.iter().map(|k| k.launches).sum();
        let _ = writeln!(
            s,
            "\n### {name}: {launches:.0} launches, {:.0} host waits, {:.1} MB must move, {:.2} MB over PCIe\n",
            w.host_waits,
            w.must_move / 1e6,
            (w.bytes_to_device + w.bytes_from_device) / 1e6
        );
        let _ = writeln!(
            s,
            "| card | modelled ms (eager) | modelled ms (graph) | roofline ms | of roofline, eager | graph |"
        );
        let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- |");
        for pair in p.chunks(2) {
            let (e, g) = (&pair[0], &pair[1]);
            let _ = writeln!(
                s,
                "| {} | {:.3} | {:.3} | {:.3} | {:.1}% | {:.1}% |",
                e.card,
                ms(e.secs),
                ms(g.secs),
                ms(e.roofline_secs),
                100.0 * e.fraction,
                100.0 * g.fraction
            );
        }
        let first = &p[0];
        let _ = writeln!(s, "\nKernels on {} (eager), slowest first:\n", first.card);
        let _ = writeln!(s, "| kernel | launches | MB | GFLOP | µs | bound |");
        let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- |");
        for k in first.kernels.iter().take(12) {
            let _ = writeln!(
                s,
                "| {} | {:.1} | {:.2} | {:.3} | {:.1} | {} |",
                k.name,
                k.launches,
                k.bytes / 1e6,
                k.flops / 1e9,
                k.secs * 1e6,
                k.bound
            );
        }
    }
    s
}
