//! Hyper-connections (`Qwen4ExpTextGatedResidual`): the residual stream is `hc` copies of the hidden
//! state. Before a block, a grouped RMSNorm of the streams, a low-rank mixer `sigmoid(W_up ·
//! silu(W_down · x̂ / hc))` and the mean over streams of `mixer ⊙ x̂` give the block's input (this replaces
//! input_layernorm); `2·sigmoid(W_inject · x̂ / hc)` gives how much of the block's output each stream
//! takes. The final mixer is the same without injection (and there is no final norm).

use osprey_backend::{Backend, Tensor};

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::layers::{load_linear, load_vector};

#[derive(Debug)]
pub(crate) struct HyperConnection {
    norm: Tensor,
    down: Tensor,
    up: Tensor,
    inject: Option<Tensor>,
    hc: usize,
    hidden: usize,
    eps: f32,
}

impl HyperConnection {
    /// Loads `{prefix}.{hc_norm, input_mix_weight_down, input_mix_weight_up[, block_inject_weight]}`.
    pub(crate) fn load(
        b: &dyn Backend,
        ck: &Checkpoint,
        prefix: &str,
        (hidden, hc, lowrank): (usize, usize, usize),
        inject: bool,
        eps: f32,
    ) -> Result<Self> {
        let wide = hc * hidden;
        Ok(HyperConnection {
            norm: load_vector(b, ck, &format!("{prefix}.hc_norm.weight"), wide)?,
            down: load_linear(b, ck, &format!("{prefix}.input_mix_weight_down"), lowrank, wide)?,
            up: load_linear(b, ck, &format!("{prefix}.input_mix_weight_up"), wide, lowrank)?,
            inject: if inject {
                Some(load_linear(b, ck, &format!("{prefix}.block_inject_weight"), hc, wide)?)
            } else {
                None
            },
            hc,
            hidden,
            eps,
        })
    }

    /// The block input `[n, hidden]` of the streams `x [n, hc·hidden]`, and the injection weights
    /// `[n, hc]` (none for the final mixer).
    pub(crate) fn enter(&self, b: &dyn Backend, x: &Tensor) -> Result<(Tensor, Option<Tensor>)> {
        let mut xn = x.clone();
        b.rms_norm_grouped(&mut xn, &self.norm, self.hidden, self.eps);
        let inv = 1.0 / self.hc as f32;
        let mut d = b.linear(&xn, &self.down)?;
        b.scale(&mut d, inv);
        b.silu(&mut d);
        let mut m = b.linear(&d, &self.up)?;
        b.sigmoid(&mut m);
        let input = b.hc_combine(&m, &xn, self.hc)?;
        let inj = match &self.inject {
            Some(w) => {
                let mut i = b.linear(&xn, w)?;
                b.scale(&mut i, inv);
                b.sigmoid(&mut i);
                b.scale(&mut i, 2.0);
                Some(i)
            }
            None => None,
        };
        Ok((input, inj))
    }

    /// Bytes of weights.
    pub(crate) fn bytes(&self) -> usize {
        self.norm.bytes() + self.down.bytes() + self.up.bytes() + self.inject.as_ref().map_or(0, Tensor::bytes)
    }
}
