//! Messages to the tokenizer actor: prompt preparation (template, media, tokens, positions) and decoding.

use std::sync::Arc;

use crate::vision::Pixels;
use tokio::sync::oneshot;

use crate::constraint::{Constraint, Grammar};
use crate::{MediaHash, RequestError};

/// A media item as the client sent it (already fetched or decoded from its data URL).
#[derive(Clone, Debug)]
pub enum MediaInput {
    /// One encoded image (PNG, JPEG, WebP, GIF, BMP).
    Image {
        /// File bytes.
        bytes: Vec<u8>,
    },
    /// A video as encoded frame images in order, with their frame rate (None: 24, as transformers assumes).
    VideoFrames {
        /// One encoded image per frame.
        frames: Vec<Vec<u8>>,
        /// Frames per second.
        fps: Option<f64>,
    },
    /// A video as one animated file (GIF, WebP).
    VideoFile {
        /// File bytes.
        bytes: Vec<u8>,
    },
}

/// Limits applied while decoding media.
#[derive(Clone, Copy, Debug)]
pub struct MediaLimits {
    /// Largest declared width·height of one image or frame.
    pub max_pixels: u64,
    /// Most frames in one video.
    pub max_frames: usize,
    /// Most pixels decoded for the whole request (every image and frame, by declared size): what the
    /// decoded media of one request can take in memory, 3 bytes a pixel.
    pub max_total_pixels: u64,
    /// Most soft tokens the request's images may expand to (the context): counted from their declared
    /// sizes before anything is decoded.
    pub max_media_tokens: usize,
}

/// A chat prompt to render and tokenize.
#[derive(Clone, Debug)]
pub struct ChatPrompt {
    /// OpenAI messages; media parts already replaced by `{"type": "image"}` / `{"type": "video"}`.
    pub messages: serde_json::Value,
    /// Media in the order of their parts.
    pub media: Vec<MediaInput>,
    /// `chat_template_kwargs` (e.g. `enable_thinking`).
    pub template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// Decoding limits.
    pub limits: MediaLimits,
    /// A grammar the answer must match, compiled with the prompt.
    pub grammar: Option<Grammar>,
    /// Special tokens spelled in the messages (`<|im_start|>`) are control tokens, as the template's
    /// own are. Off by default: client text is text, so a message cannot forge a turn.
    pub parse_special_tokens: bool,
    /// Render the template's generation prompt after the messages (the default); false leaves the
    /// prompt where the messages end (vLLM's `add_generation_prompt: false`).
    pub add_generation_prompt: bool,
    /// The last message is an assistant message to continue (Anthropic's prefill, vLLM's
    /// `continue_final_message`): the prompt ends where its text ends, without its end of turn, and the
    /// answer is the continuation.
    pub continue_final_message: bool,
    /// When the request's deadline passes: preparation stops at its next step (between media items and
    /// frames, before compiling, rendering and tokenizing) with `deadline_exceeded`.
    pub deadline: Option<std::time::Instant>,
}

/// A completion prompt.
#[derive(Clone, Debug)]
pub enum CompletionPrompt {
    /// Text, tokenized as is.
    Text(String),
    /// Token ids.
    Ids(Vec<u32>),
}

/// One preprocessed media item of a prompt.
#[derive(Clone, Debug)]
pub struct PreparedMedia {
    /// Content hash of the item's bytes (the vision cache key).
    pub hash: MediaHash,
    /// Pixel rows and grid (rows made on first need for an item seen before).
    pub patches: Arc<Pixels>,
    /// Placeholder runs `(offset, len)`: one for an image, one per frame group of a video.
    pub spans: Vec<(usize, usize)>,
}

/// A prompt ready for the engine.
#[derive(Clone, Debug)]
pub struct PreparedPrompt {
    /// Token ids.
    pub input_ids: Vec<u32>,
    /// The prefix-cache key of each position: the token id, except media placeholders, which get
    /// `2^62 | (content hash + offset within the item)` so different media never share a key.
    pub cache_ids: Vec<u64>,
    /// mRoPE positions per token (`None`: text positions).
    pub positions: Option<Vec<[i64; 3]>>,
    /// Decode position delta.
    pub rope_delta: i64,
    /// Media items.
    pub media: Vec<PreparedMedia>,
    /// The prompt ends inside an open `<think>` block (the reply starts with reasoning).
    pub thinking_open: bool,
    /// The compiled grammar of [`ChatPrompt::grammar`], for the sampler.
    pub constraint: Option<Constraint>,
    /// Tokens of this prompt the conversation's next turn shares with it: the history up to where the
    /// generation prompt and the template's rendering of a past reply part (`None`: not a chat prompt
    /// with a generation prompt, or no split between tokens there). The scheduler snapshots the page at
    /// or below it, so the next turn resumes there (issue 53).
    pub turn_end: Option<usize>,
}

/// Incremental detokenizer state of one answer. Plain data that travels with the request, so the
/// tokenizer actor keeps nothing per request.
#[derive(Clone, Debug, Default)]
pub struct DecodeState {
    /// Context ids (the text emitted last) followed by ids whose text is not settled yet.
    pub window: Vec<u32>,
    /// Text of `window[..context]`.
    pub prefix: String,
    /// Number of context ids at the start of `window`.
    pub context: usize,
    /// Drop special tokens.
    pub skip_special: bool,
}

impl PreparedPrompt {
    /// A text prompt of `ids`: text positions, no media, cache ids equal to the token ids.
    pub fn text(ids: Vec<u32>) -> Self {
        PreparedPrompt {
            cache_ids: ids.iter().map(|&t| u64::from(t)).collect(),
            input_ids: ids,
            positions: None,
            rope_delta: 0,
            media: Vec::new(),
            thinking_open: false,
            constraint: None,
            turn_end: None,
        }
    }
}

/// Commands of the tokenizer actor.
#[derive(Debug)]
pub enum TokenizerCommand {
    /// Render, expand, tokenize a chat prompt.
    PrepareChat {
        /// The prompt (boxed: it is the largest message by far).
        prompt: Box<ChatPrompt>,
        /// The request's span (its id, followed across actors in the log).
        span: tracing::Span,
        /// The prepared prompt or why not.
        reply: oneshot::Sender<Result<PreparedPrompt, RequestError>>,
    },
    /// Tokenize a completion prompt.
    PrepareCompletion {
        /// The prompt.
        prompt: CompletionPrompt,
        /// The request's span.
        span: tracing::Span,
        /// The prepared prompt or why not.
        reply: oneshot::Sender<Result<PreparedPrompt, RequestError>>,
    },
    /// Incremental detokenization: append `ids` to an answer's [`DecodeState`] and get the text they
    /// settle (with `finish`, also the text still held); constant work per token.
    DecodeStep {
        /// The answer's state so far (returned updated).
        state: DecodeState,
        /// New ids.
        ids: Vec<u32>,
        /// The answer ended: flush what is held.
        finish: bool,
        /// The updated state and the new text.
        reply: oneshot::Sender<(DecodeState, String)>,
    },
    /// Decode ids to text, whole.
    Decode {
        /// Token ids.
        ids: Vec<u32>,
        /// Drop special tokens.
        skip_special: bool,
        /// The text.
        reply: oneshot::Sender<String>,
    },
    /// Text of each single token (logprobs).
    TokenTexts {
        /// Token ids.
        ids: Vec<u32>,
        /// One string per id.
        reply: oneshot::Sender<Vec<String>>,
    },
}
