//! The MoE block computes the experts a source has resident while the others are still being read, and
//! the answer does not depend on which were resident (accumulation stays in ascending expert order).

mod common;

use std::fmt::Debug;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use osprey_models::{
    CausalLm, Checkpoint, ExpertHandle, ExpertSource, ExpertTicket, ModelConfig, PendingExperts, ResidentExperts,
    SeqInput, SeqStep,
};

/// Declares every expert whose id is `≡ parity (mod 2)` missing. Resident handles count their drops, and
/// the pending part records how many resident handles were still alive when the model waited on it.
#[derive(Debug)]
struct HalfResident {
    inner: ResidentExperts,
    missing_parity: usize,
    released: Arc<AtomicUsize>,
    /// Per wait: (resident handles given, resident handles already dropped when `wait` was called).
    waits: Arc<Mutex<Vec<(usize, usize)>>>,
}

#[derive(Debug)]
struct Counted(Arc<AtomicUsize>);

impl Drop for Counted {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

impl ExpertSource for HalfResident {
    fn request(&self, layer: usize, experts: &[usize]) -> ExpertTicket {
        let all = self.inner.request(layer, experts).wait().expect("resident");
        let (released, waits, parity) = (self.released.clone(), self.waits.clone(), self.missing_parity);
        let experts = experts.to_vec();
        ExpertTicket::new(move || {
            let base = released.load(Ordering::SeqCst);
            let mut have = Vec::new();
            let mut later = Vec::new();
            for (h, e) in all.into_iter().zip(&experts) {
                if e % 2 == parity {
                    have.push(None);
                    later.push(h);
                } else {
                    let w = Arc::new(h.weights().clone());
                    have.push(Some(ExpertHandle::new(w, Some(Box::new(Counted(released.clone()))))));
                }
            }
            let given = have.iter().flatten().count();
            let pending = PendingExperts::new(move || {
                waits.lock().expect("lock").push((given, released.load(Ordering::SeqCst) - base));
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
        let waits = Arc::new(Mutex::new(Vec::new()));
        let src = HalfResident {
            inner: ResidentExperts::load(&ck, &prefixes, cfg.text.hidden_size, moe).expect("experts"),
            missing_parity: parity,
            released: Arc::new(AtomicUsize::new(0)),
            waits: waits.clone(),
        };
        // On the exact backend, as the reference (`common::model`) is.
        let exact = osprey_backend_cpu::CpuBackend::exact();
        let m =
            osprey_models::load_with_progress(&cfg, &ck, Some(Arc::new(src)), exact, &mut |_, _| {}).expect("model");
        // Bit-identical: the same per-expert products summed in the same order.
        assert_eq!(logits(&m, &ids), reference, "missing parity {parity}");
        let waits = waits.lock().expect("lock");
        assert!(!waits.is_empty());
        assert!(waits.iter().any(|&(given, _)| given > 0), "some experts were resident");
        for &(given, dropped) in waits.iter() {
            assert_eq!(dropped, given, "every resident expert was computed (and released) before the wait");
        }
    }
}
