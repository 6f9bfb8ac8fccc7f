//! Layers shared by the model families: each owns its weights (placed on the backend at `load`) and runs
//! on a flat batch `x [T, hidden]` whose rows are the tokens of several sequences (see [`Segment`]),
//! computing only through the [`Backend`] seam.

pub mod attention;
pub(crate) mod batch;
pub mod gdn;
pub mod mlp;
pub mod moe;
pub mod predict;
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

/// `x·wᵢᵀ` for each of `N` placed weights of `x`'s width ([`osprey_backend::CoreOps::linear_many`]: one
/// pass over `x` on a device), as an array.
pub fn linears<const N: usize>(b: &dyn Backend, x: &Tensor, ws: [&Tensor; N]) -> Result<[Tensor; N]> {
    b.linear_many(x, &ws)?
        .try_into()
        .map_err(|_| crate::Error::Engine("linear_many returned another count: this is a bug".into()))
}

/// A host weight placed on `b`.
pub fn place(b: &dyn Backend, w: Weight) -> Result<Tensor> {
    Ok(b.place_weight(Arc::new(w))?)
}

/// `{prefix}.weight` as an `[out, inp]` linear placed on `b`.
pub fn load_linear(b: &dyn Backend, ck: &Checkpoint, prefix: &str, out: usize, inp: usize) -> Result<Tensor> {
    place(b, ck.linear(prefix, out, inp)?)
}

/// `parts` (`[rows_i, cols]` each) stacked by rows into one `[Σ rows_i, cols]` tensor.
pub fn stack_rows(b: &dyn Backend, parts: &[&Tensor], cols: usize) -> Result<Tensor> {
    if let [one] = parts {
        return Ok((*one).clone());
    }
    let mut out = b.zeros_f32(&[parts.iter().map(|p| p.rows()).sum(), cols])?;
    let mut at = 0;
    for p in parts {
        b.write_rows(&mut out, at * cols, p, 0..p.rows());
        at += p.rows();
    }
    Ok(out)
}

/// A vector (norm weight, bias) placed on `b`.
pub fn load_vector(b: &dyn Backend, ck: &Checkpoint, name: &str, len: usize) -> Result<Tensor> {
    Ok(b.upload_f32(&ck.vector(name, len)?, &[len])?)
}
