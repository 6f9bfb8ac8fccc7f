//! Sparse MoE block (Qwen3.5-MoE `mlp`): softmax router → top-k → renormalised weights → routed experts,
//! plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! Routed experts are reached only through [`ExpertSource`], one expert at a time, never stacked into one
//! tensor: the residency manager (`osprey-experts`) implements it to stream experts from disk. All experts
//! a layer needs for a step are asked for in one `request`, so an implementation can batch its misses, and
//! the shared expert and the already-resident experts are computed while the misses are read.

use std::fmt::Debug;
use std::sync::Arc;

use osprey_backend::{Backend, Tensor};

use super::mlp::{swiglu, Mlp};
use super::{load_linear, place};
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
                        let w = |n: &str, out: usize, inp: usize| ck.linear(&format!("{p}.experts.{e}.{n}"), out, inp);
                        Ok(Arc::new(ExpertWeights {
                            gate: w("gate_proj", inter, hidden)?,
                            up: w("up_proj", inter, hidden)?,
                            down: w("down_proj", hidden, inter)?,
                        }))
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

/// One MoE block.
#[derive(Debug)]
pub struct SparseMoe {
    layer: usize,
    router: Tensor,
    shared: Mlp,
    shared_gate: Tensor,
    cfg: MoeConfig,
}

impl SparseMoe {
    /// Loads the router and shared expert of `{prefix}` onto `b` (routed experts come from an
    /// [`ExpertSource`] and are placed when they arrive).
    pub fn load(
        b: &dyn Backend,
        ck: &Checkpoint,
        prefix: &str,
        layer: usize,
        hidden: usize,
        cfg: MoeConfig,
    ) -> Result<Self> {
        Ok(SparseMoe {
            layer,
            router: load_linear(b, ck, &format!("{prefix}.gate"), cfg.num_experts, hidden)?,
            shared: Mlp::load(b, ck, &format!("{prefix}.shared_expert"), hidden, cfg.shared_intermediate)?,
            shared_gate: load_linear(b, ck, &format!("{prefix}.shared_expert_gate"), 1, hidden)?,
            cfg,
        })
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, experts: &dyn ExpertSource) -> Result<Tensor> {
        let t = x.rows();
        // 1. Route every token (the host learns which experts to fetch); group tokens by expert
        //    (ascending expert id, as transformers accumulates).
        let logits = b.linear(x, &self.router)?;
        let mut by_expert: Vec<(Vec<usize>, Vec<f32>)> = vec![(Vec::new(), Vec::new()); self.cfg.num_experts];
        for (i, (ids, w)) in b.router_topk_with(&logits, self.cfg.top_k, self.cfg.renorm)?.into_iter().enumerate() {
            for (e, wt) in ids.into_iter().zip(w) {
                by_expert[e].0.push(i);
                by_expert[e].1.push(wt);
            }
        }
        let hit: Vec<usize> = (0..self.cfg.num_experts).filter(|&e| !by_expert[e].0.is_empty()).collect();
        // 2. Ask for every routed expert of this layer at once, then compute the shared expert and the
        //    resident experts while a disk-backed source reads the misses.
        let (resident, pending) = experts.request(self.layer, &hit).resident()?;
        let shared = self.shared.forward(b, x)?;
        let sgate = b.linear(x, &self.shared_gate)?;
        // 3. Routed experts on their gathered rows, weighted and scattered back, always accumulated in
        //    ascending expert order (so the answer does not depend on what was resident): a resident
        //    expert after a missing one is kept aside until the gap is filled.
        let mut out = b.zeros_f32(&[t, x.cols()])?;
        let scatter = |out: &mut Tensor, k: usize, d: &Tensor| {
            let (rows, weights) = &by_expert[hit[k]];
            b.scatter_add_rows(out, rows, weights, d);
        };
        let mut done: Vec<Option<Tensor>> = vec![None; hit.len()];
        let mut next = 0; // first expert not yet accumulated
        for (k, handle) in resident.iter().enumerate() {
            let Some(handle) = handle else { continue };
            let d = expert(b, x, &by_expert[hit[k]].0, handle.weights())?;
            if k == next {
                scatter(&mut out, k, &d);
                next += 1;
                while let Some(d) = done.get_mut(next).and_then(Option::take) {
                    scatter(&mut out, next, &d);
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
                    expert(b, x, &by_expert[hit[k]].0, handle.weights())?
                }
            };
            scatter(&mut out, k, &d);
        }
        b.add_sigmoid_gated(&mut out, &shared, &sgate);
        Ok(out)
    }

    /// Bytes of the dense part (router + shared expert).
    pub fn bytes(&self) -> usize {
        self.router.bytes() + self.shared.bytes() + self.shared_gate.bytes()
    }
}

/// One expert on its gathered rows: `[rows, hidden]`. Its weights, which may have just arrived from
/// disk, are placed on the backend here (the CPU backend keeps the host handle; a device backend
/// uploads or finds its slot).
fn expert(b: &dyn Backend, x: &Tensor, rows: &[usize], w: &ExpertWeights) -> Result<Tensor> {
    let xs = b.gather_rows(x, rows)?;
    let (gate, up, down) = (place(b, w.gate.clone())?, place(b, w.up.clone())?, place(b, w.down.clone())?);
    swiglu(b, &xs, (&gate, &up, &down))
}
