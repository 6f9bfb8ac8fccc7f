//! The bf16 KV option (`--kv-cache-dtype bf16`) against the exact f32 KV on the same exact backend: every
//! K/V row is rounded to bf16 (relative error ≤ 2^-9) once, as it is written, and everything else is the
//! same computation, so the logits move by a little and the greedy answer not at all on these fixtures.

use crate::common;

use common::{Drift, Ref};
use osprey_models::backend::DType;
use osprey_models::{CausalLm, PageGeometry, PageTable, SeqInput, SeqState, SeqStep, DEFAULT_PAGE_SIZE};

fn state(m: &dyn CausalLm, dtype: DType) -> SeqState {
    let geo = PageGeometry::new(m.kv_layout(), DEFAULT_PAGE_SIZE).with_dtype(dtype);
    m.new_state_with(PageTable::unpooled(geo)).expect("state")
}

/// Teacher-forced over the fixture's prompt and generated tokens: the largest |Δlogprob| over the
/// vocabulary, the same on the f32 path's top token, top-1 agreements and steps.
fn drift(m: &dyn CausalLm, reference: &str) -> (f64, f64, usize, usize) {
    let r = Ref::load(reference, "long");
    let (mut a, mut b) = (state(m, DType::F32), state(m, DType::BF16));
    let fwd = |st: &mut SeqState, ids: &[u32]| {
        m.forward(&mut [SeqStep { state: st, input: SeqInput::text(ids) }], false).expect("forward").logits.remove(0)
    };
    let ids = r.ids("input_ids");
    let (mut la, mut lb) = (fwd(&mut a, &ids), fwd(&mut b, &ids));
    let mut d = Drift::default();
    for tok in r.ids("generated_ids") {
        d.add(&la, &lb);
        la = fwd(&mut a, &[tok]);
        lb = fwd(&mut b, &[tok]);
    }
    // Half the KV bytes for the same tokens.
    let kv = |s: &SeqState| s.pages().pages().len() * s.pages().geometry().bytes();
    assert_eq!(kv(&b) * 2, kv(&a));
    (d.worst, d.worst_top, d.agree, d.steps)
}

/// Measured here (2026-12-04): qwen3_5_moe-tiny max |Δlogprob| 1.1e-3 (top token 3.9e-4), qwen4_exp-tiny
/// 6.7e-4 (1.9e-4), 8/8 top-1 on both. The bounds keep a margin of about 2x over those, so a coarser
/// rounding (an f16-range or truncating conversion) or rows read from the wrong page fails, while the
/// kernels are deterministic (no run-to-run noise).
#[test]
fn bf16_kv_drifts_from_f32_kv_within_a_bound() {
    for (name, bound) in [("qwen3_5_moe-tiny", (2.5e-3, 8e-4)), ("qwen4_exp-tiny", (1.5e-3, 4e-4))] {
        let dir = common::fixtures().join("models").join(name);
        let m = osprey_models::load_on(&dir, osprey_backend_cpu::CpuBackend::exact()).expect("load");
        let (worst, worst_top, agree, steps) = drift(&m, name);
        println!(
            "{name}: bf16 vs f32 KV: max |Δlogprob| {worst:.3e} (top token {worst_top:.3e}), top-1 {agree}/{steps}"
        );
        assert!(worst > 0.0, "{name}: the bf16 pool rounded something");
        assert!(worst < bound.0, "{name}: max |Δlogprob| {worst}");
        assert!(worst_top < bound.1, "{name}: top token's |Δlogprob| {worst_top}");
        assert_eq!(agree, steps, "{name}: top-1 agreement");
    }
}
