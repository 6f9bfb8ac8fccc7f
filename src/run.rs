//! `osprey run`: one prompt (text, images, videos) through the whole pipeline, greedy continuation.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use osprey_models::vision::{
    decode_animation, decode_image, rows_in_chunk, DecodeLimits, MediaSpan, ProcessorConfig, VisionTower,
};
use osprey_models::{CausalLm, LogitsWanted, Positions, SeqInput, SeqStep};
use osprey_tokenizer::{prepare_prompt, ChatTemplate, Media, TextTokenizer};

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Hugging Face model directory (config.json, *.safetensors, tokenizer.json, chat template).
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
pub fn run(a: RunArgs, model: &dyn CausalLm) -> Result<()> {
    let tok = TextTokenizer::from_dir(&a.model).ok();
    let limits = DecodeLimits::default();
    let mut media: Vec<Media> = Vec::new();
    for p in &a.image {
        media.push(Media::Image(decode_image(&read(p)?, limits)?));
    }
    for v in &a.video {
        media.push(load_video(v, a.fps, limits)?);
    }
    let (ids, positions, delta, spans) = match (&a.prompt, &a.ids) {
        (None, Some(ids)) if media.is_empty() => (ids.clone(), None, 0, Vec::new()),
        (None, Some(_)) => bail!("--ids cannot carry media; use --prompt"),
        (None, None) => bail!("give --prompt or --ids"),
        (Some(text), _) => {
            let tok = tok.as_ref().context("--prompt needs tokenizer.json in the model directory")?;
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
            let mut spans = Vec::new();
            if !p.media.is_empty() {
                let tower = VisionTower::from_dir(&a.model)?.context("this model has no vision tower")?;
                let h = model.info().hidden_size;
                for item in &p.media {
                    let emb = tower.encode(&item.patches.rows, item.patches.grid)?;
                    let mut at = 0;
                    for &(o, l) in &item.spans {
                        spans.push((o, emb[at * h..(at + l) * h].to_vec()));
                        at += l;
                    }
                }
            }
            (p.input_ids, Some(p.positions), p.rope_delta, spans)
        }
    };
    if ids.is_empty() {
        bail!("the prompt is empty");
    }
    let eos: Vec<u32> = model.info().eos_token_ids.clone();
    let media_spans: Vec<MediaSpan<'_>> = spans.iter().map(|(o, r)| MediaSpan { offset: *o, rows: r }).collect();
    let mut st = model.new_state();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let chunk = a.chunk.max(1);
    let mut start = 0;
    while start < ids.len() {
        let end = (start + chunk).min(ids.len());
        let inj = rows_in_chunk(&media_spans, start, end, model.info().hidden_size);
        let input = SeqInput {
            tokens: &ids[start..end],
            positions: positions.as_ref().map_or(Positions::Text, |p| Positions::Explicit(&p[start..end])),
            injected: &inj,
            logits: if end == ids.len() { LogitsWanted::Last } else { LogitsWanted::None },
        };
        logits = model.forward(&mut [SeqStep { state: &mut st, input }], false)?.logits.remove(0);
        start = end;
    }
    st.rope_delta = delta;
    let ttft = t0.elapsed();
    let mut out = Vec::new();
    for _ in 0..a.max_tokens {
        let next = logits.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map(|(i, _)| i as u32).unwrap_or(0);
        out.push(next);
        if eos.contains(&next) {
            break;
        }
        let input = SeqInput::text(std::slice::from_ref(&next));
        logits = model.forward(&mut [SeqStep { state: &mut st, input }], false)?.logits.remove(0);
    }
    println!("prompt tokens: {}", ids.len());
    println!("generated ids: {out:?}");
    if let Some(t) = &tok {
        println!("generated text: {:?}", t.decode(&out, false)?);
    }
    eprintln!("ttft {:.3}s, {} tokens in {:.3}s", ttft.as_secs_f64(), out.len(), t0.elapsed().as_secs_f64());
    Ok(())
}
