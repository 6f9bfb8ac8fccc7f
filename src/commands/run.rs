//! `osprey run`: one prompt (text, images, videos) through the whole pipeline, greedy continuation.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::Args;
use osprey_models::vision::{decode_animation, decode_image, DecodeLimits, ProcessorConfig, VisionTower};
use osprey_models::Model;
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::{PreparedMedia, PreparedPrompt};
use osprey_protocol::{ErrorCode, RequestError};
use osprey_runner::{Driver, GenerateOptions, RowSource};
use osprey_tokenizer::{prepare_prompt, ChatTemplate, Media, TextTokenizer};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json, chat template), or a
    /// Hugging Face id (`org/name[@revision]`) in the local HF cache.
    #[arg(long)]
    pub model: PathBuf,
    /// The user's message (rendered with the model's chat template unless --raw).
    #[arg(long, conflicts_with = "ids")]
    pub prompt: Option<String>,
    /// Use --prompt as the exact model input (write special tokens and media placeholders yourself).
    #[arg(long)]
    pub raw: bool,
    /// Prompt as comma-separated token ids (text only).
    #[arg(long, value_delimiter = ',')]
    pub ids: Option<Vec<u32>>,
    /// Image files (PNG, JPEG, WebP, GIF, BMP), placed before the text in the user message.
    #[arg(long)]
    pub image: Vec<PathBuf>,
    /// Videos: an animated GIF/WebP, or a comma-separated list of frame images (see --fps).
    #[arg(long)]
    pub video: Vec<String>,
    /// Frame rate of videos given as frame lists (animated files carry their own).
    #[arg(long, default_value_t = 2.0)]
    pub fps: f64,
    /// Render the template with enable_thinking=false.
    #[arg(long)]
    pub no_think: bool,
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Prefill chunk size (tokens per forward).
    #[arg(long, default_value_t = 512)]
    pub chunk: usize,
    /// Draft tokens per decode step from the checkpoint's MTP head (speculative decoding; 0: off, at
    /// most 4). Greedy answers are the same tokens either way.
    #[arg(long, default_value_t = 0)]
    pub speculative_tokens: usize,
}

fn read(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

fn load_video(spec: &str, fps: f64, limits: DecodeLimits) -> Result<Media> {
    if spec.contains(',') {
        let frames =
            spec.split(',').map(|p| Ok(decode_image(&read(Path::new(p))?, limits)?)).collect::<Result<Vec<_>>>()?;
        return Ok(Media::Video { frames, fps });
    }
    let anim = decode_animation(&read(Path::new(spec))?, limits)?;
    // transformers assumes 24 fps when a video carries no timing.
    Ok(Media::Video { frames: anim.frames, fps: anim.fps.unwrap_or(24.0) })
}

/// Runs the command.
pub fn run(a: RunArgs, model: Model, backend: osprey_models::backend::BackendRef) -> Result<()> {
    // Kept as a result: `--ids` runs without a tokenizer, and `--prompt` says why it could not load.
    let tok = TextTokenizer::from_dir(&a.model);
    let limits = DecodeLimits::default();
    let mut media: Vec<Media> = Vec::new();
    for p in &a.image {
        media.push(Media::Image(decode_image(&read(p)?, limits)?));
    }
    for v in &a.video {
        media.push(load_video(v, a.fps, limits)?);
    }
    let prompt = match (&a.prompt, &a.ids) {
        (None, Some(ids)) if media.is_empty() => PreparedPrompt::text(ids.clone()),
        (None, Some(_)) => bail!("--ids cannot carry media; use --prompt"),
        (None, None) => bail!("give --prompt or --ids"),
        (Some(text), _) => {
            let tok = tok.as_ref().map_err(|e| anyhow::anyhow!("--prompt needs the model's tokenizer: {e}"))?;
            let prompt = if a.raw {
                text.clone()
            } else {
                let tmpl = ChatTemplate::from_dir(&a.model)?;
                let mut content: Vec<serde_json::Value> = media
                    .iter()
                    .map(|m| serde_json::json!({"type": if matches!(m, Media::Image(_)) { "image" } else { "video" }}))
                    .collect();
                content.push(serde_json::json!({"type": "text", "text": text}));
                let mut kw = serde_json::Map::new();
                if a.no_think {
                    kw.insert("enable_thinking".into(), false.into());
                }
                tmpl.render(&serde_json::json!([{"role": "user", "content": content}]), true, &kw)?
            };
            let proc = ProcessorConfig::from_dir(&a.model)?;
            let p = prepare_prompt(tok, &proc, &prompt, &media)?;
            let media = p.media.into_iter().map(|item| item.into_media([0; 16])).collect();
            let text = PreparedPrompt::text(p.input_ids);
            PreparedPrompt { positions: Some(p.positions), rope_delta: p.rope_delta, media, ..text }
        }
    };
    if prompt.input_ids.is_empty() {
        bail!("the prompt is empty");
    }
    let tower = if prompt.media.is_empty() {
        None
    } else {
        Some(VisionTower::from_dir(&a.model, backend)?.context("this model has no vision tower")?)
    };
    let n_prompt = prompt.input_ids.len();
    let opts = GenerateOptions {
        chunk: a.chunk.max(1),
        max_tokens: a.max_tokens.max(1),
        stop_token_ids: model.info().eos_token_ids.clone(),
    };
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let mut driver = Driver::new(model, 16).with_speculative(a.speculative_tokens)?;
    let out = driver.generate(Arc::new(prompt), greedy, &opts, &mut TowerRows(tower.as_ref()))?;
    println!("prompt tokens: {n_prompt}");
    println!("generated ids: {:?}", out.tokens);
    if let Ok(t) = &tok {
        println!("generated text: {:?}", t.decode(&out.tokens, false)?);
    }
    eprintln!(
        "ttft {:.3}s, {} tokens in {:.3}s",
        out.prefill_secs,
        out.tokens.len(),
        out.prefill_secs + out.decode_secs
    );
    if a.speculative_tokens > 0 {
        let c = driver.spec_counters();
        eprintln!(
            "speculative: {} drafted, {} accepted ({:.1}%, per position {:?}), {:.2} tokens per verification",
            c.drafted,
            c.accepted,
            100.0 * c.acceptance(),
            c.accepted_at,
            c.tokens_per_forward()
        );
    }
    Ok(())
}

/// Media rows encoded in-process by the vision tower, on first need (as the vision actor would).
struct TowerRows<'a>(Option<&'a VisionTower>);

impl RowSource for TowerRows<'_> {
    fn rows(&mut self, m: &PreparedMedia) -> Result<Arc<Vec<f32>>, RequestError> {
        let tower = self.0.ok_or_else(|| RequestError::new(ErrorCode::VisionUnsupported, "no vision tower"))?;
        let p = m.patches.get()?;
        let rows =
            tower.encode(&p.rows, p.grid).map_err(|e| RequestError::new(ErrorCode::EngineError, e.to_string()))?;
        Ok(Arc::new(rows))
    }
}
