//! The transformers parity fixtures of every family on the CUDA backend's emulated device (`--device
//! cuda-emu`) — Qwen3.5 dense and MoE, `qwen4_exp`, the vision towers with images and video: the same
//! tests, the same tolerance (`parity.rs`: `ATOL = 1e-4`, our kernels summing in other orders), the
//! CUDA kernels compiled for the host instead of the CPU backend's. What a GPU would compute, minus the
//! hardware: a model that passes here fails on a GPU only through the device layer or the hardware.

use crate::common::fixtures;
use crate::{parity, qwen4_exp, vision};

/// A fixture model on the CUDA backend's emulated device (the CUDA kernels, compiled for the host).
fn model_on_cuda_emu(name: &str) -> osprey_models::Model {
    osprey_models::load_on(&fixtures().join("models").join(name), cuda_backend()).expect("load model on cuda-emu")
}

/// The emulated device, or the real one named by `OSPREY_CUDA_TEST_DEVICE=cuda:N` (the GPU kit runs
/// these same tests on a GPU that way).
fn cuda_backend() -> osprey_backend::BackendRef {
    osprey_backend_cuda::open_test_device(4 << 30)
}

/// The vision tower of fixture model `name` on the CUDA backend's emulated device.
fn tower_on_cuda_emu(name: &str) -> osprey_models::vision::VisionTower {
    let dir = fixtures().join("models").join(name);
    osprey_models::vision::VisionTower::from_dir(&dir, cuda_backend())
        .expect("load the tower on cuda-emu")
        .expect("the model has a vision tower")
}

#[test]
fn cuda_emu_hidden_states_and_logits_match_transformers() {
    parity::hidden_states_and_logits(model_on_cuda_emu);
}

#[test]
fn cuda_emu_teacher_forced_decode_matches_reference_steps() {
    parity::teacher_forced_decode(model_on_cuda_emu);
}

#[test]
fn cuda_emu_chunked_prefill_matches_reference_and_one_shot() {
    parity::chunked_prefill(model_on_cuda_emu);
}

#[test]
fn cuda_emu_snapshot_and_restore_continue_exactly() {
    parity::snapshot_and_restore(model_on_cuda_emu);
}

#[test]
fn cuda_emu_qwen4_exp_streams_and_logits_match_transformers() {
    qwen4_exp::hidden_streams_and_logits(model_on_cuda_emu);
    qwen4_exp::teacher_forced_decode(model_on_cuda_emu);
}

#[test]
fn cuda_emu_qwen4_exp_chunked_prefill_matches_reference_and_one_shot() {
    qwen4_exp::chunked_prefill(model_on_cuda_emu);
}

#[test]
fn cuda_emu_vision_towers_match_transformers() {
    vision::vision_tower(tower_on_cuda_emu);
}

#[test]
fn cuda_emu_multimodal_logits_match_transformers() {
    vision::positions_and_multimodal_logits(model_on_cuda_emu, tower_on_cuda_emu);
}

/// On the device, answers do not depend on the expert budget: one slot per layer (every step uploads in
/// waves) and a slot per expert give the same logits to the bit, for prefill and decode; so do two slots
/// per layer with guesses uploaded ahead (issue 36: copies queued while the layer before computes, which
/// the emulated device runs only when a wave that reads their slot waits for them).
#[test]
fn cuda_emu_answers_are_bit_identical_across_slot_budgets() {
    use osprey_models::{LoadOptions, LogitsWanted, SeqInput, SeqStep};
    for name in ["qwen3_5_moe-tiny", "qwen4_exp-tiny"] {
        let dir = fixtures().join("models").join(name);
        let (cfg, ck) = (
            osprey_models::ModelConfig::from_dir(&dir).expect("config"),
            osprey_models::Checkpoint::open(&dir).expect("checkpoint"),
        );
        let run = |slots: Option<usize>, guesses: bool| {
            let opts = LoadOptions {
                expert_slots: slots,
                predictor: guesses
                    .then(|| osprey_models::layers::predict::by_name("union", 2).expect("policy"))
                    .flatten(),
                guess_uploads: guesses,
                ..LoadOptions::default()
            };
            let m = osprey_models::load_with_options(&cfg, &ck, opts, cuda_backend(), &mut |_, _| {}).expect("load");
            let mut st = m.new_state();
            let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 11) % 1000).collect();
            let mut out = Vec::new();
            let mut next = prompt;
            for _ in 0..4 {
                let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&next) };
                let l = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward").logits.remove(0);
                let t = l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("logits");
                out.push(l);
                next = vec![t];
            }
            (out, m.slot_stats().guesses)
        };
        let (all, _) = run(None, false);
        assert!(run(Some(1), false).0 == all, "{name}: one slot per layer and every expert resident");
        let (guessing, guesses) = run(Some(2), true);
        assert!(guesses > 0, "{name}: guesses went up");
        assert!(guessing == all, "{name}: two slots per layer with guesses uploaded ahead");
    }
}
