//! Guessing the next MoE layer's experts while this one computes, so a disk-backed expert source can read
//! them before they are asked for (issue 36). A guess only moves experts between tiers: the layer's own
//! router decides what is computed, so answers never depend on it.
//!
//! Policies behind [`ExpertPredictor`]: [`NextRouter`] applies the next layer's router to this layer's
//! (normed) input — the residual stream changes little from one layer to the next — and takes each
//! token's top `k + margin` (with a depth of 2, also the router of the layer after it:
//! [`Ahead::distance`]); [`PreviousStep`] takes the experts the next layer routed to at the previous
//! step; [`Union`] both. [`Replay`] reads a recorded trace (`osprey bench experts --prefetch oracle`).

use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use osprey_backend::{Backend, DType, ExpertKey, HostVec, Tensor};

use crate::error::{Error, Result};

/// What a predictor may look at while layer `layer` computes, to guess layer `next`'s experts.
#[derive(Debug)]
pub struct Ahead<'a> {
    /// The layer computing now.
    pub layer: usize,
    /// The MoE layer after it (the one to guess for; the first, at the next step, after the last).
    pub next: usize,
    /// `next` is the first layer at the next step: the next token's input, which this step has not seen.
    pub wraps: bool,
    /// How many MoE layers ahead `next` is (1: the one right after `layer`).
    pub distance: usize,
    /// Experts per token.
    pub top_k: usize,
    b: &'a dyn Backend,
    /// This layer's MoE input `[T, hidden]` (normed).
    x: &'a Tensor,
    /// The next layer's router `[experts, hidden]`.
    router: &'a Tensor,
}

impl<'a> Ahead<'a> {
    /// What layer `layer` shows of itself for a guess at `next`, the MoE layer right after it.
    pub fn new(
        b: &'a dyn Backend,
        (layer, next): (usize, usize),
        top_k: usize,
        x: &'a Tensor,
        router: &'a Tensor,
    ) -> Self {
        Ahead { layer, next, wraps: next <= layer, distance: 1, top_k, b, x, router }
    }

    /// The same, for a `next` that is `distance` MoE layers ahead.
    pub fn at_distance(mut self, distance: usize) -> Self {
        self.distance = distance.max(1);
        self
    }

    /// The next layer's router applied to this layer's input: each token's top `n` experts, all tokens
    /// together, ascending (one small product and one download of `[T, n]` ids).
    pub fn router_top(&self, n: usize) -> Result<Vec<ExpertKey>> {
        let experts = self.router.rows();
        let logits = self.b.linear(self.x, self.router)?;
        let routing = self.b.route(&logits, n.clamp(1, experts), false)?;
        let ids = match self.b.download(&routing.ids)? {
            HostVec::I32(v) => v,
            _ => {
                return Err(Error::Backend(osprey_backend::BackendError::DType {
                    expected: DType::I32,
                    got: routing.ids.dtype(),
                }))
            }
        };
        let mut out: Vec<ExpertKey> =
            ids.into_iter().filter_map(|e| usize::try_from(e).ok()).map(|e| ExpertKey::new(self.next, e)).collect();
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }
}

/// A read-ahead policy.
pub trait ExpertPredictor: Debug + Send + Sync {
    /// Layer `layer`'s routing this step: every expert a token routes to, ascending (called before
    /// [`ExpertPredictor::predict`] for the same layer).
    fn observe(&self, _layer: usize, _touched: &[ExpertKey]) {}

    /// Experts of `a.next` to read ahead, most wanted first (the source may read only a prefix).
    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>>;
}

/// The next layer's router on this layer's input: each token's top `k + margin` (no guess for the first
/// layer of the next step).
#[derive(Debug, Clone, Copy)]
pub struct NextRouter {
    /// Experts per token beyond `k`.
    pub margin: usize,
}

impl ExpertPredictor for NextRouter {
    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>> {
        if a.wraps {
            // The next token's first layer sees a new embedding: this input says nothing of it (measured
            // at chance, docs/benchmarks.md).
            return Ok(Vec::new());
        }
        a.router_top(a.top_k + self.margin)
    }
}

/// The experts the next layer routed to at the previous step.
#[derive(Debug, Default)]
pub struct PreviousStep {
    last: Mutex<Vec<Vec<ExpertKey>>>,
}

impl PreviousStep {
    fn last(&self, layer: usize) -> Vec<ExpertKey> {
        let last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        last.get(layer).cloned().unwrap_or_default()
    }
}

impl ExpertPredictor for PreviousStep {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        let mut last = self.last.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if last.len() <= layer {
            last.resize(layer + 1, Vec::new());
        }
        last[layer] = touched.to_vec();
    }

    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>> {
        Ok(self.last(a.next))
    }
}

/// [`NextRouter`]'s guess first, then [`PreviousStep`]'s that it lacks.
#[derive(Debug)]
pub struct Union {
    router: NextRouter,
    previous: PreviousStep,
}

impl Union {
    /// With the router's `margin`.
    pub fn new(margin: usize) -> Self {
        Union { router: NextRouter { margin }, previous: PreviousStep::default() }
    }
}

impl ExpertPredictor for Union {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        self.previous.observe(layer, touched);
    }

    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>> {
        let mut out = self.router.predict(a)?;
        for e in self.previous.predict(a)? {
            if !out.contains(&e) {
                out.push(e);
            }
        }
        Ok(out)
    }
}

/// Guesses exactly what the next layer routes to, from a recorded routing trace of the same prompt
/// (greedy decoding routes the same at every budget): the read-ahead pipeline's ceiling, apart from any
/// predictor (`bench experts --prefetch oracle`, and the tests). Each routing report moves it one entry
/// along the trace.
#[derive(Debug)]
pub struct Replay {
    /// Per MoE step, in order: the experts it routed to (all of one layer).
    trace: Vec<Vec<ExpertKey>>,
    /// The entry the next reported routing is.
    at: AtomicUsize,
}

impl Replay {
    /// Over `trace` (per MoE step, the layer and the experts it routed to, as a trace file holds it).
    pub fn new(trace: Vec<(usize, Vec<usize>)>) -> Self {
        let trace = trace.into_iter().map(|(l, es)| es.into_iter().map(|e| ExpertKey::new(l, e)).collect()).collect();
        Replay { trace, at: AtomicUsize::new(0) }
    }
}

impl ExpertPredictor for Replay {
    fn observe(&self, _layer: usize, _touched: &[ExpertKey]) {
        self.at.fetch_add(1, Ordering::Relaxed);
    }

    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>> {
        Ok(match self.trace.get(self.at.load(Ordering::Relaxed) + a.distance - 1) {
            Some(experts) if experts.first().is_some_and(|k| k.layer() == a.next) => experts.clone(),
            _ => Vec::new(),
        })
    }
}

/// A read-ahead policy by name, as `--expert-prefetch` takes it: `router`, `previous`, `union` (`off`
/// and `none` are no policy).
pub fn by_name(name: &str, margin: usize) -> Result<Option<Arc<dyn ExpertPredictor>>> {
    Ok(match name {
        "off" | "none" => None,
        "router" => Some(Arc::new(NextRouter { margin })),
        "previous" => Some(Arc::new(PreviousStep::default())),
        "union" => Some(Arc::new(Union::new(margin))),
        other => {
            return Err(Error::Unsupported(format!(
                "unknown expert prefetch policy {other:?} (off, router, previous, union)"
            )))
        }
    })
}
