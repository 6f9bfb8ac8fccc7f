//! The models crate's error type: everything a user's checkpoint or input can cause.

use std::path::PathBuf;

/// Errors from loading or running a model.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// A JSON file is malformed or lacks a required field.
    #[error("invalid JSON in {path}: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde found.
        #[source]
        source: serde_json::Error,
    },
    /// A safetensors file is malformed.
    #[error("invalid safetensors file {path}: {reason}")]
    Safetensors {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        reason: String,
    },
    /// The checkpoint lacks a tensor the model needs.
    #[error("tensor {name} is missing from the checkpoint")]
    MissingTensor {
        /// Full tensor name.
        name: String,
    },
    /// A tensor has the wrong shape.
    #[error("tensor {name} has shape {found:?}, expected {expected:?}")]
    ShapeMismatch {
        /// Full tensor name.
        name: String,
        /// Shape the config implies.
        expected: Vec<usize>,
        /// Shape in the file.
        found: Vec<usize>,
    },
    /// A tensor has a dtype we cannot compute with.
    #[error("tensor {name} has unsupported dtype {dtype} (supported: F32, BF16, F16)")]
    UnsupportedDType {
        /// Full tensor name.
        name: String,
        /// The dtype in the file.
        dtype: String,
    },
    /// The config asks for something this build does not implement.
    #[error("unsupported model configuration: {0}")]
    Unsupported(String),
    /// The compute backend failed an op (out of device memory, above all).
    #[error(transparent)]
    Backend(#[from] osprey_backend::BackendError),
    /// A request is inconsistent with the model (e.g. a token id beyond the vocabulary).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// A part of the engine failed (the expert residency manager gone, an expert read that failed, an
    /// expert source that broke its contract): not the request's fault.
    #[error("engine failure: {0}")]
    Engine(String),
    /// Media over a configured limit (declared pixels, frames).
    #[error("{0}")]
    MediaLimit(String),
    /// Media this build or model cannot take, said in the client's terms (container formats, too few
    /// frames, frames of different sizes).
    #[error("{0}")]
    InvalidMedia(String),
}

impl Error {
    /// Whether the device (or the host memory cap) ran out of memory: a request fails with 503
    /// `out_of_memory` and the engine goes on, unlike other model errors.
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, Error::Backend(osprey_backend::BackendError::OutOfMemory { .. }))
    }
}

/// Result alias for this crate.
pub type Result<T> = std::result::Result<T, Error>;
