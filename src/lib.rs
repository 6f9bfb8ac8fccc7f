//! The `osprey` application: wires the actors into a serving engine. The binary (`main.rs`) parses the
//! command line; this library builds the graph so integration tests start exactly what `osprey serve`
//! starts.

pub mod about;
pub mod default_model;
pub mod gemm_calibration;
pub mod hub;
pub mod memory_plan;
pub mod pull;
pub mod settings;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use osprey_models::{Checkpoint, ModelConfig};
use osprey_scheduler::SchedulerConfig;
use osprey_server::{Engine, Limits, ServerConfig};

pub use osprey_server::{Bound, Phase};
use osprey_tokenizer::TokenizerCore;

pub use settings::Settings;

/// osprey's own cache directory: `$OSPREY_CACHE_DIR`, else `~/.cache/osprey` (the embedded model's
/// files, the prefill GEMM calibration); `None` without either.
pub fn cache_root() -> Option<PathBuf> {
    std::env::var_os("OSPREY_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/osprey")))
}

/// Progress of a long step (loading weights, quantizing): a bar on stderr when stderr is a terminal
/// (`indicatif` draws nothing otherwise), and one log line when it starts and one when it ends, so a
/// log file or a pipe gets two lines instead of thousands of carriage-return redraws.
#[derive(Debug)]
pub struct Progress {
    label: &'static str,
    bar: Option<indicatif::ProgressBar>,
    started: Instant,
}

impl Progress {
    /// A progress for `label`; nothing is drawn or logged until the first update.
    pub fn new(label: &'static str) -> Self {
        Progress { label, bar: None, started: Instant::now() }
    }

    /// `done` of `total` items are done.
    pub fn update(&mut self, done: usize, total: usize) {
        let bar = self.bar.get_or_insert_with(|| {
            tracing::info!(items = total, "{}: started", self.label);
            self.started = Instant::now();
            let b =
                indicatif::ProgressBar::with_draw_target(Some(total as u64), indicatif::ProgressDrawTarget::stderr());
            if let Ok(style) = indicatif::ProgressStyle::with_template("{msg} [{bar:30}] {pos}/{len}") {
                b.set_style(style.progress_chars("=> "));
            }
            b.set_message(self.label);
            b
        });
        bar.set_position(done as u64);
        if done >= total && !bar.is_finished() {
            bar.finish_and_clear();
            tracing::info!(items = total, secs = self.started.elapsed().as_secs_f64(), "{}: done", self.label);
        }
    }
}

/// The residency manager when the settings ask for a RAM budget and the model has routed experts.
fn expert_source(
    settings: &Settings,
    (cfg, ck, guessing): (&ModelConfig, &Checkpoint, bool),
    wrap_reader: Option<ReaderLayer>,
    backend: &dyn osprey_backend::Backend,
) -> Result<Option<osprey_experts::ResidentSet>> {
    use osprey_experts::{Budget, ExpertIndex, Policy, ReaderKind};
    let budget = match (settings.expert_ram_experts, settings.expert_ram_gb) {
        (Some(n), _) => Budget::PerLayer(n.max(1)),
        (None, Some(gb)) => Budget::Bytes((gb.max(0.0) * 1e9) as usize),
        (None, None) => return Ok(None),
    };
    let Some(layout) = osprey_models::expert_layout(cfg, ck)? else {
        tracing::warn!("--expert-ram-* given but the model has no routed experts; ignored");
        return Ok(None);
    };
    let index = ExpertIndex::build(ck, &layout.prefixes, layout.num_experts, layout.hidden, layout.intermediate)?;
    let kind = match settings.expert_reader.as_deref() {
        None | Some("auto") => None,
        Some("io_uring") => Some(ReaderKind::IoUring),
        Some("pread") => Some(ReaderKind::Pread),
        Some(other) => anyhow::bail!("unknown expert reader {other:?} (auto, io_uring, pread)"),
    };
    let policy = match settings.expert_policy.as_deref() {
        None | Some("lru") => Policy::Lru,
        Some("lfu") => Policy::LfuDecay { half_life: 64 },
        Some(other) => anyhow::bail!("unknown expert policy {other:?} (lru, lfu)"),
    };
    let mut reader = osprey_experts::open_reader(&index.files, kind)?;
    if let Some(wrap) = wrap_reader {
        reader = wrap(reader);
    }
    let total: usize = index.keys().map(|k| index.expert_bytes(k)).sum();
    tracing::info!(?budget, ?policy, reader = ?reader.kind(), expert_bytes = total, "streaming experts from disk");
    let top_k = cfg.text.moe()?.map_or(0, |m| m.top_k);
    let opts = osprey_experts::Options {
        warmup: settings.expert_warmup.unwrap_or(false),
        prefetch_cap: if guessing {
            osprey_experts::Options::prefetch_cap_for(&index, top_k, margin(settings), depth(settings))
        } else {
            0
        },
    };
    Ok(Some(osprey_experts::spawn(index, reader, (budget, policy), opts, backend)))
}

fn margin(settings: &Settings) -> usize {
    settings.expert_prefetch_margin.unwrap_or(2)
}

fn depth(settings: &Settings) -> usize {
    settings.expert_prefetch_depth.unwrap_or(1).max(1)
}

/// The read-ahead policy `--expert-prefetch` names (docs/architecture.md, "Read-ahead"); by default the
/// router's guesses, gated by their measured precision (issue 55).
pub const DEFAULT_EXPERT_PREFETCH: &str = "router";

/// The read-ahead policy `--expert-prefetch` names (docs/architecture.md, "Read-ahead").
fn expert_predictor(settings: &Settings) -> Result<Option<Arc<dyn osprey_models::layers::predict::ExpertPredictor>>> {
    let name = settings.expert_prefetch.as_deref().unwrap_or(DEFAULT_EXPERT_PREFETCH);
    Ok(osprey_models::layers::predict::by_name(name, margin(settings))?)
}

/// Wraps the expert reader the server opens (instrumentation, or fault injection in tests); applies only
/// when the settings stream experts from disk.
pub type ReaderLayer = Box<dyn FnOnce(Box<dyn osprey_experts::Reader>) -> Box<dyn osprey_experts::Reader> + Send>;

/// Loads the model and starts the tokenizer, vision, runner and scheduler actors and the HTTP server
/// (bound, not yet awaited). Returns the server future and the address it listens on.
/// The directory `osprey serve` serves: `settings.model`, else the embedded default model (written to the
/// cache directory on first use).
pub fn model_dir(settings: &Settings) -> Result<PathBuf> {
    match &settings.model {
        // A directory, or a Hugging Face id found in the local cache (hub.rs).
        Some(d) => hub::resolve(d),
        None => {
            let d = default_model::materialize()?;
            tracing::info!(dir = %d.display(), "no --model given: serving the embedded default model");
            Ok(d)
        }
    }
}

pub fn start(settings: &Settings, model_dir: &Path) -> Result<Bound> {
    start_with(settings, model_dir, None)
}

/// `osprey serve`: start, then [`serve`] until a signal or the engine's death.
pub async fn serve_until_signal(settings: &Settings, model_dir: &Path) -> Result<()> {
    let grace = std::time::Duration::from_secs(settings.shutdown_grace_secs.unwrap_or(30));
    serve(start(settings, model_dir)?, grace).await
}

/// Serves a bound server. On SIGTERM or SIGINT it drains: stop accepting connections and requests
/// (health answers 503), let running generations finish for `grace`, then end those still running with
/// an `unavailable` error (streams: an error event and `[DONE]`), and return `Ok` once every connection
/// is closed. A second signal exits at once (status 130).
///
/// If an actor of the engine dies (a panic in the runner, scheduler, vision encoder, prefix cache or
/// expert manager), `/health` answers 503 from that moment, requests are refused, and this returns an
/// error after a short pause (so the clients waiting get their errors), which `osprey serve` turns into
/// exit status 1: a service manager restarts it (`docs/reliability.md` has a systemd unit). Restarting
/// the actors in place would need every in-flight request's state rebuilt; a fresh process is simpler
/// and loses the same requests.
pub async fn serve(bound: Bound, grace: std::time::Duration) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let Bound { server, addr, phase, engine } = bound;
    let handle = server.handle();
    let (mut term, mut int) = (signal(SignalKind::terminate())?, signal(SignalKind::interrupt())?);
    let drain = handle.clone();
    let scheduler = engine.scheduler.clone();
    actix_web::rt::spawn(async move {
        tokio::select! {
            _ = term.recv() => {}
            _ = int.recv() => {}
        }
        tracing::info!(%addr, grace_secs = grace.as_secs(), "shutdown signal: draining (a second signal exits at once)");
        let _ = phase.send(Phase::Draining);
        // No new connections; connections already open stay served, so a request arriving on an idle
        // keep-alive connection gets the draining answer (503 `unavailable`) instead of a closed socket.
        drain.pause().await;
        actix_web::rt::spawn(async move {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
            tracing::warn!("second signal: exiting now");
            std::process::exit(130);
        });
        let deadline = tokio::time::Instant::now() + grace;
        while !engine_idle(&scheduler).await {
            if tokio::time::Instant::now() >= deadline {
                tracing::info!("grace period over: ending the generations still running");
                let _ = phase.send(Phase::Expired);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        drain.stop(true).await;
    });
    tokio::select! {
        served = server => {
            served.context("HTTP server")?;
            tracing::info!("drained; exiting");
            Ok(())
        }
        actor = engine.stopped() => {
            tracing::error!(actor, "an engine actor stopped (see the panic above): /health answers 503; exiting with status 1 for the service manager to restart osprey");
            tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            handle.stop(false).await;
            anyhow::bail!("the engine's {actor} stopped")
        }
    }
}

/// Whether the scheduler holds no request, waiting or running (or is gone).
async fn engine_idle(
    scheduler: &tokio::sync::mpsc::UnboundedSender<osprey_protocol::scheduler::SchedulerCommand>,
) -> bool {
    let (reply, rx) = tokio::sync::oneshot::channel();
    if scheduler.send(osprey_protocol::scheduler::SchedulerCommand::Stats { reply }).is_err() {
        return true;
    }
    rx.await.map_or(true, |s| s.waiting == 0 && s.running == 0)
}

/// The compute backend `--device` names (default `cpu`) at the `--activations` precision (`int8`, also
/// spelled `fast`, the default; or `f32`, also `exact`), logged once.
pub fn open_backend(device: Option<&str>, activations: Option<&str>) -> Result<osprey_backend::BackendRef> {
    open_backend_with(device, activations, None)
}

/// The KV cache's element type from `--kv-cache-dtype` (`f32` when unset).
pub fn kv_cache_dtype(name: Option<&str>) -> Result<osprey_backend::DType> {
    match name.unwrap_or("f32") {
        "f32" | "auto" => Ok(osprey_backend::DType::F32),
        "bf16" => Ok(osprey_backend::DType::BF16),
        other => anyhow::bail!("--kv-cache-dtype {other:?}: expected f32 or bf16"),
    }
}

/// The `--activations` precision: `int8` (also `fast`, the default) or `f32` (also `exact`).
pub fn precision(activations: Option<&str>) -> Result<osprey_backend::Precision> {
    Ok(match activations.unwrap_or("int8") {
        "int8" | "fast" => osprey_backend::Precision::Int8,
        "f32" | "exact" => osprey_backend::Precision::Exact,
        other => anyhow::bail!("--activations {other}: use int8 (the fast default) or f32 (exact)"),
    })
}

/// [`open_backend`] whose live tensors may take at most `memory` bytes (`--device-memory-mb`): an
/// allocation past it fails with `BackendError::OutOfMemory`, which fails that step's requests with 503
/// `out_of_memory` while the engine goes on.
pub fn open_backend_with(
    device: Option<&str>,
    activations: Option<&str>,
    memory: Option<usize>,
) -> Result<osprey_backend::BackendRef> {
    let device: osprey_backend::Device =
        device.unwrap_or("cpu").parse().map_err(|e: String| anyhow::anyhow!(e)).context("--device")?;
    let precision = precision(activations)?;
    let backend = match device {
        osprey_backend::Device::Cpu => match memory {
            Some(bytes) => osprey_backend_cpu::CpuBackend::with_memory_cap(precision, bytes),
            None => osprey_backend_cpu::open(precision),
        },
        osprey_backend::Device::Cuda(n) => osprey_backend_cuda::open(n, precision)?,
        // The CUDA kernels on the CPU: a test device, with the memory cap as its device memory.
        osprey_backend::Device::CudaEmu => {
            osprey_backend_cuda::open_emulated_with(memory.unwrap_or(24 << 30), precision)
        }
    };
    tracing::info!(device = %device, backend = backend.describe(), "compute backend");
    Ok(backend)
}

/// A model loaded for serving: its config, weights on the backend, vision tower, and the expert
/// residency manager when experts stream from disk.
struct Loaded {
    cfg: ModelConfig,
    model: osprey_models::Model,
    tower: Option<osprey_models::vision::VisionTower>,
    media: Option<osprey_models::MediaSupport>,
    experts: Option<osprey_experts::ResidentSet>,
}

/// Loads the model of `model_dir` as the settings say (device, memory, expert and PLE budgets, the draft
/// head), with a progress bar.
fn load_for_serving(settings: &Settings, model_dir: &Path, wrap_reader: Option<ReaderLayer>) -> Result<Loaded> {
    let cfg = ModelConfig::from_dir(model_dir).with_context(|| format!("reading {}", model_dir.display()))?;
    let ck = Checkpoint::open(model_dir)?;
    let planned = settings.gpu_memory_gb.map(|gb| (gb.max(0.0) * (1u64 << 30) as f64) as u64);
    let memory = settings.device_memory_mb.map(|mb| (mb.max(0.0) * 1048576.0) as usize).or(planned.map(|b| b as usize));
    let backend = open_backend_with(settings.device.as_deref(), settings.activations.as_deref(), memory)?;
    let predictor = expert_predictor(settings)?;
    let experts = expert_source(settings, (&cfg, &ck, predictor.is_some()), wrap_reader, backend.as_ref())?;
    let source = experts.as_ref().map(|s| Arc::new(s.clone()) as Arc<dyn osprey_models::ExpertSource>);
    let ple = settings.ple_ram_gb.map_or(osprey_models::DEFAULT_PLE_RAM_BYTES, |gb| (gb.max(0.0) * 1e9) as u64);
    // On a device, the memory plan sizes the expert slots; on the host, experts are read where they lie.
    let expert_slots = match backend.stats().memory_total {
        Some(device) => {
            let total = planned.map_or(device, |p| p.min(device));
            let (_, kv_tokens) = context_and_kv(settings, cfg.text.max_position_embeddings);
            let kv_elem = kv_cache_dtype(settings.kv_cache_dtype.as_deref())?.size();
            let plan = memory_plan::MemoryPlan::for_model(total, &cfg, &ck, kv_tokens, kv_elem)?;
            tracing::info!("memory plan: {}", plan.describe());
            (plan.slots_per_layer < plan.num_experts).then_some(plan.slots_per_layer)
        }
        None => None,
    };
    let opts = osprey_models::LoadOptions {
        experts: source,
        expert_slots,
        ple_budget: osprey_models::PleBudget::new(ple),
        draft_head: settings.speculative_tokens.unwrap_or(0) > 0,
        // Guesses matter where experts stream from disk, or where a device's slots hold fewer experts than
        // a layer has (guesses held in RAM are uploaded into them ahead of their layer).
        predictor: if experts.is_some() || expert_slots.is_some() { predictor } else { None },
        guess_uploads: expert_slots.is_some(),
        prefetch_depth: depth(settings),
    };
    let mut progress = Progress::new("loading weights");
    let model = osprey_models::load_with_options(&cfg, &ck, opts, backend.clone(), &mut |d, n| progress.update(d, n))?;
    let (tower, media) = match osprey_models::load_vision(&cfg, &ck, backend)? {
        Some((t, media)) => (Some(t), Some(media)),
        None => (None, None),
    };
    Ok(Loaded { cfg, model, tower, media, experts })
}

/// The request limits: the settings' values over the defaults.
fn limits(settings: &Settings) -> Limits {
    let defaults = Limits::default();
    Limits {
        max_media_per_request: settings.max_media_per_request.unwrap_or(defaults.max_media_per_request),
        max_media_bytes: settings.max_media_bytes.unwrap_or(defaults.max_media_bytes),
        max_image_pixels: settings.max_image_pixels.unwrap_or(defaults.max_image_pixels),
        max_video_frames: settings.max_video_frames.unwrap_or(defaults.max_video_frames),
        max_request_pixels: settings.max_request_pixels.unwrap_or(defaults.max_request_pixels),
        allowed_media_domains: settings.allowed_media_domains.clone().unwrap_or_default(),
        allowed_local_media_path: settings.allowed_local_media_path.clone(),
        max_body_bytes: defaults.max_body_bytes,
        max_stored_responses: settings.max_stored_responses.unwrap_or(defaults.max_stored_responses),
        max_stored_response_bytes: settings
            .max_stored_response_mb
            .map_or(defaults.max_stored_response_bytes, |mb| (mb.max(0.0) * 1048576.0) as usize),
    }
}

/// The context length (`--context-len`, else the model's) and the KV pool's capacity in tokens
/// (`--kv-capacity-tokens`, else four contexts): what the runner allocates and the memory plan reserves.
fn context_and_kv(settings: &Settings, max_position_embeddings: usize) -> (usize, usize) {
    let context_len = settings.context_len.unwrap_or(max_position_embeddings.max(1));
    (context_len, settings.kv_capacity_tokens.unwrap_or(4 * context_len))
}

/// The scheduler's configuration from the settings, for a KV pool of `kv_capacity_tokens` in pages of
/// `page_size` (the context length bounds each request's budget, made by the server: `Limits::budget`).
fn scheduler_config(settings: &Settings, kv_capacity_tokens: usize, page_size: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_batch_tokens: settings.max_batch_tokens.unwrap_or(2048),
        max_prefill_tokens: settings.max_prefill_tokens.unwrap_or(512),
        max_running_requests: settings.max_running_requests.unwrap_or(16),
        kv_capacity_tokens,
        page_size,
        // Snapshots on a grid of whole pages.
        snapshot_interval: settings.snapshot_interval.unwrap_or(64).max(page_size) / page_size * page_size,
        prefix_cache: !settings.disable_prefix_cache.unwrap_or(false),
        max_queued_requests: settings.max_queued_requests.unwrap_or(256),
        max_queue_wait: settings.max_queue_wait_secs.filter(|s| *s > 0.0).map(std::time::Duration::from_secs_f64),
    }
}

/// The model id the server lists and requests name: `--served-model-name`, else the Hugging Face id the
/// model was given by (`org/name`, not its snapshot's commit hash), else the directory's name.
fn served_model_id(settings: &Settings, model_dir: &Path) -> String {
    settings.served_model_name.clone().unwrap_or_else(|| {
        settings.model.as_deref().and_then(hub::served_name).unwrap_or_else(|| {
            model_dir.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_else(|| "osprey".into())
        })
    })
}

/// [`start`] with the expert reader wrapped by `wrap_reader`.
pub fn start_with(settings: &Settings, model_dir: &Path, wrap_reader: Option<ReaderLayer>) -> Result<Bound> {
    let t0 = Instant::now();
    let kv_dtype = kv_cache_dtype(settings.kv_cache_dtype.as_deref())?;
    let Loaded { cfg, model, tower, media, experts } = load_for_serving(settings, model_dir, wrap_reader)?;
    let info = model.info().clone();
    let (context_len, kv_capacity_tokens) = context_and_kv(settings, info.max_position_embeddings);
    let vocab = info.vocab_size;
    let mut eos = info.eos_token_ids.clone();
    let tok = TokenizerCore::from_dir(model_dir, tower.is_some())?;
    if let Some((id, token)) = tok.tokenizer().beyond_vocabulary(vocab) {
        let token: String = token.chars().take(64).collect();
        anyhow::bail!(
            "tokenizer.json has token {token:?} with id {id}, beyond the model's vocabulary of {vocab} (config.json \
             vocab_size): every request with it would fail, so the model is refused"
        );
    }
    let max_token_bytes = tok.tokenizer().max_token_bytes();
    let template_kwargs = tok.template_variables();
    if let Some(im_end) = tok.tokenizer().token_id("<|im_end|>") {
        if !eos.contains(&im_end) {
            eos.push(im_end);
        }
    }
    let vision = tower.map(|t| osprey_vision::spawn(t, settings.vision_cache_mb.unwrap_or(512) << 20));
    let has_vision = vision.is_some();
    let page_size = settings.page_size.unwrap_or(16).max(1);
    let kv_pages = kv_capacity_tokens.div_ceil(page_size);
    let runner =
        osprey_runner::Runner::with_kv(model, vision.as_ref().map(|v| v.sender()), (page_size, kv_pages), kv_dtype)
            .with_speculative(settings.speculative_tokens.unwrap_or(0))?;
    let runner = osprey_runner::spawn(runner);
    let sched_cfg = scheduler_config(settings, kv_capacity_tokens, page_size);
    let prefix_on = sched_cfg.prefix_cache;
    let prefix = prefix_on.then(|| {
        osprey_prefix_cache::spawn(
            page_size,
            (settings.prefix_cache_mb.unwrap_or(1024.0).max(0.0) * 1048576.0) as usize,
        )
    });
    let scheduler = osprey_scheduler::spawn(sched_cfg, runner, prefix.clone());
    let tok = tok.with_grammar_vocab(vocab, eos.clone());
    let tokenizer = osprey_tokenizer::spawn_pool(tok, settings.tokenizer_workers.unwrap_or(2));
    let model_id = served_model_id(settings, model_dir);
    let server_cfg = ServerConfig {
        model_id: model_id.clone(),
        context_len,
        kv_capacity_tokens: kv_pages * page_size,
        vocab_size: vocab,
        max_token_bytes,
        vision: has_vision,
        video: media.is_some_and(|m| m.video),
        api_key: settings.api_key.clone(),
        allowed_hosts: settings.allowed_hosts.clone().unwrap_or_default(),
        allowed_origins: settings.allowed_origins.clone().unwrap_or_default(),
        shutdown_grace_secs: settings.shutdown_grace_secs.unwrap_or(30),
        body_timeout_secs: settings.body_timeout_secs.unwrap_or(30.0),
        request_deadline_secs: settings.request_deadline_secs.filter(|s| *s > 0.0),
        idle_timeout_secs: settings.idle_timeout_secs.unwrap_or(5.0),
        eos_token_ids: eos,
        template_kwargs,
        limits: limits(settings),
        webui: !settings.no_webui.unwrap_or(false),
        about: osprey_server::ModelAbout {
            decoder_layers: info.num_layers,
            ..about::model_about(model_dir, &cfg.model_type, cfg.quantized)
        },
    };
    let engine = Engine {
        tokenizer: tokenizer.sender(),
        scheduler: scheduler.sender(),
        vision: vision.map(|v| v.sender()),
        prefix,
        experts: experts.map(|e| Arc::new(e) as Arc<dyn osprey_protocol::experts::ExpertStats>),
    };
    let addr = format!("{}:{}", settings.host.as_deref().unwrap_or("127.0.0.1"), settings.port.unwrap_or(8080));
    let served = osprey_server::bind(server_cfg, engine, &addr, settings.http_workers.unwrap_or(2))?;
    let bound = served.addr;
    if !bound.ip().is_loopback() && settings.api_key.is_none() {
        tracing::warn!(
            %bound,
            "listening beyond this machine without an API key: anyone who can reach {bound} can generate \
             (set --api-key; Host names other than localhost and IP addresses are refused unless in --allowed-hosts)"
        );
    }
    tracing::info!(
        model = %model_dir.display(),
        id = %model_id,
        model_type = %cfg.model_type,
        family = info.family,
        layers = info.num_layers,
        vision = has_vision,
        context = context_len,
        prefix_cache = prefix_on,
        secs = t0.elapsed().as_secs_f64(),
        "model loaded; listening on http://{bound}"
    );
    Ok(served)
}

#[cfg(test)]
mod tests {
    use super::{served_model_id, Settings};
    use std::path::Path;

    /// Issue 49: `serve --model org/name` listed the snapshot's commit hash as the model id, and a
    /// request naming `org/name` got 404.
    #[test]
    fn a_model_given_by_hub_id_is_served_under_that_id() {
        let snap = Path::new("/cache/models--Org--tiny/snapshots/0123456789abcdef0123456789abcdef01234567");
        let by_id = Settings { model: Some("Org/tiny@main".into()), ..Settings::default() };
        assert_eq!(served_model_id(&by_id, snap), "Org/tiny");
        let by_dir = Settings { model: Some(std::env::temp_dir()), ..Settings::default() };
        assert_eq!(served_model_id(&by_dir, Path::new("/models/qwen-tiny")), "qwen-tiny");
        let named = Settings { served_model_name: Some("mine".into()), ..by_id };
        assert_eq!(served_model_id(&named, snap), "mine");
    }

    #[test]
    fn a_device_this_build_cannot_drive_is_refused_by_name() {
        // No driver here (and without the `cuda` feature, no driver layer): a clear error either way.
        let e = super::open_backend(Some("cuda:1"), None).expect_err("no CUDA device here").to_string();
        assert!(e.contains("cuda:1") && e.contains("--device cpu"), "{e}");
        let cpu = super::open_backend(Some("cpu"), Some("f32")).expect("cpu");
        assert_eq!(cpu.device(), osprey_backend::Device::Cpu);
    }

    /// `--device cuda-emu` opens the CUDA backend on its emulated device, which serves a fixture model:
    /// its greedy choice after a prompt is the CPU backend's (parity in detail: crates/models' cuda_emu).
    #[test]
    fn the_emulated_cuda_device_serves_a_fixture_model() {
        use osprey_models::{LogitsWanted, SeqInput, SeqStep};
        let emu = super::open_backend(Some("cuda-emu"), None).expect("cuda-emu");
        assert_eq!(emu.device(), osprey_backend::Device::CudaEmu);
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/models/qwen3_5_moe-tiny");
        let argmax = |backend| {
            let m = osprey_models::load_on(&dir, backend).expect("load");
            let mut st = m.new_state();
            let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&[11, 22, 33, 44, 55]) };
            let l = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward").logits.remove(0);
            l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i).expect("logits")
        };
        assert_eq!(argmax(emu), argmax(super::open_backend(Some("cpu"), Some("f32")).expect("cpu")));
    }
}
