//! # osprey-models — model definitions and checkpoint loading
//!
//! Brief overview: reads real Hugging Face model directories (`config.json`, safetensors single-file or
//! sharded, memory-mapped; f32/bf16/f16/NVFP4; Hub or fused expert layout) and runs the Qwen3.5 / Qwen3.6
//! decoders (`qwen3_5` dense, `qwen3_5_moe`) and `qwen4_exp` (Qwen3.8-Flash-Next), their vision towers and
//! draft heads (MTP), on a compute backend (`osprey-backend`'s seam: the CPU backend, or the CUDA backend
//! on a card or its emulated device) with transformers-parity numerics.
//!
//! - [`config`]: serde structs with the HF field names; unsupported values are rejected at load.
//! - [`Checkpoint`]: tensor lookup with shape checks; errors name the tensor and both shapes.
//! - [`CausalLm`]: the model-family seam the runtime drives; [`CausalLm::forward`] runs a batch of
//!   sequences, each with any number of new tokens (prefill chunk or decode token), and advances their
//!   [`SeqState`]s. [`registry`] maps `config.json` to a family and loads it ([`load_with_options`]);
//!   one directory per family (`qwen3_5/`, `qwen4_exp/`), each with its [`registry::Family`] entry
//!   (`entry.rs`, beside the seam). A family's own counters reach `/metrics` through
//!   [`CausalLm::family_stats`].
//! - [`SeqState`] / [`StateSnapshot`]: KV + Gated DeltaNet state per sequence, snapshot and restore.
//! - [`layers`]: shared layers; routed experts sit behind [`ExpertSource`] so they can be streamed.
//!
//! It owns no thread and no actor; the runner actor drives it.

mod checkpoint;
pub mod config;
mod entry;
mod error;
mod family;
pub mod files;
pub mod kv;
pub mod layers;
mod ple_budget;
pub mod positions;
pub mod quant;
mod quantize_dir;
mod qwen3_5;
mod qwen4_exp;
mod qwen_layout;
pub mod registry;
mod served;
mod state;
pub mod vision;

pub use checkpoint::{ByteSource, Checkpoint, MappedTensor, TensorLocation, Weight};
pub use config::{ModelConfig, TextConfig};
pub use error::{Error, Result};
pub use family::{
    CausalLm, DraftOutput, DraftStep, FamilyStat, ForwardOptions, ForwardOutput, InjectedRows, KvLayout, LmInfo,
    LogitsWanted, Model, Positions, SeqInput, SeqStep, DEFAULT_PAGE_SIZE,
};
pub use kv::{KvPool, PageGeometry, PageRef, PageTable, PoolStats, ReserveError};
pub use layers::moe::{
    ExpertHandle, ExpertSource, ExpertTicket, ExpertWeights, Guess, LayerStep, PendingExperts, ResidentExperts,
};
/// The compute-backend seam the families are written against (re-exported for callers that pick one).
pub use osprey_backend as backend;
pub use osprey_backend::ExpertKey;
pub use quantize_dir::{quantize_dir, QuantizeOptions};
pub use qwen4_exp::{ple_table_rows, PleBudget, PleCounts, PleStats, DEFAULT_PLE_RAM_BYTES};
pub use registry::{
    expert_layout, load_checkpoint, load_on, load_vision, load_with_options, load_with_progress, ExpertLayout,
    LoadOptions, MediaSupport,
};
pub use state::{FamilySnapshot, FamilyState, SeqState, StateSnapshot};
