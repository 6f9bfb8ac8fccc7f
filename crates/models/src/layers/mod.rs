//! Layers shared by the model families: each owns its weights, is built from a checkpoint in `load`, and
//! runs on a flat batch `x [T, hidden]` whose rows are the tokens of several sequences (see [`Segment`]).

pub mod attention;
pub mod gdn;
pub mod mlp;
pub mod moe;

use osprey_kernels::matmul;

use crate::checkpoint::Weight;

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

/// `x [m, w.cols] · wᵀ → [m, w.rows]`.
pub fn linear(x: &[f32], m: usize, w: &Weight) -> Vec<f32> {
    let mut out = vec![0f32; m * w.rows()];
    matmul(x, m, w.view(), w.rows(), w.cols(), &mut out);
    out
}
