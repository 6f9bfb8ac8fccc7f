//! Layers shared by the model families: each owns its weights (placed on the backend at `load`) and runs
//! on a flat batch `x [T, hidden]` whose rows are the tokens of several sequences (see [`Segment`]),
//! computing only through the [`Backend`] seam.

pub mod attention;
pub(crate) mod batch;
pub mod gdn;
pub mod mlp;
pub mod moe;
pub mod slots;

use std::sync::Arc;

use osprey_backend::{Backend, Tensor};

use crate::checkpoint::{Checkpoint, Weight};
use crate::error::Result;

/// The rows of one sequence inside a batch.
#[derive(Clone, Copy, Debug)]
pub struct Segment {
    /// First row of the sequence in the batch.
    pub row: usize,
    /// Rows (new tokens) of the sequence in this forward.
    pub len: usize,
    /// Tokens the sequence had fed before this forward.
    pub past: usize,
}

/// A host weight placed on `b`.
pub fn place(b: &dyn Backend, w: Weight) -> Result<Tensor> {
    Ok(b.place_weight(Arc::new(w))?)
}

/// `{prefix}.weight` as an `[out, inp]` linear placed on `b`.
pub fn load_linear(b: &dyn Backend, ck: &Checkpoint, prefix: &str, out: usize, inp: usize) -> Result<Tensor> {
    place(b, ck.linear(prefix, out, inp)?)
}

/// A vector (norm weight, bias) placed on `b`.
pub fn load_vector(b: &dyn Backend, ck: &Checkpoint, name: &str, len: usize) -> Result<Tensor> {
    Ok(b.upload_f32(&ck.vector(name, len)?, &[len])?)
}
