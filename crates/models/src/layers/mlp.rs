//! SwiGLU MLP: `down(silu(gate(x)) · up(x))` (the dense Qwen3.5 MLP and the MoE shared expert).

use osprey_backend::{Backend, Tensor};

use super::load_linear;
use crate::checkpoint::Checkpoint;
use crate::error::Result;

/// Gate, up and down projections, placed.
#[derive(Clone, Debug)]
pub struct Mlp {
    /// `[inter, hidden]`.
    pub gate: Tensor,
    /// `[inter, hidden]`.
    pub up: Tensor,
    /// `[hidden, inter]`.
    pub down: Tensor,
}

impl Mlp {
    /// Loads `{prefix}.{gate,up,down}_proj.weight` onto `b`.
    pub fn load(b: &dyn Backend, ck: &Checkpoint, prefix: &str, hidden: usize, inter: usize) -> Result<Self> {
        Ok(Mlp {
            gate: load_linear(b, ck, &format!("{prefix}.gate_proj"), inter, hidden)?,
            up: load_linear(b, ck, &format!("{prefix}.up_proj"), inter, hidden)?,
            down: load_linear(b, ck, &format!("{prefix}.down_proj"), hidden, inter)?,
        })
    }

    /// `x [m, hidden] → [m, hidden]`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor) -> Result<Tensor> {
        swiglu(b, x, (&self.gate, &self.up, &self.down))
    }

    /// Bytes of weights.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

/// `down(silu(gate(x)) · up(x))` with placed weights (an MLP, or a routed expert).
pub fn swiglu(b: &dyn Backend, x: &Tensor, (gate, up, down): (&Tensor, &Tensor, &Tensor)) -> Result<Tensor> {
    let g = b.linear_swiglu(x, gate, up)?;
    Ok(b.linear(&g, down)?)
}
