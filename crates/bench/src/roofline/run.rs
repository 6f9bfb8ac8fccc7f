//! The steps `bench roofline` measures on a metering emulated device: decode at each batch size (a
//! short prompt per sequence, each in its own step; one unmeasured decode step so the buffer cache has
//! seen the shapes; then the measured steps, averaged) and one prefill chunk; and the head-only copy of
//! a checkpoint that separates the head's cost from the layers'. Decode at a long context is the
//! measured one-sequence step with its attention layers' work at a short context swapped for their work
//! at the long one, measured alone on a pool that holds that many positions: prefilling 64k tokens on the
//! emulated device would take hours, and the rest of a decode step does not depend on the context.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use osprey_models::backend::{AttnShape, BackendRef, DType, HostData, PagedRows, PagedView};
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_runner::{Driver, NoMedia, Work as Item};

use super::Work;
use crate::{bench_prompt, greedy, Error, Result};

/// What to measure.
#[derive(Clone, Debug)]
pub struct RooflineBench {
    /// Prompt tokens of each decoding sequence.
    pub prompt: usize,
    /// Measured decode steps per batch size.
    pub decode_tokens: usize,
    /// Sequences decoding together, one scenario each.
    pub batches: Vec<usize>,
    /// Tokens of the measured prefill chunk (0: none).
    pub prefill: usize,
    /// Contexts to model one sequence's decode at (the `decode x1` scenario with its attention at each),
    /// with the model's attention shape (from its config).
    pub contexts: Vec<usize>,
    /// The model's attention: query heads, KV heads, head width.
    pub attention: Option<AttnShape>,
}

/// Slots per KV page of the driver (`Driver::new(model, PAGE)` in the command) and of the pools below.
pub const PAGE: usize = 16;

/// The work of one decode row's causal attention over `keys` positions, alone on `backend`: a `dtype`
/// pool holding them (zeros: the meter counts bytes, not values), its page table, the op, and a
/// download that ends the window (the same download at every context, so it cancels in a difference).
fn attention_at(backend: &BackendRef, shape: AttnShape, dtype: DType, keys: usize) -> Result<Work> {
    let dev = |e: osprey_models::backend::BackendError| Error::Model(e.into());
    let (pages, kv_row, q_cols) = (keys.div_ceil(PAGE), shape.kv_heads * shape.head_dim, shape.heads * shape.head_dim);
    let pool = backend.zeros(dtype, &[pages * 2 * PAGE, kv_row]).map_err(dev)?;
    let ids: Vec<i32> = (0..pages).map(|p| p as i32).collect();
    let table = backend.upload(HostData::I32(&ids), &[pages]).map_err(dev)?;
    let q = backend.upload_f32(&vec![0.01; q_cols], &[1, q_cols]).map_err(dev)?;
    let mut out = backend.zeros_f32(&[1, q_cols]).map_err(dev)?;
    backend.download_f32(&out).map_err(dev)?;
    let before = backend.stats();
    let kv = PagedView { pool: &pool, table: &table, page_size: PAGE };
    let scale = (shape.head_dim as f32).powf(-0.5);
    backend.attention_paged_rows(&q, &[PagedRows { rows: 0..1, kv, past: keys - 1 }], shape, scale, &mut out);
    backend.download_f32(&out).map_err(dev)?;
    backend.health().map_err(dev)?;
    Ok(Work::between(&before, &backend.stats(), 1))
}

/// One step of `items` through the driver; an item's failure fails the measurement.
fn step(driver: &mut Driver, items: &[Item]) -> Result<()> {
    for (_, r) in driver.step(items, &mut NoMedia) {
        r?;
    }
    Ok(())
}

fn item(seq: u64, start: usize, end: usize) -> Item {
    Item { seq, admit: None, start, end, sample: true, snapshot: false, budget: 1 << 20, span: tracing::Span::none() }
}

/// Each scenario's work: `decode xN` per step and `prefill N` for the chunk.
pub fn measure(driver: &mut Driver, b: &RooflineBench) -> Result<Vec<(String, Work)>> {
    let vocab = driver.model().info().vocab_size;
    let backend = driver.model().backend().clone();
    let mut out = Vec::new();
    for &n in &b.batches {
        let seqs: Vec<u64> = (1..=n as u64).collect();
        for &s in &seqs {
            // Different prompts, so the sequences route to different experts as real ones would.
            let ids = bench_prompt(b.prompt + s as usize, vocab)[s as usize..].to_vec();
            driver.admit(s, Arc::new(PreparedPrompt::text(ids)), greedy(), None, &[])?;
        }
        // Each prompt in its own step: prefill is not what this scenario measures, and the prompts of
        // eight sequences in one step would take the tensor-core GEMM, whose emulated `mma.sync` twins
        // ran for over an hour; a step of one short prompt stays on the decode-shaped kernels.
        for &s in &seqs {
            step(driver, &[item(s, 0, b.prompt)])?;
        }
        let decode =
            |i: usize| -> Vec<Item> { seqs.iter().map(|&s| item(s, b.prompt + i, b.prompt + i + 1)).collect() };
        step(driver, &decode(0))?;
        let before = backend.stats();
        for i in 1..=b.decode_tokens {
            step(driver, &decode(i))?;
        }
        out.push((format!("decode x{n}"), Work::between(&before, &backend.stats(), b.decode_tokens)));
        tracing::info!(batch = n, "roofline: decode measured");
        seqs.iter().for_each(|&s| driver.release(s));
    }
    if let (false, Some(shape)) = (b.contexts.is_empty(), b.attention) {
        let base = out.iter().find(|(n, _)| n == "decode x1").map(|(_, w)| w.clone());
        let base =
            base.ok_or_else(|| Error::Input("--contexts models the `decode x1` scenario: --batches 1".into()))?;
        // Attention layers: the step's attention launches (one a layer, whatever its splits).
        let layers = base.kernels.iter().find(|k| k.name == "attention_flash").map_or(0.0, |k| k.launches);
        let short = attention_at(&backend, shape, DType::F32, b.prompt + 1 + b.decode_tokens.div_ceil(2))?;
        for &keys in &b.contexts {
            for (dtype, name) in [(DType::F32, "f32"), (DType::BF16, "bf16")] {
                let long = if layers > 0.0 { attention_at(&backend, shape, dtype, keys)? } else { Work::default() };
                let w = base.plus(&short, -layers).plus(&long, layers);
                out.push((format!("decode x1 at {keys}, {name} KV"), w));
            }
            tracing::info!(keys, "roofline: decode at a context modelled");
        }
    }
    if b.prefill > 0 {
        let seq = 1 << 40;
        driver.admit(seq, Arc::new(PreparedPrompt::text(bench_prompt(b.prefill, vocab))), greedy(), None, &[])?;
        let before = backend.stats();
        step(driver, &[item(seq, 0, b.prefill)])?;
        out.push((format!("prefill {}", b.prefill), Work::between(&before, &backend.stats(), 1)));
        tracing::info!(tokens = b.prefill, "roofline: prefill measured");
        driver.release(seq);
    }
    Ok(out)
}

/// A copy of checkpoint `dir` under `at` with no decoder layer: its config with `num_hidden_layers` 0
/// (and an empty `layer_types`), its other files linked. Returns the copy and the layers of the original.
pub fn head_only(dir: &Path, at: &Path) -> Result<(PathBuf, usize)> {
    // The links must name the files wherever the copy is (a relative `--model` made them dangle).
    let dir = &dir.canonicalize().map_err(Error::io(dir))?;
    let bad = |what: String| Error::Input(format!("{}: {what}", dir.display()));
    std::fs::create_dir_all(at).map_err(Error::io(at))?;
    let cfg_path = dir.join("config.json");
    let text = std::fs::read_to_string(&cfg_path).map_err(Error::io(&cfg_path))?;
    let mut cfg: serde_json::Value = serde_json::from_str(&text).map_err(|e| bad(format!("config.json: {e}")))?;
    let text_cfg = if cfg.get("text_config").is_some() { &mut cfg["text_config"] } else { &mut cfg };
    let layers = text_cfg["num_hidden_layers"].as_u64().ok_or_else(|| bad("no num_hidden_layers".into()))? as usize;
    text_cfg["num_hidden_layers"] = 0.into();
    // Per-layer lists name no layer now (`qwen4_exp`'s PLE layers).
    for key in ["layer_types", "ple_layer_ids"] {
        if text_cfg.get(key).is_some() {
            text_cfg[key] = serde_json::json!([]);
        }
    }
    for e in std::fs::read_dir(dir).map_err(Error::io(dir))? {
        let e = e.map_err(Error::io(dir))?;
        let link = at.join(e.file_name());
        if e.file_name() == "config.json" || link.exists() {
            continue;
        }
        std::os::unix::fs::symlink(e.path(), &link).map_err(Error::io(&link))?;
    }
    let out = at.join("config.json");
    std::fs::write(&out, serde_json::to_vec_pretty(&cfg).map_err(|e| bad(e.to_string()))?).map_err(Error::io(&out))?;
    Ok((at.to_path_buf(), layers))
}
