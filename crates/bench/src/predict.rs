//! Expert predictors on recorded routing traces (issue 36): a guess of the experts a layer will route
//! to, made before its router runs, so that their reads could start early. A predictor sits behind a
//! small trait so policies can be compared on the same trace: precision (how many guesses were routed
//! to), recall (how many routed experts were guessed) and the experts read for nothing per step. A trace
//! holds expert ids only, so the predictors here use routing history; the default predictor of the issue
//! (the next layer's router applied to the current hidden state) needs the model and is measured there.

use std::collections::VecDeque;

use serde::Serialize;

use crate::experts::TraceFile;

/// A guess of a layer's experts before its router runs.
pub trait Predictor {
    /// Its name in reports.
    fn name(&self) -> String;
    /// The experts `layer` is expected to route to at its next step.
    fn predict(&self, layer: usize) -> Vec<usize>;
    /// What `layer` routed to.
    fn observe(&mut self, layer: usize, experts: &[usize]);
}

/// The experts the same layer routed to at its previous step (routing's temporal locality: GPU.md cites
/// 45% of experts repeating at the next token).
#[derive(Debug)]
pub struct PreviousStep {
    last: Vec<Vec<usize>>,
}

impl PreviousStep {
    /// For `layers` layers.
    pub fn new(layers: usize) -> Self {
        PreviousStep { last: vec![Vec::new(); layers] }
    }
}

impl Predictor for PreviousStep {
    fn name(&self) -> String {
        "previous step".into()
    }
    fn predict(&self, layer: usize) -> Vec<usize> {
        self.last[layer].clone()
    }
    fn observe(&mut self, layer: usize, experts: &[usize]) {
        self.last[layer] = experts.to_vec();
    }
}

/// The union of the layer's last `window` steps (more recall, less precision).
#[derive(Debug)]
pub struct RecentUnion {
    window: usize,
    recent: Vec<VecDeque<Vec<usize>>>,
}

impl RecentUnion {
    /// For `layers` layers over `window` steps.
    pub fn new(layers: usize, window: usize) -> Self {
        RecentUnion { window: window.max(1), recent: vec![VecDeque::new(); layers] }
    }
}

impl Predictor for RecentUnion {
    fn name(&self) -> String {
        format!("union of the last {} steps", self.window)
    }
    fn predict(&self, layer: usize) -> Vec<usize> {
        let mut all: Vec<usize> = self.recent[layer].iter().flatten().copied().collect();
        all.sort_unstable();
        all.dedup();
        all
    }
    fn observe(&mut self, layer: usize, experts: &[usize]) {
        let r = &mut self.recent[layer];
        r.push_back(experts.to_vec());
        if r.len() > self.window {
            r.pop_front();
        }
    }
}

/// A predictor's accuracy on a trace.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Accuracy {
    /// The predictor.
    pub predictor: String,
    /// Guessed experts that were routed to, of all guesses (1 when nothing was guessed).
    pub precision: f64,
    /// Routed experts that were guessed, of all routed.
    pub recall: f64,
    /// Per layer: (precision, recall).
    pub per_layer: Vec<(f64, f64)>,
    /// Experts guessed but not routed to, per step (reads a prefetch would waste).
    pub wasted_per_step: f64,
}

/// `p`'s accuracy on trace `t`: each entry is predicted, then observed.
pub fn evaluate(t: &TraceFile, p: &mut dyn Predictor) -> Accuracy {
    // Per layer: (guessed and routed, guessed, routed).
    let mut counts = vec![(0u64, 0u64, 0u64); t.layers];
    for (layer, experts) in &t.trace {
        let guess = p.predict(*layer);
        let right = guess.iter().filter(|e| experts.contains(e)).count() as u64;
        let c = &mut counts[*layer];
        *c = (c.0 + right, c.1 + guess.len() as u64, c.2 + experts.len() as u64);
        p.observe(*layer, experts);
    }
    let ratio = |a: u64, b: u64| if b == 0 { 1.0 } else { a as f64 / b as f64 };
    let (right, guessed, routed) = counts.iter().fold((0, 0, 0), |s, c| (s.0 + c.0, s.1 + c.1, s.2 + c.2));
    Accuracy {
        predictor: p.name(),
        precision: ratio(right, guessed),
        recall: ratio(right, routed),
        per_layer: counts.iter().map(|c| (ratio(c.0, c.1), ratio(c.0, c.2))).collect(),
        wasted_per_step: (guessed - right) as f64 / t.trace.len().max(1) as f64,
    }
}

/// Every trace predictor's accuracy on `t`.
pub fn evaluate_all(t: &TraceFile) -> Vec<Accuracy> {
    let mut predictors: Vec<Box<dyn Predictor>> = vec![
        Box::new(PreviousStep::new(t.layers)),
        Box::new(RecentUnion::new(t.layers, 2)),
        Box::new(RecentUnion::new(t.layers, 4)),
    ];
    predictors.iter_mut().map(|p| evaluate(t, p.as_mut())).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn trace(steps: &[(usize, &[usize])]) -> TraceFile {
        TraceFile {
            layers: 2,
            experts_per_layer: 8,
            top_k: 2,
            trace: steps.iter().map(|(l, e)| (*l, e.to_vec())).collect(),
        }
    }

    #[test]
    fn precision_recall_and_waste_are_counted_per_layer() {
        // Layer 0 repeats {1, 2} then moves to {2, 3}; layer 1 alternates {4, 5} and {6, 7}.
        let t = trace(&[(0, &[1, 2]), (1, &[4, 5]), (0, &[1, 2]), (1, &[6, 7]), (0, &[2, 3]), (1, &[4, 5])]);
        let prev = evaluate(&t, &mut PreviousStep::new(2));
        // Layer 0: guesses {}, {1,2} (2 right), {1,2} (1 right): precision 3/4, recall 3/6.
        assert_eq!(prev.per_layer[0], (0.75, 0.5));
        // Layer 1: {}, {4,5} (0 right), {6,7} (0 right).
        assert_eq!(prev.per_layer[1], (0.0, 0.0));
        assert_eq!((prev.precision, prev.recall), (3.0 / 8.0, 3.0 / 12.0));
        assert_eq!(prev.wasted_per_step, 5.0 / 6.0);
        // The union of two steps sees layer 1's alternation: its third guess {4,5,6,7} holds {4,5}.
        let union = evaluate(&t, &mut RecentUnion::new(2, 2));
        assert_eq!(union.per_layer[1], (2.0 / 6.0, 2.0 / 6.0));
        assert_eq!(union.per_layer[0], prev.per_layer[0], "layer 0 is the same: its history repeats");
        assert_eq!((union.precision, union.recall), (5.0 / 10.0, 5.0 / 12.0));
    }
}
