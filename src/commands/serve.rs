//! `osprey serve`: the flags (each also a key of the settings file) and the server's start.

use std::path::PathBuf;

use anyhow::Result;

use super::Global;

#[derive(clap::Args, Debug, Default)]
pub struct ServeArgs {
    /// Settings file (TOML, see config/osprey.toml); flags override it.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model directory, or a Hugging Face id (`org/name[@revision]`) in the local HF cache (default: the
    /// embedded tiny model).
    #[arg(long)]
    model: Option<PathBuf>,
    /// Id clients send as `model`.
    #[arg(long)]
    served_model_name: Option<String>,
    /// Listen address.
    #[arg(long)]
    host: Option<String>,
    /// Listen port.
    #[arg(long)]
    port: Option<u16>,
    /// Require `Authorization: Bearer <key>` on /v1 routes.
    #[arg(long)]
    api_key: Option<String>,
    /// Override the model's context length.
    #[arg(long)]
    context_len: Option<usize>,
    /// Prompt tokens per sequence per step (prefill chunk).
    #[arg(long)]
    max_prefill_tokens: Option<usize>,
    /// Tokens per step over all sequences.
    #[arg(long)]
    max_batch_tokens: Option<usize>,
    /// Concurrent sequences.
    #[arg(long)]
    max_running_requests: Option<usize>,
    /// KV capacity in tokens.
    #[arg(long)]
    kv_capacity_tokens: Option<usize>,
    /// Vision encoder cache in MiB.
    #[arg(long)]
    vision_cache_mb: Option<usize>,
    /// Turn the prefix cache off.
    #[arg(long)]
    disable_prefix_cache: bool,
    /// Prefix cache budget (KV pages + recurrent snapshots) in MiB.
    #[arg(long)]
    prefix_cache_mb: Option<f64>,
    /// MiB of live tensors (activations, states, KV) the compute backend may hold; past it a request
    /// gets 503 out_of_memory and the engine goes on.
    #[arg(long)]
    device_memory_mb: Option<f64>,
    /// GiB of device memory the CUDA backend plans with (weights, KV, expert slots); default: all of it.
    #[arg(long)]
    gpu_memory_gb: Option<f64>,
    /// Element type of the KV cache: `f32` (default, exact) or `bf16` (half the KV memory).
    #[arg(long)]
    kv_cache_dtype: Option<String>,
    /// Draft tokens per decode step from the checkpoint's MTP head (speculative decoding; 0: off).
    #[arg(long)]
    speculative_tokens: Option<usize>,
    /// Prefix cache page size in tokens.
    #[arg(long)]
    page_size: Option<usize>,
    /// Recurrent-state snapshot grid in tokens (a multiple of the page size).
    #[arg(long)]
    snapshot_interval: Option<usize>,
    /// Stream routed experts from disk, keeping at most this many GB of them in RAM.
    #[arg(long)]
    expert_ram_gb: Option<f64>,
    /// Stream routed experts from disk, keeping at most this many experts per layer in RAM.
    #[arg(long)]
    expert_ram_experts: Option<usize>,
    /// RAM for cached PLE table rows in GB, all layers together (qwen4_exp; default 1).
    #[arg(long)]
    ple_ram_gb: Option<f64>,
    /// Expert reader: auto, io_uring or pread.
    #[arg(long)]
    expert_reader: Option<String>,
    /// Expert eviction policy: lru or lfu.
    #[arg(long)]
    expert_policy: Option<String>,
    /// Fill the expert budget after startup, in the background (requests are served first).
    #[arg(long)]
    expert_warmup: bool,
    /// Read experts ahead, guessed one layer early: router (the default), previous, union or off.
    #[arg(long)]
    expert_prefetch: Option<String>,
    /// Experts per token the router guess adds beyond top-k.
    #[arg(long)]
    expert_prefetch_margin: Option<usize>,
    /// MoE layers ahead each layer guesses: 1 (the next) or 2 (the next two).
    #[arg(long)]
    expert_prefetch_depth: Option<usize>,
    /// Images + videos per request.
    #[arg(long)]
    max_media_per_request: Option<usize>,
    /// Bytes per media item.
    #[arg(long)]
    max_media_bytes: Option<usize>,
    /// Declared pixels per image or frame (checked before decoding).
    #[arg(long)]
    max_image_pixels: Option<u64>,
    /// Frames per video.
    #[arg(long)]
    max_video_frames: Option<usize>,
    /// Hosts whose http(s) media URLs may be fetched (comma-separated).
    #[arg(long, value_delimiter = ',')]
    allowed_media_domains: Option<Vec<String>>,
    /// Directory under which file:// media may be read.
    #[arg(long)]
    allowed_local_media_path: Option<PathBuf>,
    /// Host names clients may use in `Host` without an API key, besides localhost and IP addresses
    /// (comma-separated; defeats DNS rebinding).
    #[arg(long, value_delimiter = ',')]
    allowed_hosts: Option<Vec<String>>,
    /// Browser origins allowed to call the API, e.g. `https://chat.example` (comma-separated, `*` for
    /// any; default none).
    #[arg(long, value_delimiter = ',')]
    allowed_origins: Option<Vec<String>>,
    /// Seconds running generations may go on after SIGTERM / SIGINT before they are ended (default 30).
    #[arg(long)]
    shutdown_grace_secs: Option<u64>,
    /// Most requests waiting for admission; more get 503 with Retry-After (default 256; 0: no limit).
    #[arg(long)]
    max_queued_requests: Option<usize>,
    /// Seconds a request may wait for admission before it gets 503 with Retry-After (default: no limit).
    #[arg(long)]
    max_queue_wait_secs: Option<f64>,
    /// Seconds a client has to send its whole request body; then 408 and the connection is closed
    /// (default 30).
    #[arg(long)]
    body_timeout_secs: Option<f64>,
    /// Longest a request may run from arrival, queue included; then it ends with finish_reason
    /// "timeout" (504 deadline_exceeded before its first token). Requests may ask for less with
    /// `deadline_secs`. Default: no limit.
    #[arg(long)]
    request_deadline_secs: Option<f64>,
    /// Seconds an idle keep-alive connection, or one that has not sent its request head, stays open
    /// (default 5).
    #[arg(long)]
    idle_timeout_secs: Option<f64>,
    /// Tokenizer worker threads per lane (media prompts; text prompts and detokenization) (default 2).
    #[arg(long)]
    tokenizer_workers: Option<usize>,
    /// Most pixels of all images and video frames of one request, by declared size (default 192000000,
    /// ~576 MB decoded).
    #[arg(long)]
    max_request_pixels: Option<u64>,
    /// Most responses `/v1/responses` keeps for `previous_response_id` (default 1024; 0 keeps none).
    #[arg(long)]
    max_stored_responses: Option<usize>,
    /// Most MiB of conversations kept for `previous_response_id`, media included (default 256).
    #[arg(long)]
    max_stored_response_mb: Option<f64>,
    /// Do not serve the web page (the chat at `/` and the engine view at `/dashboard`).
    #[arg(long)]
    no_webui: bool,
}

impl ServeArgs {
    fn settings(&self) -> osprey::Settings {
        osprey::Settings {
            model: self.model.clone(),
            served_model_name: self.served_model_name.clone(),
            host: self.host.clone(),
            port: self.port,
            api_key: self.api_key.clone(),
            http_workers: None,
            context_len: self.context_len,
            max_prefill_tokens: self.max_prefill_tokens,
            max_batch_tokens: self.max_batch_tokens,
            max_running_requests: self.max_running_requests,
            kv_capacity_tokens: self.kv_capacity_tokens,
            vision_cache_mb: self.vision_cache_mb,
            disable_prefix_cache: self.disable_prefix_cache.then_some(true),
            prefix_cache_mb: self.prefix_cache_mb,
            device_memory_mb: self.device_memory_mb,
            gpu_memory_gb: self.gpu_memory_gb,
            kv_cache_dtype: self.kv_cache_dtype.clone(),
            speculative_tokens: self.speculative_tokens,
            page_size: self.page_size,
            snapshot_interval: self.snapshot_interval,
            expert_ram_gb: self.expert_ram_gb,
            expert_ram_experts: self.expert_ram_experts,
            expert_reader: self.expert_reader.clone(),
            ple_ram_gb: self.ple_ram_gb,
            expert_policy: self.expert_policy.clone(),
            expert_warmup: self.expert_warmup.then_some(true),
            expert_prefetch: self.expert_prefetch.clone(),
            expert_prefetch_margin: self.expert_prefetch_margin,
            expert_prefetch_depth: self.expert_prefetch_depth,
            max_media_per_request: self.max_media_per_request,
            max_media_bytes: self.max_media_bytes,
            max_image_pixels: self.max_image_pixels,
            max_video_frames: self.max_video_frames,
            allowed_media_domains: self.allowed_media_domains.clone(),
            allowed_local_media_path: self.allowed_local_media_path.clone(),
            allowed_hosts: self.allowed_hosts.clone(),
            allowed_origins: self.allowed_origins.clone(),
            shutdown_grace_secs: self.shutdown_grace_secs,
            max_queued_requests: self.max_queued_requests,
            max_queue_wait_secs: self.max_queue_wait_secs,
            body_timeout_secs: self.body_timeout_secs,
            request_deadline_secs: self.request_deadline_secs,
            idle_timeout_secs: self.idle_timeout_secs,
            tokenizer_workers: self.tokenizer_workers,
            max_request_pixels: self.max_request_pixels,
            max_stored_responses: self.max_stored_responses,
            max_stored_response_mb: self.max_stored_response_mb,
            no_webui: self.no_webui.then_some(true),
            device: None,
            activations: None,
        }
    }
}

/// Serves with the settings file (if given) under the flags, the global device and activations on top.
pub fn run(a: ServeArgs, g: &Global) -> Result<()> {
    let file = match &a.config {
        Some(p) => osprey::Settings::from_file(p)?,
        None => osprey::Settings::default(),
    };
    let flags = osprey::Settings { device: g.device.clone(), activations: g.activations.clone(), ..a.settings() };
    let settings = file.overlay(&flags);
    let dir = osprey::model_dir(&settings)?;
    actix_web::rt::System::new().block_on(osprey::serve_until_signal(&settings, &dir))
}
