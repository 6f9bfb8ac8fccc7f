//! The tokenizer actor: a thread owning the tokenizer, chat template and processor config.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::thread;
use std::time::Instant;

use osprey_models::vision::{declared_size, decode_animation, decode_image, DecodeLimits, ProcessorConfig};
use osprey_protocol::constraint::{Constraint, Grammar};
use osprey_protocol::tokenizer::{
    ChatPrompt, CompletionPrompt, DecodeState, MediaInput, MediaLimits, PreparedMedia, PreparedPrompt, TokenizerCommand,
};
use osprey_protocol::vision::MakePixels;
use osprey_protocol::{ErrorCode, MediaHash, RequestError};
use tokio::sync::{mpsc, oneshot};

use crate::grammar::{CompileError, GrammarCompiler};
use crate::prepare::preprocess_item;
use crate::preprocessed::{Preprocessed, PREPROCESSED_BYTES, SHAPES};
use crate::{prepare_prompt, ChatTemplate, Media, TextTokenizer};

/// Everything the actor owns.
#[derive(Debug)]
pub struct TokenizerCore {
    tok: TextTokenizer,
    template: Option<ChatTemplate>,
    processor: Arc<ProcessorConfig>,
    vision: bool,
    /// `tokenizer.json`, for the grammar compiler.
    tokenizer_json: PathBuf,
    /// The model's vocabulary size and end-of-answer tokens (for grammars).
    grammar_vocab: (usize, Vec<u32>),
    /// Built on the first constrained request (a trie of the whole vocabulary).
    grammar: OnceLock<Result<GrammarCompiler, crate::Error>>,
    /// Media preprocessed lately, by content hash.
    preprocessed: std::sync::Mutex<Preprocessed>,
}

fn media_error(e: osprey_models::Error) -> RequestError {
    match e {
        osprey_models::Error::MediaLimit(m) => RequestError::new(ErrorCode::MediaTooLarge, m),
        other => RequestError::new(ErrorCode::InvalidMedia, other.to_string()),
    }
}

/// A media item's content hash: BLAKE3 of its length-prefixed parts, the first 128 bits. Every turn of a
/// conversation hashes every image it resends (15 MB of them by turn 52 of the long-images run), so the
/// hash's speed is part of each turn's TTFT: BLAKE3 runs at several GB/s on AVX2 where blake2b ran at ~1.
fn hash(parts: &[&[u8]]) -> MediaHash {
    let mut h = blake3::Hasher::new();
    for p in parts {
        h.update(&(p.len() as u64).to_le_bytes());
        h.update(p);
    }
    let mut out = [0u8; 16];
    out.copy_from_slice(&h.finalize().as_bytes()[..16]);
    out
}

/// What is left of a request's decoded-pixel budget ([`MediaLimits::max_total_pixels`]): every image and
/// frame is charged by the size its header declares before anything is decoded ([`check_declared`]);
/// an animation by its frames as decoded, from what is left.
struct PixelBudget {
    left: u64,
    total: u64,
}

impl PixelBudget {
    fn take(&mut self, pixels: u64) -> Result<(), RequestError> {
        if pixels > self.left {
            return Err(RequestError::new(
                ErrorCode::MediaTooLarge,
                format!(
                    "the request's images and video frames declare more than {} Mpx in total (the limit per request)",
                    self.total / 1_000_000
                ),
            ));
        }
        self.left -= pixels;
        Ok(())
    }

    fn take_image(&mut self, bytes: &[u8]) -> Result<(), RequestError> {
        let (w, h) = declared_size(bytes).map_err(media_error)?;
        self.take(u64::from(w) * u64::from(h))
    }
}

/// Every item's declared size read and checked before any is decoded: the request's pixel budget over
/// all images and frames, and the soft tokens its images would take against the context (three 64 Mpx
/// images were decoded for 4.5 s before the context refused them). A header that cannot be read is the
/// item's error, as decoding it would be. Returns the budget left for animations.
fn check_declared(
    media: &[MediaInput],
    limits: MediaLimits,
    proc: &ProcessorConfig,
) -> Result<PixelBudget, RequestError> {
    let mut budget = PixelBudget { left: limits.max_total_pixels, total: limits.max_total_pixels };
    let mut tokens = 0usize;
    let per_group = proc.image.merge_size * proc.image.merge_size * proc.image.patch_size * proc.image.patch_size;
    for (i, m) in media.iter().enumerate() {
        let at = |e: RequestError| e.with_param(format!("media[{i}]"));
        match m {
            MediaInput::Image { bytes } => {
                let (w, h) = declared_size(bytes).map_err(media_error).map_err(at)?;
                budget.take(u64::from(w) * u64::from(h)).map_err(at)?;
                let (th, tw) = osprey_models::vision::image_target_size(&proc.image, h as usize, w as usize)
                    .map_err(media_error)
                    .map_err(at)?;
                tokens = tokens.saturating_add(th * tw / per_group.max(1));
            }
            MediaInput::VideoFrames { frames, .. } => {
                for f in frames {
                    budget.take_image(f).map_err(at)?;
                }
            }
            MediaInput::VideoFile { .. } => {}
        }
        if tokens > limits.max_media_tokens {
            return Err(at(RequestError::new(
                ErrorCode::ContextLengthExceeded,
                format!(
                    "the images up to this one take {tokens} tokens at their declared sizes, more than the context of {} \
                     (send them smaller)",
                    limits.max_media_tokens
                ),
            )));
        }
    }
    Ok(budget)
}

/// Fails once `deadline` has passed (checked between the steps of a preparation).
fn check_deadline(deadline: Option<Instant>) -> Result<(), RequestError> {
    match deadline {
        Some(d) if Instant::now() >= d => Err(RequestError::new(
            ErrorCode::DeadlineExceeded,
            "the request's deadline passed while its prompt was being prepared",
        )
        .with_param("deadline_secs")),
        _ => Ok(()),
    }
}

fn decode(
    m: &MediaInput,
    limits: MediaLimits,
    budget: &mut PixelBudget,
    deadline: Option<Instant>,
) -> Result<Media, RequestError> {
    let lim = DecodeLimits { max_pixels: limits.max_pixels, max_frames: limits.max_frames };
    match m {
        // Images and frames were charged by [`check_declared`].
        MediaInput::Image { bytes } => Ok(Media::Image(decode_image(bytes, lim).map_err(media_error)?)),
        MediaInput::VideoFrames { frames, fps } => {
            if frames.len() > limits.max_frames {
                return Err(RequestError::new(
                    ErrorCode::MediaTooLarge,
                    format!("the video has {} frames, more than the limit of {}", frames.len(), limits.max_frames),
                ));
            }
            let decoded = frames
                .iter()
                .map(|f| {
                    check_deadline(deadline)?;
                    decode_image(f, lim).map_err(media_error)
                })
                .collect::<Result<Vec<_>, _>>()?;
            Ok(Media::Video { frames: decoded, fps: fps.unwrap_or(24.0) })
        }
        MediaInput::VideoFile { bytes } => {
            // Every frame of an animation has the declared size: no more frames than the budget holds.
            let (w, h) = declared_size(bytes).map_err(media_error)?;
            let per_frame = (u64::from(w) * u64::from(h)).max(1);
            let fit = usize::try_from(budget.left / per_frame).unwrap_or(usize::MAX);
            let lim = DecodeLimits { max_frames: lim.max_frames.min(fit.max(1)), ..lim };
            let f = decode_animation(bytes, lim).map_err(media_error)?;
            budget.take(per_frame * f.frames.len() as u64)?;
            Ok(Media::Video { frames: f.frames, fps: f.fps.unwrap_or(24.0) })
        }
    }
}

/// Item `i` of `inputs` decoded and preprocessed again under this request's limits (the same bytes
/// decoded when they were first sent; its declared pixels were charged to this request). The closure
/// holds the request's media bytes until its last [`PreparedMedia`] goes: at most a request body.
fn remake(inputs: Arc<Vec<MediaInput>>, i: usize, limits: MediaLimits, proc: Arc<ProcessorConfig>) -> MakePixels {
    Box::new(move || {
        let mut budget = PixelBudget { left: limits.max_total_pixels, total: limits.max_total_pixels };
        let media = decode(&inputs[i], limits, &mut budget, None)?;
        preprocess_item(&media, &proc).map_err(prepare_error)?.patches.get()
    })
}

fn prepare_error(e: crate::Error) -> RequestError {
    match e {
        crate::Error::Model(m) => media_error(m),
        other => RequestError::new(ErrorCode::InvalidRequest, other.to_string()),
    }
}

/// An item's content hash (the vision cache's and [`Preprocessed`]'s key): its kind and bytes, and a
/// video's frame rate.
fn media_hash(m: &MediaInput) -> MediaHash {
    match m {
        MediaInput::Image { bytes } => hash(&[b"image", bytes]),
        MediaInput::VideoFrames { frames, fps } => {
            let fps_bytes = fps.unwrap_or(24.0).to_le_bytes();
            let mut parts: Vec<&[u8]> = vec![b"frames", &fps_bytes];
            parts.extend(frames.iter().map(Vec::as_slice));
            hash(&parts)
        }
        MediaInput::VideoFile { bytes } => hash(&[b"video", bytes]),
    }
}

/// Prefix-cache keys: token ids, except that every placeholder of a media item gets
/// `2^62 | (hash + offset)` (offset counted over the item's spans), above any vocabulary, distinct per
/// position, equal for equal bytes wherever the item appears.
pub fn cache_ids(ids: &[u32], media: &[PreparedMedia]) -> Vec<u64> {
    const MEDIA_BIT: u64 = 1 << 62;
    let mut out: Vec<u64> = ids.iter().map(|&t| t as u64).collect();
    for m in media {
        let base = u64::from_le_bytes(m.hash[..8].try_into().expect("8 bytes"));
        let mut off = 0u64;
        for &(o, l) in &m.spans {
            for j in 0..l {
                out[o + j] = MEDIA_BIT | (base.wrapping_add(off) & (MEDIA_BIT - 1));
                off += 1;
            }
        }
    }
    out
}

impl TokenizerCore {
    /// Loads the tokenizer, chat template (optional) and processor config of a model directory.
    pub fn from_dir(dir: &Path, vision: bool) -> crate::Result<Self> {
        Ok(TokenizerCore {
            tok: TextTokenizer::from_dir(dir)?,
            template: ChatTemplate::from_dir(dir).ok(),
            processor: Arc::new(ProcessorConfig::from_dir(dir)?),
            vision,
            tokenizer_json: dir.join("tokenizer.json"),
            grammar_vocab: (0, Vec::new()),
            grammar: OnceLock::new(),
            preprocessed: std::sync::Mutex::new(Preprocessed::new(PREPROCESSED_BYTES, SHAPES)),
        })
    }

    /// Sets the model's logit count and end-of-answer tokens, which grammars need.
    pub fn with_grammar_vocab(mut self, vocab: usize, eos: Vec<u32>) -> Self {
        self.grammar_vocab = (vocab, eos);
        self
    }

    /// Compiles a grammar against this vocabulary.
    pub fn compile(&self, g: &Grammar) -> Result<Constraint, RequestError> {
        self.compile_until(g, &[], None, &|| false)
    }

    /// [`TokenizerCore::compile`] that stops when the request is cancelled (`cancelled()`) or past its
    /// deadline: a grammar's work ends with its request (`GrammarCompiler::compile_until`).
    pub fn compile_until(
        &self,
        g: &Grammar,
        prefix: &[u32],
        deadline: Option<Instant>,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<Constraint, RequestError> {
        let compiler = self.grammar.get_or_init(|| {
            let load = |reason: String| crate::Error::Load { path: self.tokenizer_json.clone(), reason };
            let text =
                osprey_models::files::read_small(&self.tokenizer_json, osprey_models::files::MAX_TOKENIZER_BYTES)
                    .map_err(|e| load(e.to_string()))?;
            let tok = tokenizers::Tokenizer::from_bytes(text.as_bytes()).map_err(|e| load(e.to_string()))?;
            let (vocab, eos) = &self.grammar_vocab;
            let eos = if eos.is_empty() { self.tok.token_id("<|im_end|>").into_iter().collect() } else { eos.clone() };
            GrammarCompiler::new(&text, tok, (*vocab).max(self.tok.vocab_size()), &eos)
        });
        let compiler = compiler.as_ref().map_err(|e| {
            RequestError::new(ErrorCode::EngineError, format!("constrained decoding is unavailable: {e}"))
        })?;
        let stop = || cancelled() || deadline.is_some_and(|d| Instant::now() >= d);
        compiler.compile_until(g, prefix, &stop).map_err(|e| match e {
            CompileError::Refused(e) => {
                tracing::debug!(error = %e, "grammar refused");
                RequestError::new(
                    ErrorCode::InvalidSchema,
                    format!("the output format cannot be enforced: {}", public_reason(&e)),
                )
                // The parameter that carried it: a schema came as `response_format` (or its kin), a call
                // grammar from `tools`.
                .with_param(match g {
                    Grammar::JsonSchema(_) => "response_format",
                    Grammar::Lark(_) => "tools",
                })
            }
            CompileError::Prefill => RequestError::new(
                ErrorCode::InvalidRequest,
                "the final assistant message, which the answer continues, does not fit the output format",
            )
            .with_param("messages"),
            CompileError::Stopped => check_deadline(deadline).err().unwrap_or_else(|| {
                RequestError::new(ErrorCode::RequestTimeout, "the request was cancelled while its grammar was compiled")
            }),
        })
    }

    /// `v` with the special tokens its strings spell marked as text (`TextTokenizer::mark_literal`);
    /// object keys, roles and part types are the template's and stay as they are.
    fn literal_strings(&self, v: serde_json::Value) -> serde_json::Value {
        use serde_json::Value;
        match v {
            Value::String(s) => match self.tok.mark_literal(&s) {
                std::borrow::Cow::Borrowed(_) => Value::String(s),
                std::borrow::Cow::Owned(o) => Value::String(o),
            },
            Value::Array(a) => Value::Array(a.into_iter().map(|x| self.literal_strings(x)).collect()),
            Value::Object(m) => Value::Object(literal_map(self, m)),
            other => other,
        }
    }

    /// The keys `chat_template_kwargs` may set (the template's own variables; `None` without a template).
    pub fn template_variables(&self) -> Option<Vec<String>> {
        self.template.as_ref().map(ChatTemplate::variables)
    }

    /// Keeps at most `bytes` of preprocessed pixel rows for resent media (default 256 MiB); media seen
    /// before whose rows are not kept are laid out from their shapes and decoded on first need.
    pub fn with_preprocessed_bytes(self, bytes: usize) -> Self {
        Self { preprocessed: std::sync::Mutex::new(Preprocessed::new(bytes, SHAPES)), ..self }
    }

    /// The text tokenizer.
    pub fn tokenizer(&self) -> &TextTokenizer {
        &self.tok
    }

    /// Renders, expands, tokenizes a chat prompt.
    pub fn prepare_chat(&self, p: ChatPrompt) -> Result<PreparedPrompt, RequestError> {
        self.prepare_chat_until(p, &|| false)
    }

    /// [`TokenizerCore::prepare_chat`] whose grammar compile stops once `cancelled()` (the client left).
    pub fn prepare_chat_until(
        &self,
        mut p: ChatPrompt,
        cancelled: &dyn Fn() -> bool,
    ) -> Result<PreparedPrompt, RequestError> {
        if !p.media.is_empty() && !self.vision {
            return Err(RequestError::new(
                ErrorCode::VisionUnsupported,
                "this model does not accept image or video input",
            ));
        }
        let template = self.template.as_ref().ok_or_else(|| {
            RequestError::new(ErrorCode::InvalidRequest, "this model has no chat template; use /v1/completions")
        })?;
        let inputs = Arc::new(std::mem::take(&mut p.media));
        let mut media = Vec::with_capacity(inputs.len());
        let mut hashes = Vec::with_capacity(inputs.len());
        let mut budget = check_declared(&inputs, p.limits, &self.processor)?;
        for (i, m) in inputs.iter().enumerate() {
            check_deadline(p.deadline)?;
            let h = media_hash(m);
            // Seen before but its rows gone: made from this request's bytes if the encoder asks.
            let make = || remake(inputs.clone(), i, p.limits, self.processor.clone());
            let cached = self.preprocessed.lock().unwrap_or_else(std::sync::PoisonError::into_inner).get(&h, make);
            let d = match cached {
                Some(item) => Media::Preprocessed(item),
                None => {
                    decode(m, p.limits, &mut budget, p.deadline).map_err(|e| e.with_param(format!("media[{i}]")))?
                }
            };
            media.push(d);
            hashes.push(h);
        }
        check_deadline(p.deadline)?;
        let (messages, kwargs) = if p.parse_special_tokens {
            (p.messages, p.template_kwargs)
        } else {
            (self.literal_strings(p.messages), literal_map(self, p.template_kwargs))
        };
        let continued = p.continue_final_message.then(|| final_text(&messages)).flatten();
        if p.continue_final_message && continued.is_none() {
            return Err(RequestError::new(
                ErrorCode::InvalidRequest,
                "continuing the final message needs a last assistant message with text",
            )
            .with_param("messages"));
        }
        let add_generation_prompt = p.add_generation_prompt && !p.continue_final_message;
        let mut text = template
            .render(&messages, add_generation_prompt, &kwargs)
            .map_err(|e| RequestError::new(ErrorCode::InvalidRequest, e.to_string()).with_param("messages"))?;
        if let Some(last) = &continued {
            // The template closes the turn after the text (`<|im_end|>\n`): cut there, as vLLM does,
            // so the model continues the text.
            let at = text.rfind(last.as_str()).ok_or_else(|| {
                RequestError::new(
                    ErrorCode::InvalidRequest,
                    "the chat template changed the final message's text, so it cannot be continued",
                )
                .with_param("messages")
            })?;
            text.truncate(at + last.len());
        }
        // The grammar starts where the answer does: after the text it continues, if any.
        let prefix = match &continued {
            Some(last) if p.grammar.is_some() => self
                .tok
                .encode(last)
                .map_err(|e| RequestError::new(ErrorCode::InvalidRequest, e.to_string()).with_param("messages"))?,
            _ => Vec::new(),
        };
        check_deadline(p.deadline)?;
        let constraint =
            p.grammar.as_ref().map(|g| self.compile_until(g, &prefix, p.deadline, cancelled)).transpose()?;
        check_deadline(p.deadline)?;
        let prepared = prepare_prompt(&self.tok, &self.processor, &text, &media).map_err(prepare_error)?;
        let thinking_open =
            text.rfind("<think>").map(|o| text.rfind("</think>").is_none_or(|c| c < o)).unwrap_or(false);
        let turn_end = (add_generation_prompt && continued.is_none())
            .then(|| crate::turn::turn_end(template, &self.tok, &messages, &kwargs, &text, &prepared.input_ids))
            .flatten();
        {
            let mut cache = self.preprocessed.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            prepared.media.iter().zip(&hashes).for_each(|(item, h)| cache.put(*h, item));
        }
        let media: Vec<PreparedMedia> =
            prepared.media.into_iter().zip(hashes).map(|(item, hash)| item.into_media(hash)).collect();
        let positions = (!inputs.is_empty()).then_some(prepared.positions);
        let cache_ids = cache_ids(&prepared.input_ids, &media);
        Ok(PreparedPrompt {
            input_ids: prepared.input_ids,
            cache_ids,
            positions,
            rope_delta: prepared.rope_delta,
            media,
            thinking_open,
            constraint,
            turn_end,
        })
    }

    /// One step of incremental detokenization (see [`crate::Detokenizer`]).
    pub fn decode_step(&self, state: &mut DecodeState, ids: &[u32], finish: bool) -> String {
        let skip = state.skip_special;
        let mut f = |w: &[u32]| self.tok.decode(w, skip).unwrap_or_default();
        let mut det = crate::Detokenizer::default();
        let mut text = det.step(state, ids, &mut f);
        if finish {
            text.push_str(&det.flush(state, &mut f));
        }
        text
    }

    /// Tokenizes a completion prompt (no template, no media).
    pub fn prepare_completion(&self, p: CompletionPrompt) -> Result<PreparedPrompt, RequestError> {
        let ids = match p {
            CompletionPrompt::Ids(ids) => ids,
            CompletionPrompt::Text(t) => {
                self.tok.encode(&t).map_err(|e| RequestError::new(ErrorCode::InvalidRequest, e.to_string()))?
            }
        };
        let cache_ids = ids.iter().map(|&t| t as u64).collect();
        Ok(PreparedPrompt {
            input_ids: ids,
            cache_ids,
            positions: None,
            rope_delta: 0,
            media: Vec::new(),
            thinking_open: false,
            constraint: None,
            turn_end: None,
        })
    }
}

/// Cloneable handle to the tokenizer actor.
#[derive(Clone, Debug)]
pub struct TokenizerHandle {
    tx: mpsc::UnboundedSender<TokenizerCommand>,
}

impl TokenizerHandle {
    /// Sends a command; `false` when the actor is gone.
    pub fn send(&self, cmd: TokenizerCommand) -> bool {
        self.tx.send(cmd).is_ok()
    }

    /// The actor's inbox, for actors that talk to it through `osprey-protocol` messages only.
    pub fn sender(&self) -> mpsc::UnboundedSender<TokenizerCommand> {
        self.tx.clone()
    }

    /// Decodes ids (await from async code).
    pub async fn decode(&self, ids: Vec<u32>, skip_special: bool) -> Option<String> {
        let (reply, rx) = oneshot::channel();
        self.send(TokenizerCommand::Decode { ids, skip_special, reply }).then_some(())?;
        rx.await.ok()
    }
}

fn log_prepared(out: &Result<PreparedPrompt, RequestError>) {
    match out {
        Ok(p) => tracing::debug!(tokens = p.input_ids.len(), media = p.media.len(), "prompt prepared"),
        Err(e) => tracing::debug!(error = %e, "prompt refused"),
    }
}

fn literal_map(
    core: &TokenizerCore,
    m: serde_json::Map<String, serde_json::Value>,
) -> serde_json::Map<String, serde_json::Value> {
    m.into_iter()
        .map(|(k, v)| {
            let keep = matches!(k.as_str(), "role" | "type");
            (k, if keep { v } else { core.literal_strings(v) })
        })
        .collect()
}

/// The text of the last message when it is an assistant's (a string, or its text parts joined).
fn final_text(messages: &serde_json::Value) -> Option<String> {
    let last = messages.as_array()?.last()?;
    if last.get("role")?.as_str()? != "assistant" {
        return None;
    }
    let text = match last.get("content")? {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Array(parts) => parts.iter().filter_map(|p| p.get("text")?.as_str()).collect(),
        _ => return None,
    };
    (!text.is_empty()).then_some(text)
}

/// Stack of each tokenizer worker.
const TOKENIZER_STACK_BYTES: usize = 32 << 20;

/// The part of a grammar compiler's refusal a client may see: its first line, at most 200 characters
/// (the rest can be the compiler's internal state, logged at debug level instead).
fn public_reason(e: &str) -> String {
    let line = e.lines().next().unwrap_or("").trim();
    let mut out: String = line.chars().take(200).collect();
    if out.len() < line.len() {
        out.push('…');
    }
    out
}

/// Starts the tokenizer actor with one worker per lane.
pub fn spawn(core: TokenizerCore) -> TokenizerHandle {
    spawn_pool(core, 1)
}

/// Starts the tokenizer actor with three lanes of `workers` threads each. Prompts with media (decoding and
/// resizing images and video frames: up to seconds) go to the media lane; prompts with an output format
/// or forced tool calls (a grammar to compile: bounded, but up to a few hundred milliseconds each) to the
/// grammar lane; everything else (text prompts, the detokenization of every stream) to the text lane, so
/// neither large media nor costly schemas can hold up a plain "hi" or a running stream: two 160-frame
/// videos once kept both shared workers busy for 25 s while a short request waited behind them. A
/// dispatcher thread owns the actor's inbox and routes each command; within a lane the workers share the
/// lane's queue (its lock is held only while waiting for the next command, never while working on one). The core is read-only
/// and shared.
pub fn spawn_pool(core: TokenizerCore, workers: usize) -> TokenizerHandle {
    let (tx, mut rx) = mpsc::unbounded_channel::<TokenizerCommand>();
    let core = std::sync::Arc::new(core);
    let lane = |name: &str| {
        let (lane_tx, lane_rx) = mpsc::unbounded_channel::<TokenizerCommand>();
        let lane_rx = std::sync::Arc::new(std::sync::Mutex::new(lane_rx));
        for i in 0..workers.max(1) {
            let (core, rx) = (core.clone(), lane_rx.clone());
            thread::Builder::new()
                .name(format!("osprey-tokenizer-{name}-{i}"))
                // Templates and grammar compiles recurse; inputs are bounded before they get here, and
                // a roomy stack (virtual memory, touched only when used) is the second line of defence.
                .stack_size(TOKENIZER_STACK_BYTES)
                .spawn(move || loop {
                    let cmd = rx.lock().unwrap_or_else(std::sync::PoisonError::into_inner).blocking_recv();
                    let Some(cmd) = cmd else { return };
                    // The core is read-only, so a panic (a bug) spoils nothing but its own request: the
                    // worker survives it, the request's reply is dropped (the server answers 500) and the
                    // lane keeps its size. Stateful actors (scheduler, runner, caches) are not caught:
                    // their death closes their inbox and the server reports the engine stopped.
                    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handle(&core, cmd)));
                    if caught.is_err() {
                        tracing::error!("a tokenizer command panicked (a bug): its request fails, the worker goes on");
                    }
                })
                .expect("spawn tokenizer thread");
        }
        lane_tx
    };
    let (media, grammar, text) = (lane("media"), lane("grammar"), lane("text"));
    thread::Builder::new()
        .name("osprey-tokenizer".into())
        .spawn(move || {
            while let Some(cmd) = rx.blocking_recv() {
                let lane = match &cmd {
                    TokenizerCommand::PrepareChat { prompt, .. } if !prompt.media.is_empty() => &media,
                    TokenizerCommand::PrepareChat { prompt, .. } if prompt.grammar.is_some() => &grammar,
                    _ => &text,
                };
                if lane.send(cmd).is_err() {
                    return;
                }
            }
        })
        .expect("spawn tokenizer dispatcher");
    TokenizerHandle { tx }
}

fn handle(core: &TokenizerCore, cmd: TokenizerCommand) {
    match cmd {
        TokenizerCommand::PrepareChat { prompt, span, reply } => {
            let _in = span.enter();
            let out = core.prepare_chat_until(*prompt, &|| reply.is_closed());
            log_prepared(&out);
            let _ = reply.send(out);
        }
        TokenizerCommand::PrepareCompletion { prompt, span, reply } => {
            let _in = span.enter();
            let out = core.prepare_completion(prompt);
            log_prepared(&out);
            let _ = reply.send(out);
        }
        TokenizerCommand::DecodeStep { mut state, ids, finish, reply } => {
            let text = core.decode_step(&mut state, &ids, finish);
            let _ = reply.send((state, text));
        }
        TokenizerCommand::Decode { ids, skip_special, reply } => {
            let _ = reply.send(core.tok.decode(&ids, skip_special).unwrap_or_default());
        }
        TokenizerCommand::TokenTexts { ids, reply } => {
            let texts = ids.iter().map(|&i| core.tok.decode(&[i], false).unwrap_or_default()).collect();
            let _ = reply.send(texts);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use osprey_protocol::vision::{PixelPatches, Pixels};

    use super::*;

    fn item(bytes: &[u8], spans: Vec<(usize, usize)>) -> PreparedMedia {
        let patches = Arc::new(Pixels::ready(Arc::new(PixelPatches { rows: Vec::new(), grid: [1, 2, 2] })));
        PreparedMedia { hash: hash(&[b"image", bytes]), patches, spans }
    }

    /// CPU time of the calling thread (the compile runs on it).
    fn thread_cpu() -> Duration {
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime writes the timespec it is given.
        let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
        assert_eq!(rc, 0, "clock_gettime");
        Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
    }

    /// Issue 39: a request's deadline stops its grammar's compile, and the CPU it would have taken. A
    /// compile is the parser's construction (bounded by llguidance's limits, not interruptible) and then
    /// the closing walk, the part that grows with the answer's length (here 50 required strings of at
    /// least 80 characters: thousands of masks), which a deadline cuts. Measured on this thread's CPU
    /// clock: the fixed part (stopped before the walk), the whole, then a deadline a quarter of the walk
    /// past the fixed part; wall time passes at least as fast as this thread's CPU time, so the stopped
    /// compile uses at most about the fixed part and a quarter of the walk.
    #[test]
    fn a_deadline_stops_a_grammar_compile_and_its_cpu_time() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/models/osprey-default");
        let core = TokenizerCore::from_dir(&dir, false).expect("core").with_grammar_vocab(1024, vec![994]);
        let n = 50;
        let props: serde_json::Map<String, serde_json::Value> =
            (0..n).map(|i| (format!("p{i}"), serde_json::json!({"type": "string", "minLength": 80}))).collect();
        let g = Grammar::JsonSchema(serde_json::json!({"type": "object", "properties": props,
            "required": (0..n).map(|i| format!("p{i}")).collect::<Vec<_>>(),
            "x-guidance": {"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}}));
        core.compile(&Grammar::JsonSchema(serde_json::json!({"type": "string"}))).expect("the compiler is built");
        let cpu = |f: &dyn Fn() -> Result<Constraint, RequestError>| {
            let t0 = thread_cpu();
            let r = f();
            (r, thread_cpu() - t0)
        };
        let (r, whole) = cpu(&|| core.compile(&g));
        r.expect("compile");
        // A cancelled request (its client left) stops after the parser, before the walk.
        let (gone, fixed) = cpu(&|| core.compile_until(&g, &[], None, &|| true));
        assert_eq!(gone.err().map(|e| e.code), Some(ErrorCode::RequestTimeout));
        let walk = whole.saturating_sub(fixed);
        let (stopped, used) = cpu(&|| core.compile_until(&g, &[], Some(Instant::now() + fixed + walk / 4), &|| false));
        println!("whole compile {whole:?} of CPU, its parser {fixed:?}; stopped at its deadline after {used:?}");
        assert_eq!(stopped.err().map(|e| e.code), Some(ErrorCode::DeadlineExceeded));
        assert!(walk > fixed, "the walk ({walk:?}) is the larger part here");
        assert!(used < fixed + walk / 2, "a stopped compile used {used:?}: parser {fixed:?}, walk {walk:?}");
    }

    #[test]
    fn cache_ids_are_content_addressed_per_position() {
        let ids = [7, 8, 1004, 1004, 1004, 9];
        let a = cache_ids(&ids, &[item(b"picture A", vec![(2, 3)])]);
        let a2 = cache_ids(&ids, &[item(b"picture A", vec![(2, 3)])]);
        let b = cache_ids(&ids, &[item(b"picture B", vec![(2, 3)])]);
        assert_eq!(a, a2, "same bytes, same ids");
        assert_eq!(&a[..2], &[7, 8]);
        assert_eq!(a[5], 9);
        assert!(a[2..5].iter().all(|&c| c >= 1 << 62), "above any vocabulary");
        assert_eq!(a[2..5].iter().collect::<std::collections::HashSet<_>>().len(), 3, "every position differs");
        assert_ne!(a[2], b[2], "a different image diverges at its first placeholder");
        // A video's frame groups continue the offset across spans.
        let v = cache_ids(&[1005, 1005, 5, 1005, 1005], &[item(b"video", vec![(0, 2), (3, 2)])]);
        assert_eq!(v[3], v[1] + 1);
    }
}
