//! The MoE block computes the experts a source has resident while the others are still being read, and
//! the answer does not depend on which were resident (outputs are summed in ascending expert order).

use crate::common;

use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use osprey_backend::{Backend, BackendRef, ExpertPool, Result, Tensor, Wrapper};
use osprey_models::layers::moe::{Guess, LayerStep};
use osprey_models::{
    CausalLm, Checkpoint, ExpertHandle, ExpertSource, ExpertTicket, ModelConfig, PendingExperts, ResidentExperts,
    SeqInput, SeqStep,
};

/// The exact CPU backend, counting the expert waves it runs (`moe_routed`).
#[derive(Debug)]
struct Waves {
    inner: BackendRef,
    waves: Arc<AtomicUsize>,
}

impl Wrapper for Waves {
    fn inner(&self) -> &dyn Backend {
        self.inner.as_ref()
    }
    fn moe_routed(&self, x: &Tensor, slots: &[i32], w: &Tensor, pool: &ExpertPool, out: &mut Tensor) -> Result<()> {
        self.waves.fetch_add(1, Ordering::SeqCst);
        self.inner.moe_routed(x, slots, w, pool, out)
    }
}

/// Declares every expert whose id is `≡ parity (mod 2)` missing; the pending part records how many waves
/// the backend had run since the request when the model waited on it. One slot per layer (so every step
/// misses).
#[derive(Debug)]
struct HalfResident {
    inner: ResidentExperts,
    missing_parity: usize,
    waves: Arc<AtomicUsize>,
    /// Per wait: (resident handles given, waves run between the request and the wait).
    waits: Arc<Mutex<Vec<(usize, usize)>>>,
}

impl ExpertSource for HalfResident {
    fn slots_per_layer(&self) -> Option<usize> {
        Some(1)
    }

    fn request(&self, step: LayerStep<'_>) -> ExpertTicket {
        let all = self.inner.request(step).wait().expect("resident");
        let (waves, waits, parity) = (self.waves.clone(), self.waits.clone(), self.missing_parity);
        let experts: Vec<usize> = step.need.iter().map(|k| k.expert()).collect();
        ExpertTicket::new(move || {
            let base = waves.load(Ordering::SeqCst);
            let mut have = Vec::new();
            let mut later = Vec::new();
            for (h, e) in all.into_iter().zip(&experts) {
                if e % 2 == parity {
                    have.push(None);
                    later.push(h);
                } else {
                    have.push(Some(ExpertHandle::new(h.key(), Arc::new(h.weights().clone()), None)));
                }
            }
            let given = have.iter().flatten().count();
            let pending = PendingExperts::new(move || {
                waits.lock().expect("lock").push((given, waves.load(Ordering::SeqCst) - base));
                Ok(later)
            });
            Ok((have, pending))
        })
    }
}

fn logits(m: &dyn CausalLm, ids: &[u32]) -> Vec<f32> {
    let mut st = m.new_state();
    let mut out = m
        .forward(&mut [SeqStep { state: &mut st, input: SeqInput::text(&ids[..6]) }], false)
        .expect("prefill")
        .logits
        .remove(0);
    for t in &ids[6..] {
        out.extend(
            m.forward(&mut [SeqStep { state: &mut st, input: SeqInput::text(std::slice::from_ref(t)) }], false)
                .expect("decode")
                .logits
                .remove(0),
        );
    }
    out
}

/// The tiny MoE fixture, its MoE layers' tensor prefixes and a prompt.
struct Tiny {
    cfg: ModelConfig,
    ck: Checkpoint,
    moe: osprey_models::config::MoeConfig,
    prefixes: Vec<Option<String>>,
    ids: Vec<u32>,
}

fn tiny() -> Tiny {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let cfg = ModelConfig::from_dir(&dir).expect("config");
    let ck = Checkpoint::open(&dir).expect("open");
    let moe = cfg.text.moe().expect("moe").expect("is moe");
    let layout = osprey_models::expert_layout(&cfg, &ck).expect("layout").expect("is moe");
    let prefixes = layout.prefixes.into_iter().map(Some).collect();
    Tiny { cfg, ck, moe, prefixes, ids: (0..10).map(|i| (i * 37 + 5) % 200).collect() }
}

#[test]
fn resident_experts_are_computed_before_waiting_for_the_missing_ones_with_identical_logits() {
    let Tiny { cfg, ck, moe, prefixes, ids } = tiny();
    let reference = logits(&common::model("qwen3_5_moe-tiny"), &ids);
    for parity in [0, 1] {
        let (waits, waves) = (Arc::new(Mutex::new(Vec::new())), Arc::new(AtomicUsize::new(0)));
        let src = HalfResident {
            inner: ResidentExperts::load(&ck, &prefixes, cfg.text.hidden_size, moe).expect("experts"),
            missing_parity: parity,
            waves: waves.clone(),
            waits: waits.clone(),
        };
        // On the exact backend, as the reference (`common::model`) is.
        let exact = Arc::new(Waves { inner: osprey_backend_cpu::CpuBackend::exact(), waves });
        let m =
            osprey_models::load_with_progress(&cfg, &ck, Some(Arc::new(src)), exact, &mut |_, _| {}).expect("model");
        // Bit-identical: the same per-expert products summed in the same order.
        assert_eq!(logits(&m, &ids), reference, "missing parity {parity}");
        let waits = waits.lock().expect("lock");
        assert!(!waits.is_empty());
        assert!(waits.iter().any(|&(given, _)| given > 0), "some experts were resident");
        for &(given, waves) in waits.iter() {
            // One slot: each resident expert is its own wave, all run before the wait.
            assert!(waves >= given, "{given} resident experts but {waves} waves before the wait");
        }
    }
}

/// What a block told its expert source, in order: its step (one request each) and its guesses.
#[derive(Debug)]
enum Told {
    Step(usize),
    Guess(usize, Vec<usize>),
}

/// Every expert mapped, every call logged.
#[derive(Debug)]
struct Logged {
    inner: ResidentExperts,
    log: Arc<Mutex<Vec<Told>>>,
}

impl ExpertSource for Logged {
    fn request(&self, step: LayerStep<'_>) -> ExpertTicket {
        let layer = step.need.iter().chain(step.in_slots).next().expect("a step routes").layer();
        self.log.lock().expect("lock").push(Told::Step(layer));
        self.inner.request(step)
    }
    fn guess(&self, guess: Guess<'_>) -> PendingExperts {
        let layer = guess.read.first().expect("a guess names experts").layer();
        self.log.lock().expect("lock").push(Told::Guess(layer, guess.read.iter().map(|k| k.expert()).collect()));
        self.inner.guess(guess)
    }
}

/// Issue 36: a block guesses the next `depth` MoE layers right after its own step's request, nearest
/// first (wrapping to the first layers at the next step), each guess the one its predictor gives for that
/// layer at that distance: with the routing replayed, the guesses after the trace's step `i` are exactly
/// steps `i + 1 ..= i + depth`.
#[test]
fn each_layer_guesses_the_next_depth_layers_nearest_first() {
    use osprey_models::layers::predict::{ExpertPredictor, Replay};
    let Tiny { cfg, ck, moe, prefixes, ids } = tiny();
    let load = |predictor: Arc<dyn ExpertPredictor>, depth: usize, log: Arc<Mutex<Vec<Told>>>| {
        let inner = ResidentExperts::load(&ck, &prefixes, cfg.text.hidden_size, moe).expect("experts");
        let opts = osprey_models::LoadOptions {
            experts: Some(Arc::new(Logged { inner, log })),
            predictor: Some(predictor),
            prefetch_depth: depth,
            ..Default::default()
        };
        osprey_models::load_with_options(&cfg, &ck, opts, osprey_backend_cpu::CpuBackend::shared(), &mut |_, _| {})
            .expect("model")
    };
    let recorder = Arc::new(crate::backend_seam::Recorder::default());
    logits(&load(recorder.clone(), 1, Arc::default()), &ids);
    let trace = recorder.0.lock().expect("lock").clone();
    for depth in [1, 2, 3] {
        let log = Arc::new(Mutex::new(Vec::new()));
        logits(&load(Arc::new(Replay::new(trace.clone())), depth, log.clone()), &ids);
        let log = log.lock().expect("lock");
        let mut step = None::<usize>;
        let mut ahead = 0;
        for told in log.iter() {
            match told {
                Told::Step(layer) => {
                    let i = step.map_or(0, |s| s + 1);
                    assert_eq!(*layer, trace[i].0, "depth {depth}: step {i}");
                    if i > 0 {
                        let expected = depth.min(trace.len() - i);
                        assert_eq!(ahead, expected, "depth {depth}: guesses after step {}", i - 1);
                    }
                    (step, ahead) = (Some(i), 0);
                }
                Told::Guess(layer, experts) => {
                    ahead += 1;
                    let i = step.expect("a guess follows a step") + ahead;
                    assert_eq!(
                        (layer, experts),
                        (&trace[i].0, &trace[i].1),
                        "depth {depth}: guess {ahead} after a step"
                    );
                }
            }
        }
        assert_eq!(step, Some(trace.len() - 1), "depth {depth}: every step");
    }
    // The router policy applies each guessed layer's own router: two layers' routers on the same input
    // guess differently (the nearest router for both would not).
    let log = Arc::new(Mutex::new(Vec::new()));
    let router = osprey_models::layers::predict::NextRouter { margin: 0 };
    logits(&load(Arc::new(router), 2, log.clone()), &ids);
    let log = log.lock().expect("lock");
    let pairs: Vec<(&Vec<usize>, &Vec<usize>)> = log
        .windows(2)
        .filter_map(|w| match w {
            [Told::Guess(a, x), Told::Guess(b, y)] if a != b => Some((x, y)),
            _ => None,
        })
        .collect();
    assert!(!pairs.is_empty(), "two guesses after a step");
    assert!(pairs.iter().any(|(x, y)| x != y), "each layer's own router: {pairs:?}");
}
