//! `osprey serve` settings: `config/osprey.toml` (documented field by field there), overridden by CLI
//! flags. Every field is optional; `None` means the built-in default.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// Merged settings.
#[derive(Clone, Debug, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Settings {
    /// Model directory (None: the embedded default model).
    pub model: Option<PathBuf>,
    /// Id clients send as `model` (default: the directory name).
    pub served_model_name: Option<String>,
    /// Listen address (default 127.0.0.1).
    pub host: Option<String>,
    /// Listen port (default 8080).
    pub port: Option<u16>,
    /// Bearer key required on /v1 routes.
    pub api_key: Option<String>,
    /// HTTP worker threads (default 2).
    pub http_workers: Option<usize>,
    /// Override of the model's context length.
    pub context_len: Option<usize>,
    /// Prompt tokens per sequence per step (default 512).
    pub max_prefill_tokens: Option<usize>,
    /// Tokens per step over all sequences (default 2048).
    pub max_batch_tokens: Option<usize>,
    /// Concurrent sequences (default 16).
    pub max_running_requests: Option<usize>,
    /// KV capacity in tokens (default 4 × context length).
    pub kv_capacity_tokens: Option<usize>,
    /// Vision encoder cache size in MiB (default 512).
    pub vision_cache_mb: Option<usize>,
    /// Turn the prefix cache off (default on).
    pub disable_prefix_cache: Option<bool>,
    /// Prefix cache budget (KV pages + recurrent snapshots) in MiB (default 1024; fractions allowed).
    pub prefix_cache_mb: Option<f64>,
    /// Prefix cache page size in tokens (default 16).
    pub page_size: Option<usize>,
    /// Recurrent-state snapshot grid in tokens, a multiple of the page size (default 64).
    pub snapshot_interval: Option<usize>,
    /// Stream routed experts from disk, keeping at most this many GB of them in RAM (MoE models).
    pub expert_ram_gb: Option<f64>,
    /// Stream routed experts from disk, keeping at most this many experts per layer in RAM.
    pub expert_ram_experts: Option<usize>,
    /// RAM for cached rows of per-layer n-gram (PLE) tables, in GB, all layers together (`qwen4_exp`;
    /// default 1). The tables stay on disk; rows are read on demand.
    pub ple_ram_gb: Option<f64>,
    /// Expert reader: "auto" (io_uring, else pread), "io_uring" or "pread".
    pub expert_reader: Option<String>,
    /// Expert eviction policy: "lru" (default) or "lfu".
    pub expert_policy: Option<String>,
    /// Fill the expert budget after startup, while the manager has nothing else to do (requests first).
    pub expert_warmup: Option<bool>,
    /// Read each MoE layer's experts ahead, guessed while the layer before computes: "router" (the
    /// default: the next layer's router on this layer's input), "previous" (the next layer's experts at
    /// the previous step), "union" or "off" (docs/architecture.md, "Read-ahead").
    pub expert_prefetch: Option<String>,
    /// Experts per token the router guess adds beyond the model's top-k (default 2).
    pub expert_prefetch_margin: Option<usize>,
    /// MoE layers ahead each layer guesses (default 1: the next; 2: the next two).
    pub expert_prefetch_depth: Option<usize>,
    /// Images + videos per request (default 256).
    pub max_media_per_request: Option<usize>,
    /// Bytes per media item (default 16 MiB).
    pub max_media_bytes: Option<usize>,
    /// Declared pixels per image or frame (default 64 Mi).
    pub max_image_pixels: Option<u64>,
    /// Frames per video (default 64).
    pub max_video_frames: Option<usize>,
    /// Hosts whose http(s) media may be fetched (default none).
    pub allowed_media_domains: Option<Vec<String>>,
    /// Directory for `file://` media (default none).
    pub allowed_local_media_path: Option<PathBuf>,
    /// Host names requests may name when no API key is set, besides localhost names and IP addresses.
    pub allowed_hosts: Option<Vec<String>>,
    /// Browser origins allowed to call the API (CORS); default none.
    pub allowed_origins: Option<Vec<String>>,
    /// Seconds running generations may go on after SIGTERM / SIGINT (default 30).
    pub shutdown_grace_secs: Option<u64>,
    /// Most requests waiting for admission; more get 503 `overloaded` (default 256; 0: no limit).
    pub max_queued_requests: Option<usize>,
    /// Seconds a request may wait for admission before it gets 503 `overloaded` (default: no limit).
    pub max_queue_wait_secs: Option<f64>,
    /// Seconds a client has to send its whole request body (default 30); then 408 and the connection closes.
    pub body_timeout_secs: Option<f64>,
    /// Longest a request may run from arrival, queue included; then it ends with `finish_reason:
    /// "timeout"` (or 504 `deadline_exceeded` before its first token). Default: no limit.
    pub request_deadline_secs: Option<f64>,
    /// Seconds an idle keep-alive connection, or one that has not sent its request head, stays open
    /// (default 5).
    pub idle_timeout_secs: Option<f64>,
    /// Compute device: `cpu` (default); `cuda:N` (a build with `--features cuda`); `cuda-emu` (the CUDA
    /// kernels on the CPU, a test device: docs/cuda.md).
    pub device: Option<String>,
    /// Activations of NVFP4 decode matmuls: `int8` (default, fast) or `f32` (exact).
    pub activations: Option<String>,
    /// MiB the compute backend may hold in live tensors (activations, recurrent states, KV pages; not
    /// the weights). Past it a step fails with 503 `out_of_memory` and the engine goes on. Default: no cap
    /// on CPU (the machine bounds it); a device's free memory on CUDA.
    pub device_memory_mb: Option<f64>,
    /// GiB of device memory the CUDA backend plans with — dense weights, the KV pool, a reserve, expert
    /// slots per layer from what is left (docs/cuda.md) — at most the device's; default: all of it.
    pub gpu_memory_gb: Option<f64>,
    /// Element type of the KV cache: `f32` (default: the exact path) or `bf16` (half the KV memory, rows
    /// rounded to nearest even as they are written; answers may differ from f32's).
    pub kv_cache_dtype: Option<String>,
    /// Draft tokens per decode step from the checkpoint's MTP head (speculative decoding; 0 or unset:
    /// off; at most 4). Greedy answers are the same tokens either way.
    pub speculative_tokens: Option<usize>,
    /// Tokenizer worker threads (templates, media decoding and preprocessing, detokenization; default 2).
    pub tokenizer_workers: Option<usize>,
    /// Most pixels of all images and frames of one request (default 192 M: ~576 MB decoded).
    pub max_request_pixels: Option<u64>,
    /// Most responses kept for `previous_response_id` (default 1024; 0 keeps none).
    pub max_stored_responses: Option<usize>,
    /// Most MiB of stored conversations, media included (default 256).
    pub max_stored_response_mb: Option<f64>,
    /// Do not serve the web page (`/`, `/dashboard`); the API is unchanged.
    pub no_webui: Option<bool>,
}

impl Settings {
    /// Reads a TOML file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        toml::from_str(&text).with_context(|| format!("parsing {}", path.display()))
    }

    /// `self` with every field `over` sets replaced (CLI over file). Done on the serialized form, so a
    /// field added to `Settings` can never be forgotten here.
    pub fn overlay(self, over: &Settings) -> Self {
        let mut base = serde_json::to_value(&self).expect("settings serialize");
        let top = serde_json::to_value(over).expect("settings serialize");
        if let (Some(b), Some(t)) = (base.as_object_mut(), top.as_object()) {
            for (k, v) in t {
                if !v.is_null() {
                    b.insert(k.clone(), v.clone());
                }
            }
        }
        serde_json::from_value(base).expect("settings round-trip")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_config_file_parses_and_flags_override_it() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/osprey.toml");
        let file = Settings::from_file(&path).expect("config/osprey.toml parses");
        assert_eq!(file.port, Some(8080));
        assert_eq!(file.max_prefill_tokens, Some(512));
        assert_eq!(file.expert_prefetch.as_deref(), Some("off"));
        assert_eq!((file.expert_prefetch_margin, file.expert_prefetch_depth), (Some(2), Some(1)));
        let merged = file.overlay(&Settings { port: Some(9000), ..Settings::default() });
        assert_eq!((merged.port, merged.max_batch_tokens), (Some(9000), Some(2048)));
        assert!(toml::from_str::<Settings>("no_such_key = 1").is_err(), "unknown keys are errors");
        let flags = Settings { disable_prefix_cache: Some(true), prefix_cache_mb: Some(0.5), ..Settings::default() };
        let m = Settings::default().overlay(&flags);
        assert_eq!((m.disable_prefix_cache, m.prefix_cache_mb), (Some(true), Some(0.5)));
    }
}
