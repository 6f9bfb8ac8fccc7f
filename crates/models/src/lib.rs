//! # osprey-models — model definitions and checkpoint loading
//!
//! Brief overview: reads real Hugging Face model directories (`config.json`, safetensors single-file or
//! sharded, memory-mapped; f32/bf16/f16; Hub or fused expert layout) and runs the Qwen3.5 / Qwen3.6
//! text decoders (`qwen3_5` dense, `qwen3_5_moe`) on the CPU with transformers-parity numerics.
//!
//! - [`config`]: serde structs with the HF field names; unsupported values are rejected at load.
//! - [`Checkpoint`]: tensor lookup with shape checks; errors name the tensor and both shapes.
//! - [`Qwen35`]: the decoder; [`Qwen35::forward`] runs a batch of sequences, each with any number of new
//!   tokens (prefill chunk or decode token), and advances their [`SeqState`]s.
//! - [`SeqState`] / [`StateSnapshot`]: KV + Gated DeltaNet state per sequence, snapshot and restore.
//! - [`layers`]: shared layers; routed experts sit behind [`ExpertSource`] so they can be streamed.
//!
//! It owns no thread and no actor; the runner actor drives it.

mod checkpoint;
pub mod config;
mod error;
pub mod layers;
pub mod positions;
pub mod quant;
mod quantize_dir;
mod qwen3_5;
mod state;
pub mod vision;

pub use checkpoint::{ByteSource, Checkpoint, TensorLocation, Weight};
pub use config::{ModelConfig, TextConfig};
pub use error::{Error, Result};
pub use layers::moe::{ExpertHandle, ExpertSource, ExpertTicket, ExpertWeights, PendingExperts, ResidentExperts};
pub use quantize_dir::{quantize_dir, QuantizeOptions};
pub use qwen3_5::{ForwardOptions, ForwardOutput, InjectedRows, LogitsWanted, Positions, Qwen35, SeqInput, SeqStep};
pub use state::{KvBlock, SeqState, StateSnapshot};
