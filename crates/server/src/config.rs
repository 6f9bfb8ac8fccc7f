//! Server settings (from config/osprey.toml and CLI flags, merged by the binary).

use std::path::PathBuf;

/// Limits on what one request may carry.
#[derive(Clone, Debug)]
pub struct Limits {
    /// Most media items (images + videos) per request.
    pub max_media_per_request: usize,
    /// Largest decoded size of one media item (data URL payload, fetched or local file), bytes.
    pub max_media_bytes: usize,
    /// Largest declared width·height of an image or frame (checked on the header, before decoding).
    pub max_image_pixels: u64,
    /// Most frames in one video.
    pub max_video_frames: usize,
    /// Most pixels of all images and frames of one request, by declared size (decoded at 3 B a pixel).
    pub max_request_pixels: u64,
    /// Hosts whose http(s) media URLs may be fetched (empty: none).
    pub allowed_media_domains: Vec<String>,
    /// Directory under which `file://` media may be read (None: no local files).
    pub allowed_local_media_path: Option<PathBuf>,
    /// Largest request body, bytes.
    pub max_body_bytes: usize,
    /// Most responses `/v1/responses` keeps for `previous_response_id` (0: none are kept).
    pub max_stored_responses: usize,
    /// Most bytes of stored conversations (their text and media as sent), oldest dropped first.
    pub max_stored_response_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Limits {
            // A conversation of images resends every earlier one (issue 53): 8 refused its 5th–7th turn.
            // Memory and decode time are bounded by the request's pixels (`max_request_pixels`), not the
            // count; a resent image is not decoded again (the tokenizer's preprocessed media).
            max_media_per_request: 256,
            max_media_bytes: 16 << 20,
            max_image_pixels: 64 << 20,
            max_video_frames: 64,
            max_request_pixels: 192_000_000,
            allowed_media_domains: Vec::new(),
            allowed_local_media_path: None,
            max_body_bytes: 64 << 20,
            max_stored_responses: 1024,
            max_stored_response_bytes: 256 << 20,
        }
    }
}

/// What the Ollama API's listings say about the served model (`/api/tags`, `/api/show`, `/api/ps`).
#[derive(Clone, Debug, Default)]
pub struct ModelAbout {
    /// `model_type` of its config (`qwen3_5_moe`, ...).
    pub family: String,
    /// Parameters (an NVFP4 byte holds two).
    pub parameters: u64,
    /// Bytes of its weight files.
    pub bytes: u64,
    /// How its weights are stored: `BF16`, `F32`, `NVFP4`.
    pub quantization: String,
    /// Its chat template's text.
    pub template: String,
    /// When its config was last written (seconds since the epoch).
    pub modified: u64,
    /// A 64-hex-digit digest that names this checkpoint (Ollama lists a blob's sha256 there).
    pub digest: String,
    /// Decoder layers: expert layers past them are the draft head's (the engine view labels them).
    pub decoder_layers: usize,
}

/// Everything the HTTP layer needs to know.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The id clients use in `model` (and /v1/models lists).
    pub model_id: String,
    /// Context length of the model.
    pub context_len: usize,
    /// Tokens the KV pool holds: one sequence's prompt and answer can take no more (`--kv-capacity-tokens`,
    /// rounded up to whole pages).
    pub kv_capacity_tokens: usize,
    /// Vocabulary size (token-id prompts are checked against it).
    pub vocab_size: usize,
    /// Most bytes of text one token can stand for (the tokenizer's longest entry): a prompt with more
    /// than `context_len × max_token_bytes` bytes of text is refused before it is tokenized.
    pub max_token_bytes: usize,
    /// The model takes images (it has a vision tower).
    pub vision: bool,
    /// The model takes videos too (its family says so).
    pub video: bool,
    /// Bearer key required on /v1 routes (None: open).
    pub api_key: Option<String>,
    /// Host names requests may name besides localhost names and IP addresses (checked without a key).
    pub allowed_hosts: Vec<String>,
    /// Browser origins allowed to call the API (CORS); none by default.
    pub allowed_origins: Vec<String>,
    /// Seconds running generations may go on after a shutdown signal.
    pub shutdown_grace_secs: u64,
    /// Seconds a client has to send its whole request body.
    pub body_timeout_secs: f64,
    /// Longest a request may run, queue included (None: no server-wide deadline; a request may still
    /// set its own `deadline_secs`).
    pub request_deadline_secs: Option<f64>,
    /// Seconds an idle keep-alive connection (or one that has not sent its request head) stays open.
    pub idle_timeout_secs: f64,
    /// End-of-sequence token ids.
    pub eos_token_ids: Vec<u32>,
    /// The keys `chat_template_kwargs` may set: the variables the chat template reads (`None`: the
    /// model has no template, or every key is taken).
    pub template_kwargs: Option<Vec<String>>,
    /// Request limits.
    pub limits: Limits,
    /// Serve the web page (`/`, `/dashboard`); `--no-webui` turns it off.
    pub webui: bool,
    /// The model as the Ollama API describes it.
    pub about: ModelAbout,
}

impl ServerConfig {
    /// What bounds every request's length (`Limits::budget`, applied once per request).
    pub fn limits(&self) -> osprey_protocol::scheduler::Limits {
        osprey_protocol::scheduler::Limits { context_len: self.context_len, kv_tokens: self.kv_capacity_tokens }
    }

    /// A configuration for a vision model of `context_len` tokens with everything else at its default
    /// (no key, no allow-lists, no deadline, short timeouts): unit tests and the fuzz targets.
    pub fn basic(model_id: &str, context_len: usize, vocab_size: usize, max_token_bytes: usize) -> Self {
        ServerConfig {
            model_id: model_id.into(),
            context_len,
            kv_capacity_tokens: usize::MAX,
            vocab_size,
            max_token_bytes,
            vision: true,
            video: true,
            api_key: None,
            allowed_hosts: Vec::new(),
            allowed_origins: Vec::new(),
            shutdown_grace_secs: 0,
            body_timeout_secs: 1.0,
            request_deadline_secs: None,
            idle_timeout_secs: 1.0,
            eos_token_ids: Vec::new(),
            template_kwargs: None,
            limits: Limits::default(),
            webui: true,
            about: ModelAbout::default(),
        }
    }

    /// A configuration for unit tests: a 4,096-token context, no template-argument restriction.
    #[cfg(test)]
    pub(crate) fn test() -> Self {
        Self::basic("test", 4096, 1000, 16)
    }
}
