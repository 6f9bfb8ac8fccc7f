//! The MoE block computes the experts a source has resident while the others are still being read, and
//! the answer does not depend on which were resident (outputs are summed in ascending expert order).

use crate::common;

use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use osprey_backend::{Backend, BackendRef, ExpertPool, Result, Tensor, Wrapper};
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
    fn moe_routed(&self, x: &Tensor, slots: &Tensor, w: &Tensor, pool: &ExpertPool, out: &mut Tensor) -> Result<()> {
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

    fn request(&self, layer: usize, experts: &[usize]) -> ExpertTicket {
        let all = self.inner.request(layer, experts).wait().expect("resident");
        let (waves, waits, parity) = (self.waves.clone(), self.waits.clone(), self.missing_parity);
        let experts = experts.to_vec();
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

#[test]
fn resident_experts_are_computed_before_waiting_for_the_missing_ones_with_identical_logits() {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let cfg = ModelConfig::from_dir(&dir).expect("config");
    let ck = Checkpoint::open(&dir).expect("open");
    let moe = cfg.text.moe().expect("moe").expect("is moe");
    let layout = osprey_models::expert_layout(&cfg, &ck).expect("layout").expect("is moe");
    let prefixes: Vec<Option<String>> = layout.prefixes.into_iter().map(Some).collect();
    let ids: Vec<u32> = (0..10).map(|i| (i * 37 + 5) % 200).collect();
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
