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
    /// together, the most likely first — by the largest routing weight any token gives the expert (one
    /// small product and one download of `[T, n]` ids and weights).
    pub fn router_top(&self, n: usize) -> Result<Vec<ExpertKey>> {
        let experts = self.router.rows();
        let logits = self.b.linear(self.x, self.router)?;
        let routing = self.b.route(&logits, n.clamp(1, experts), false)?;
        let ids = match self.b.download(&routing.ids)? {
            HostVec::I32(v) => v,
            _ => return Err(dtype(DType::I32, routing.ids.dtype())),
        };
        let weights = match self.b.download(&routing.weights)? {
            HostVec::F32(v) if v.len() == ids.len() => v,
            _ => return Err(dtype(DType::F32, routing.weights.dtype())),
        };
        // Per expert, the largest weight a token gives it (a prefill chunk names each expert many times).
        let mut most: Vec<Option<f32>> = vec![None; experts];
        for (e, w) in ids.into_iter().zip(weights) {
            if let Some(m) = usize::try_from(e).ok().and_then(|e| most.get_mut(e)) {
                *m = Some(m.map_or(w, |m| m.max(w)));
            }
        }
        let mut best: Vec<(usize, f32)> = most.into_iter().enumerate().filter_map(|(e, w)| Some((e, w?))).collect();
        // Heaviest first; ties (and NaN) by id, so the order is the same on every backend.
        best.sort_by(|a, b| b.1.partial_cmp(&a.1).unwrap_or(std::cmp::Ordering::Equal).then(a.0.cmp(&b.0)));
        Ok(best.into_iter().map(|(e, _)| ExpertKey::new(self.next, e)).collect())
    }
}

fn dtype(expected: DType, got: DType) -> Error {
    Error::Backend(osprey_backend::BackendError::DType { expected, got })
}

/// A read-ahead policy.
pub trait ExpertPredictor: Debug + Send + Sync {
    /// Layer `layer`'s routing this step: every expert a token routes to, ascending (called before
    /// [`ExpertPredictor::predict`] for the same layer).
    fn observe(&self, _layer: usize, _touched: &[ExpertKey]) {}

    /// Experts of `a.next` to read ahead, most wanted first (the source may read only a prefix).
    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>>;

    /// The same guesses with how sure each is: the chance that its layer routes to it, as measured (see
    /// [`Calibrated`]); 1 where nothing is measured.
    fn predict_scored(&self, a: &Ahead<'_>) -> Result<Vec<(ExpertKey, f32)>> {
        Ok(self.predict(a)?.into_iter().map(|k| (k, 1.0)).collect())
    }
}

/// Guesses scored past this rank share one tally (a prefill chunk guesses hundreds; decode 8 to 10).
const RANKS: usize = 32;

/// How fast a tally follows the routing: each outcome weighs 1/32 (a few dozen steps of a layer).
const FOLLOW: f32 = 1.0 / 32.0;

/// What a tally starts from: a coin (a source takes guesses above its break-even, which is lower).
const PRIOR: f32 = 0.5;

/// A policy whose guesses carry their measured precision (issue 55): per layer, distance and rank in the
/// guess (most likely first), the share of guesses at that rank the layer then routed to, following the
/// routing online (every guess is scored, read or not, so a rank a source stopped reading is still
/// measured and comes back once it pays). A source reads a guess only where this beats its break-even
/// ([`crate::layers::moe::Guess::confidence`]), so a layer whose guesses stop paying is switched off by
/// itself.
#[derive(Debug)]
pub struct Calibrated {
    inner: Arc<dyn ExpertPredictor>,
    state: Mutex<Tallies>,
}

#[derive(Debug, Default)]
struct Tallies {
    /// Per (layer, distance): the last guess not yet scored.
    pending: Vec<Vec<Option<Vec<ExpertKey>>>>,
    /// Per (layer, distance): per rank, the measured precision.
    precision: Vec<Vec<[f32; RANKS]>>,
}

impl Tallies {
    fn at<T: Clone>(v: &mut Vec<Vec<T>>, layer: usize, distance: usize, fill: T) -> &mut T {
        if v.len() <= layer {
            v.resize(layer + 1, Vec::new());
        }
        let row = &mut v[layer];
        if row.len() < distance {
            row.resize(distance, fill);
        }
        &mut row[distance - 1]
    }
}

impl Calibrated {
    /// `inner`'s guesses, scored.
    pub fn new(inner: Arc<dyn ExpertPredictor>) -> Self {
        Calibrated { inner, state: Mutex::new(Tallies::default()) }
    }

    /// The measured precision of guesses at `rank` for `layer`, `distance` layers ahead.
    pub fn precision(&self, layer: usize, distance: usize, rank: usize) -> f32 {
        let st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        let row = st.precision.get(layer).and_then(|r| r.get(distance.max(1) - 1));
        row.map_or(PRIOR, |p| p[rank.min(RANKS - 1)])
    }
}

impl ExpertPredictor for Calibrated {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        {
            let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
            let distances = st.pending.get(layer).map_or(0, Vec::len);
            for d in 1..=distances {
                let Some(guess) = st.pending[layer][d - 1].take() else { continue };
                let p = Tallies::at(&mut st.precision, layer, d, [PRIOR; RANKS]);
                for (r, k) in guess.iter().enumerate() {
                    let hit = if touched.contains(k) { 1.0 } else { 0.0 };
                    let t = &mut p[r.min(RANKS - 1)];
                    *t += FOLLOW * (hit - *t);
                }
            }
        }
        self.inner.observe(layer, touched);
    }

    fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>> {
        Ok(self.predict_scored(a)?.into_iter().map(|(k, _)| k).collect())
    }

    fn predict_scored(&self, a: &Ahead<'_>) -> Result<Vec<(ExpertKey, f32)>> {
        let guess = self.inner.predict(a)?;
        let mut st = self.state.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        *Tallies::at(&mut st.pending, a.next, a.distance, None) = Some(guess.clone());
        let p = *Tallies::at(&mut st.precision, a.next, a.distance, [PRIOR; RANKS]);
        Ok(guess.into_iter().enumerate().map(|(r, k)| (k, p[r.min(RANKS - 1)])).collect())
    }
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
/// and `none` are no policy); each [`Calibrated`], so its guesses carry their measured precision.
pub fn by_name(name: &str, margin: usize) -> Result<Option<Arc<dyn ExpertPredictor>>> {
    let inner: Arc<dyn ExpertPredictor> = match name {
        "off" | "none" => return Ok(None),
        "router" => Arc::new(NextRouter { margin }),
        "previous" => Arc::new(PreviousStep::default()),
        "union" => Arc::new(Union::new(margin)),
        other => {
            return Err(Error::Unsupported(format!(
                "unknown expert prefetch policy {other:?} (off, router, previous, union)"
            )))
        }
    };
    Ok(Some(Arc::new(Calibrated::new(inner))))
}

#[cfg(test)]
mod tests {
    use super::*;
    use osprey_backend::MemoryOps;
    use osprey_backend_cpu::CpuBackend;

    /// Guesses experts 0 and 1 of the next layer, in that order.
    #[derive(Debug)]
    struct TwoFixed;

    impl ExpertPredictor for TwoFixed {
        fn predict(&self, a: &Ahead<'_>) -> Result<Vec<ExpertKey>> {
            Ok(vec![ExpertKey::new(a.next, 0), ExpertKey::new(a.next, 1)])
        }
    }

    /// Issue 55: each rank's precision follows what its layer routes to (expert 0 always, expert 1
    /// never), from the prior towards 1 and 0, per layer: the guesses carry it, and a layer not yet
    /// observed keeps the prior.
    #[test]
    fn calibrated_guesses_carry_the_precision_their_rank_measured() {
        let b = CpuBackend::default();
        let x = b.upload_f32(&[0.5; 4], &[1, 4]).expect("x");
        let router = crate::layers::place(&b, crate::Weight::from_f32(2, 4, vec![0.25; 8])).expect("router");
        let c = Calibrated::new(Arc::new(TwoFixed));
        let ahead = |next| Ahead::new(&b, (0, next), 1, &x, &router);
        let first = c.predict_scored(&ahead(1)).expect("guess");
        assert_eq!(first, vec![(ExpertKey::new(1, 0), PRIOR), (ExpertKey::new(1, 1), PRIOR)]);
        for _ in 0..200 {
            c.predict_scored(&ahead(1)).expect("guess");
            c.observe(1, &[ExpertKey::new(1, 0), ExpertKey::new(1, 5)]);
        }
        let scored = c.predict_scored(&ahead(1)).expect("guess");
        assert!(scored[0].1 > 0.99 && scored[1].1 < 0.01, "{scored:?}");
        assert_eq!(c.precision(2, 1, 0), PRIOR, "another layer is not measured yet");
        // The last guess scored; then an observation with no guess pending changes nothing.
        c.observe(1, &[ExpertKey::new(1, 0)]);
        let before = c.precision(1, 1, 1);
        c.observe(1, &[ExpertKey::new(1, 1)]);
        assert_eq!(c.precision(1, 1, 1), before);
    }

    /// The router's guesses come heaviest first: the expert with the largest logit leads.
    #[test]
    fn router_guesses_come_heaviest_first() {
        let b = CpuBackend::default();
        let x = b.upload_f32(&[1.0, 0.0], &[1, 2]).expect("x");
        // Expert 2 scores highest, then 0, then 3, then 1.
        let w = crate::Weight::from_f32(4, 2, vec![2.0, 0.0, -1.0, 0.0, 5.0, 0.0, 1.0, 0.0]);
        let router = crate::layers::place(&b, w).expect("router");
        let got = Ahead::new(&b, (0, 1), 3, &x, &router).router_top(3).expect("top");
        assert_eq!(got, [2, 0, 3].map(|e| ExpertKey::new(1, e)));
    }
}
