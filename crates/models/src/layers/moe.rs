//! Sparse MoE block (Qwen3.5-MoE `mlp`): softmax router → top-k → renormalised weights → routed experts,
//! plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! Routed experts are reached only through [`ExpertSource`], one expert at a time, never stacked into one
//! tensor: the residency manager (`osprey-experts`) implements it to stream experts from disk. All experts
//! a layer needs for a step are asked for in one `request`, so an implementation can batch its misses, and
//! the shared expert and the already-resident experts are computed while the misses are read.

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

/// The experts of a request still being read: `wait` returns them in request order, skipping those
/// [`ExpertTicket::resident`] already gave.
pub struct PendingExperts(Box<dyn FnOnce() -> Result<Vec<ExpertHandle>> + Send>);

impl Debug for PendingExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingExperts")
    }
}

impl PendingExperts {
    /// Nothing pending.
    pub fn none() -> Self {
        PendingExperts(Box::new(|| Ok(Vec::new())))
    }

    /// Pending experts produced by `f` (blocks until the reads land).
    pub fn new(f: impl FnOnce() -> Result<Vec<ExpertHandle>> + Send + 'static) -> Self {
        PendingExperts(Box::new(f))
    }

    /// Blocks until the missing experts are read.
    pub fn wait(self) -> Result<Vec<ExpertHandle>> {
        (self.0)()
    }
}

type Resident = Result<(Vec<Option<ExpertHandle>>, PendingExperts)>;

/// Experts on their way, in two steps so the caller can work on the resident ones while the misses are
/// read: [`resident`](Self::resident) answers as soon as the source has looked its table up (no I/O).
pub struct ExpertTicket(Box<dyn FnOnce() -> Resident + Send>);

impl Debug for ExpertTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpertTicket")
    }
}

impl ExpertTicket {
    /// Every expert already available.
    pub fn ready(r: Result<Vec<ExpertHandle>>) -> Self {
        ExpertTicket(Box::new(move || Ok((r?.into_iter().map(Some).collect(), PendingExperts::none()))))
    }

    /// `f` returns, per requested expert, the handle if it is resident (`None` if it is being read), and
    /// the pending rest.
    pub fn new(f: impl FnOnce() -> Resident + Send + 'static) -> Self {
        ExpertTicket(Box::new(f))
    }

    /// The resident experts now, and the missing ones to wait for.
    pub fn resident(self) -> Resident {
        (self.0)()
    }

    /// Blocks until every expert is available (request order).
    pub fn wait(self) -> Result<Vec<ExpertHandle>> {
        let (mut have, pending) = self.resident()?;
        let mut rest = pending.wait()?.into_iter();
        have.iter_mut()
            .map(|h| {
                h.take().or_else(|| rest.next()).ok_or_else(|| {
                    crate::error::Error::InvalidInput("an expert source returned too few experts".into())
                })
            })
            .collect()
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
        // 2. Ask for every routed expert of this layer at once, then compute the shared expert and the
        //    resident experts while a disk-backed source reads the misses.
        let (resident, pending) = experts.request(self.layer, &hit).resident()?;
        let shared = self.shared.forward(x, t);
        let sgate = linear(x, t, &self.shared_gate);
        // 3. Routed experts on their gathered rows, weighted and scattered back, always accumulated in
        //    ascending expert order (so the answer does not depend on what was resident): a resident
        //    expert after a missing one is kept aside until the gap is filled.
        let mut out = vec![0f32; t * h];
        let mut done: Vec<Option<Vec<f32>>> = vec![None; hit.len()];
        let mut next = 0; // first expert not yet accumulated
        for (k, handle) in resident.iter().enumerate() {
            let Some(handle) = handle else { continue };
            let d = self.expert(x, &by_expert[hit[k]], handle.weights());
            if k == next {
                scatter(&mut out, h, &by_expert[hit[k]], &d);
                next += 1;
                while let Some(d) = done.get_mut(next).and_then(Option::take) {
                    scatter(&mut out, h, &by_expert[hit[next]], &d);
                    next += 1;
                }
            } else {
                done[k] = Some(d);
            }
        }
        drop(resident);
        let mut read = pending.wait()?.into_iter();
        for k in next..hit.len() {
            let d = match done[k].take() {
                Some(d) => d,
                None => {
                    let handle = read.next().ok_or_else(|| {
                        crate::error::Error::InvalidInput("an expert source returned too few experts".into())
                    })?;
                    self.expert(x, &by_expert[hit[k]], handle.weights())
                }
            };
            scatter(&mut out, h, &by_expert[hit[k]], &d);
        }
        for i in 0..t {
            let gs = sigmoid(sgate[i]);
            for (o, s) in out[i * h..(i + 1) * h].iter_mut().zip(&shared[i * h..(i + 1) * h]) {
                *o += gs * s;
            }
        }
        Ok(out)
    }

    /// One expert on its gathered rows: `[rows, hidden]`.
    fn expert(&self, x: &[f32], rows: &[(usize, f32)], w: &ExpertWeights) -> Vec<f32> {
        let h = self.router.cols();
        let mut xs = Vec::with_capacity(rows.len() * h);
        for &(i, _) in rows {
            xs.extend_from_slice(&x[i * h..(i + 1) * h]);
        }
        let mut g = linear(&xs, rows.len(), &w.gate);
        let u = linear(&xs, rows.len(), &w.up);
        for (a, b) in g.iter_mut().zip(&u) {
            *a = silu(*a) * b;
        }
        linear(&g, rows.len(), &w.down)
    }

    /// Bytes of the dense part (router + shared expert).
    pub fn bytes(&self) -> usize {
        self.router.bytes() + self.shared.bytes() + self.shared_gate.bytes()
    }
}

/// Adds one expert's weighted output rows into `out`.
fn scatter(out: &mut [f32], h: usize, rows: &[(usize, f32)], d: &[f32]) {
    for (j, &(i, wt)) in rows.iter().enumerate() {
        for (o, v) in out[i * h..(i + 1) * h].iter_mut().zip(&d[j * h..(j + 1) * h]) {
            *o += v * wt;
        }
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
