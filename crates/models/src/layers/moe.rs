//! Sparse MoE block (Qwen3.5-MoE `mlp`): softmax router → top-k → renormalised weights → routed experts,
//! plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! Routed experts are reached only through [`ExpertSource`], one expert at a time, never stacked into one
//! tensor: the residency manager (a later crate) implements it to stream experts from disk. All experts a
//! layer needs for a step are asked for in one `fetch`, so an implementation can batch its misses, and the
//! shared expert is computed before the routed ones so reads can overlap it.

use std::fmt::Debug;
use std::sync::Arc;

use osprey_kernels::{sigmoid, silu};

use super::linear;
use super::mlp::Mlp;
use crate::checkpoint::{Checkpoint, Weight};
use crate::config::MoeConfig;
use crate::error::Result;

/// The three projections of one routed expert.
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `[inter, hidden]`.
    pub gate: Weight,
    /// `[inter, hidden]`.
    pub up: Weight,
    /// `[hidden, inter]`.
    pub down: Weight,
}

/// A held expert: the weights stay valid (and, for a residency manager, resident) until it is dropped.
#[derive(Debug)]
pub struct ExpertHandle {
    weights: Arc<ExpertWeights>,
    /// Whatever the source needs to release on drop (a lease); `None` for always-resident experts.
    _lease: Option<Box<dyn Debug + Send + Sync>>,
}

impl ExpertHandle {
    /// Wraps weights with an optional release guard.
    pub fn new(weights: Arc<ExpertWeights>, lease: Option<Box<dyn Debug + Send + Sync>>) -> Self {
        ExpertHandle { weights, _lease: lease }
    }

    /// The expert's weights.
    pub fn weights(&self) -> &ExpertWeights {
        &self.weights
    }
}

/// Experts on their way: `wait` returns the handles (reads may be in flight until then).
pub struct ExpertTicket(Box<dyn FnOnce() -> Result<Vec<ExpertHandle>> + Send>);

impl Debug for ExpertTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpertTicket")
    }
}

impl ExpertTicket {
    /// An already-available result.
    pub fn ready(r: Result<Vec<ExpertHandle>>) -> Self {
        ExpertTicket(Box::new(move || r))
    }

    /// A result produced by `wait`.
    pub fn new(f: impl FnOnce() -> Result<Vec<ExpertHandle>> + Send + 'static) -> Self {
        ExpertTicket(Box::new(f))
    }

    /// Blocks until the experts are available.
    pub fn wait(self) -> Result<Vec<ExpertHandle>> {
        (self.0)()
    }
}

/// Where routed experts come from.
pub trait ExpertSource: Debug + Send + Sync {
    /// Starts fetching `experts` of `layer` (handles come back in the same order). Called once per
    /// layer per step with every expert the step routes to, so misses can be read in one batch while
    /// the caller computes the shared expert.
    fn request(&self, layer: usize, experts: &[usize]) -> ExpertTicket;

    /// Bytes of one expert's weights, when the source knows them (benchmarks).
    fn expert_bytes(&self) -> Option<usize> {
        None
    }
}

/// Every expert mapped from the checkpoint (the page cache decides what is in RAM).
#[derive(Debug)]
pub struct ResidentExperts {
    /// `[layer][expert]`; layers without experts are empty.
    experts: Vec<Vec<Arc<ExpertWeights>>>,
}

impl ResidentExperts {
    /// Loads the experts of the given MoE layers from either layout: the Hub layout
    /// (`{prefix}.experts.{e}.{gate,up,down}_proj.weight`) or the fused runtime layout
    /// (`{prefix}.experts.gate_up_proj [E, 2I, H]` with gate rows first, `{prefix}.experts.down_proj [E, H, I]`).
    pub fn load(ck: &Checkpoint, layer_prefixes: &[Option<String>], hidden: usize, m: MoeConfig) -> Result<Self> {
        let (e_n, inter) = (m.num_experts, m.intermediate);
        let mut experts = Vec::with_capacity(layer_prefixes.len());
        for prefix in layer_prefixes {
            let Some(p) = prefix else {
                experts.push(Vec::new());
                continue;
            };
            let fused = format!("{p}.experts.gate_up_proj");
            let layer: Vec<Arc<ExpertWeights>> = if ck.contains(&fused) {
                let gu_shape = [e_n, 2 * inter, hidden];
                let down = format!("{p}.experts.down_proj");
                let d_shape = [e_n, hidden, inter];
                (0..e_n)
                    .map(|e| {
                        Ok(Arc::new(ExpertWeights {
                            gate: ck.weight_rows(&fused, &gu_shape, e * 2 * inter, inter, hidden)?,
                            up: ck.weight_rows(&fused, &gu_shape, e * 2 * inter + inter, inter, hidden)?,
                            down: ck.weight_rows(&down, &d_shape, e * hidden, hidden, inter)?,
                        }))
                    })
                    .collect::<Result<_>>()?
            } else {
                (0..e_n)
                    .map(|e| {
                        let mlp = Mlp::load(ck, &format!("{p}.experts.{e}"), hidden, inter)?;
                        Ok(Arc::new(ExpertWeights { gate: mlp.gate, up: mlp.up, down: mlp.down }))
                    })
                    .collect::<Result<_>>()?
            };
            experts.push(layer);
        }
        Ok(ResidentExperts { experts })
    }
}

impl ExpertSource for ResidentExperts {
    fn expert_bytes(&self) -> Option<usize> {
        let w = self.experts.iter().find_map(|l| l.first())?;
        Some(w.gate.bytes() + w.up.bytes() + w.down.bytes())
    }

    fn request(&self, layer: usize, experts: &[usize]) -> ExpertTicket {
        ExpertTicket::ready(Ok(experts
            .iter()
            .map(|&e| ExpertHandle::new(self.experts[layer][e].clone(), None))
            .collect()))
    }
}

/// Top-k routing of one token: expert ids (by descending probability) and renormalised weights.
pub fn route(logits: &[f32], top_k: usize) -> (Vec<usize>, Vec<f32>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let exp: Vec<f32> = logits.iter().map(|l| (l - max).exp()).collect();
    let sum: f32 = exp.iter().sum();
    let probs: Vec<f32> = exp.iter().map(|e| e / sum).collect();
    let mut idx: Vec<usize> = (0..probs.len()).collect();
    // Stable sort: equal probabilities keep the lower expert id first.
    idx.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    idx.truncate(top_k);
    let top: Vec<f32> = idx.iter().map(|&i| probs[i]).collect();
    let s: f32 = top.iter().sum();
    (idx, top.iter().map(|p| p / s).collect())
}

/// One MoE block.
#[derive(Debug)]
pub struct SparseMoe {
    layer: usize,
    router: Weight,
    shared: Mlp,
    shared_gate: Weight,
    cfg: MoeConfig,
}

impl SparseMoe {
    /// Loads the router and shared expert of `{prefix}` (routed experts come from an [`ExpertSource`]).
    pub fn load(ck: &Checkpoint, prefix: &str, layer: usize, hidden: usize, cfg: MoeConfig) -> Result<Self> {
        Ok(SparseMoe {
            layer,
            router: ck.linear(&format!("{prefix}.gate"), cfg.num_experts, hidden)?,
            shared: Mlp::load(ck, &format!("{prefix}.shared_expert"), hidden, cfg.shared_intermediate)?,
            shared_gate: ck.linear(&format!("{prefix}.shared_expert_gate"), 1, hidden)?,
            cfg,
        })
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`.
    pub fn forward(&self, x: &[f32], experts: &dyn ExpertSource) -> Result<Vec<f32>> {
        let h = self.router.cols();
        let t = x.len() / h;
        // 1. Route every token; group tokens by expert (ascending expert id, as transformers accumulates).
        let logits = linear(x, t, &self.router);
        let mut by_expert: Vec<Vec<(usize, f32)>> = vec![Vec::new(); self.cfg.num_experts];
        for i in 0..t {
            let (ids, w) = route(&logits[i * self.cfg.num_experts..(i + 1) * self.cfg.num_experts], self.cfg.top_k);
            for (e, wt) in ids.into_iter().zip(w) {
                by_expert[e].push((i, wt));
            }
        }
        let hit: Vec<usize> = (0..self.cfg.num_experts).filter(|&e| !by_expert[e].is_empty()).collect();
        // 2. Ask for every routed expert of this layer at once, then compute the shared expert (a source
        //    that reads from disk overlaps its reads with this).
        let ticket = experts.request(self.layer, &hit);
        let shared = self.shared.forward(x, t);
        let sgate = linear(x, t, &self.shared_gate);
        let handles = ticket.wait()?;
        // 3. Routed experts on their gathered rows, weighted and scattered back.
        let mut out = vec![0f32; t * h];
        for (e, handle) in hit.iter().zip(&handles) {
            let rows = &by_expert[*e];
            let mut xs = Vec::with_capacity(rows.len() * h);
            for &(i, _) in rows {
                xs.extend_from_slice(&x[i * h..(i + 1) * h]);
            }
            let w = handle.weights();
            let mut g = linear(&xs, rows.len(), &w.gate);
            let u = linear(&xs, rows.len(), &w.up);
            for (a, b) in g.iter_mut().zip(&u) {
                *a = silu(*a) * b;
            }
            let d = linear(&g, rows.len(), &w.down);
            for (j, &(i, wt)) in rows.iter().enumerate() {
                for (o, v) in out[i * h..(i + 1) * h].iter_mut().zip(&d[j * h..(j + 1) * h]) {
                    *o += v * wt;
                }
            }
        }
        for i in 0..t {
            let gs = sigmoid(sgate[i]);
            for (o, s) in out[i * h..(i + 1) * h].iter_mut().zip(&shared[i * h..(i + 1) * h]) {
                *o += gs * s;
            }
        }
        Ok(out)
    }

    /// Bytes of the dense part (router + shared expert).
    pub fn bytes(&self) -> usize {
        self.router.bytes() + self.shared.bytes() + self.shared_gate.bytes()
    }
}

#[cfg(test)]
mod tests {
    use super::route;

    #[test]
    fn route_picks_top_k_and_renormalises() {
        let (ids, w) = route(&[0.0, 2.0, 1.0, 2.0], 2);
        assert_eq!(ids, vec![1, 3]);
        assert!((w[0] - 0.5).abs() < 1e-6 && (w[1] - 0.5).abs() < 1e-6);
        let (ids, w) = route(&[3.0, 0.0, 1.0], 2);
        assert_eq!(ids, vec![0, 2]);
        let e = (2.0f32).exp();
        assert!((w[0] - e / (e + 1.0)).abs() < 1e-6);
    }
}
