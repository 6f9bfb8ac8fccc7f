//! SwiGLU MLP: `down(silu(gate(x)) · up(x))` (the dense Qwen3.5 MLP and the MoE shared expert).

use osprey_kernels::silu;

use super::linear;
use crate::checkpoint::{Checkpoint, Weight};
use crate::error::Result;

/// Gate, up and down projections.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[inter, hidden]`.
    pub gate: Weight,
    /// `[inter, hidden]`.
    pub up: Weight,
    /// `[hidden, inter]`.
    pub down: Weight,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj.weight`.
    pub fn load(ck: &Checkpoint, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate: ck.linear(&format!("{prefix}.gate_proj"), inter, hidden)?,
            up: ck.linear(&format!("{prefix}.up_proj"), inter, hidden)?,
            down: ck.linear(&format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    /// `x [m, hidden] → [m, hidden]`.
    pub fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut g = linear(x, m, &self.gate);
        let u = linear(x, m, &self.up);
        for (a, b) in g.iter_mut().zip(&u) {
            *a = silu(*a) * b;
        }
        linear(&g, m, &self.down)
    }

    /// Bytes of weights.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}
