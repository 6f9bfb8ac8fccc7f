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

/// Issue 51: decode steps as CUDA graphs. Two sequences decode six tokens together, each step begun and
/// ended as a graph step (`Backend::begin_step`): with graphs the first step is recorded and built, the
/// others replayed with their changed nodes updated in place (the attention's past length, the KV write
/// position, the rotary rows), and the logits equal eager decode's to the bit — with every expert
/// resident (one graph a step) and with one slot per layer (the step's graph ends at its first routing
/// readback, the rest runs eagerly). Mutation: a replay that keeps a node's recorded arguments instead
/// of the step's (`Graphed::take`) fails it.
#[test]
fn cuda_emu_graph_replay_equals_eager_decode_bit_for_bit() {
    use osprey_models::{LoadOptions, LogitsWanted, SeqInput, SeqStep};
    for (name, slots) in [("qwen3_5_moe-tiny", None), ("qwen3_5_moe-tiny", Some(1)), ("qwen4_exp-tiny", None)] {
        let dir = fixtures().join("models").join(name);
        let (cfg, ck) = (
            osprey_models::ModelConfig::from_dir(&dir).expect("config"),
            osprey_models::Checkpoint::open(&dir).expect("checkpoint"),
        );
        let run = |graphs: bool| {
            let dev = std::sync::Arc::new(osprey_backend_cuda::EmuDevice::new(4 << 30));
            let cuda = std::sync::Arc::new(
                osprey_backend_cuda::CudaBackend::new(dev, osprey_backend::Device::CudaEmu).with_graphs(graphs),
            );
            let opts = LoadOptions { expert_slots: slots, ..LoadOptions::default() };
            let m = osprey_models::load_with_options(&cfg, &ck, opts, cuda.clone(), &mut |_, _| {}).expect("load");
            let (mut a, mut b) = (m.new_state(), m.new_state());
            let pa: Vec<u32> = (0..19).map(|i| (i * 37 + 11) % 1000).collect();
            let pb: Vec<u32> = (0..7).map(|i| (i * 53 + 5) % 1000).collect();
            let mut out = Vec::new();
            let (mut next_a, mut next_b) = (pa, pb);
            for step in 0..7 {
                let decode = step > 0;
                if decode {
                    osprey_backend::Backend::begin_step(&*cuda, 2).expect("begin");
                }
                let steps = &mut [
                    SeqStep {
                        state: &mut a,
                        input: SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&next_a) },
                    },
                    SeqStep {
                        state: &mut b,
                        input: SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&next_b) },
                    },
                ];
                let logits = m.forward(steps, false).expect("forward").logits;
                if decode {
                    osprey_backend::Backend::end_step(&*cuda).expect("end");
                }
                let best =
                    |l: &[f32]| l.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map_or(0, |(i, _)| i as u32);
                (next_a, next_b) = (vec![best(&logits[0])], vec![best(&logits[1])]);
                out.push(logits);
            }
            (out, cuda.graph_counts())
        };
        let (eager, none) = run(false);
        let (graphed, g) = run(true);
        assert_eq!(none, osprey_backend_cuda::GraphCounts::default(), "{name}: graphs off");
        assert!(graphed == eager, "{name} {slots:?}: graph replay equals eager decode");
        // Every decode step launched as a graph. Built: with every expert resident the first decode step
        // is each MoE layer's first routed on the device (it uploads the layer's expert-to-slot map), so
        // the second is recorded again and replayed after; `qwen4_exp`'s selected attention adds a launch
        // when a block of keys completes, and the step is recorded again then.
        let built = match (name, slots) {
            ("qwen3_5_moe-tiny", None) => 2,
            ("qwen3_5_moe-tiny", Some(_)) => 1,
            _ => g.built.clamp(1, 5),
        };
        assert_eq!((g.built, g.launched), (built, 6), "{name} {slots:?}: {g:?}");
        assert!(g.updated > 0 && g.updated * 4 < g.nodes, "{name} {slots:?}: a few nodes updated a replay: {g:?}");
    }
}

/// Issue 52 (fusions where a step launches many tiny kernels): sequences decoding together run each
/// Gated DeltaNet layer's conv, gates and delta rule once for the batch (`causal_conv_silu_rows`,
/// `gated_delta_rows`: one launch each, each row against its own state), each attention layer's K/V
/// write (with K's norm and RoPE) and its flash attention once for the batch (`kv_write_rope`,
/// `attention_flash`), and every sequence's logits equal its logits decoded alone, to the bit.
#[test]
fn cuda_emu_sequences_decoded_together_match_each_alone_to_the_bit() {
    use osprey_models::{LogitsWanted, SeqInput, SeqStep};
    let dir = fixtures().join("models").join("qwen3_5_moe-tiny");
    let prompts: [Vec<u32>; 3] = [
        (0..19).map(|i| (i * 37 + 11) % 1000).collect(),
        (0..7).map(|i| (i * 53 + 5) % 1000).collect(),
        (0..12).map(|i| (i * 17 + 2) % 1000).collect(),
    ];
    let cuda = std::sync::Arc::new(osprey_backend_cuda::CudaBackend::new(
        std::sync::Arc::new(osprey_backend_cuda::EmuDevice::new(4 << 30)),
        osprey_backend::Device::CudaEmu,
    ));
    let m = osprey_models::load_on(&dir, cuda.clone()).expect("load");
    let best = |l: &[f32]| l.iter().enumerate().max_by(|x, y| x.1.total_cmp(y.1)).map_or(0, |(i, _)| i as u32);
    fn input(t: &[u32]) -> SeqInput<'_> {
        SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(t) }
    }
    // Alone: each sequence's prompt, then three tokens.
    let mut alone = Vec::new();
    let count = |c: &osprey_backend_cuda::DeviceCounts, k: &str| c.kernels.get(k).copied().unwrap_or(0);
    // A decode step's launches alone: one fused delta rule per Gated DeltaNet layer, one K/V write and
    // one flash attention per attention layer.
    let (mut per_step, mut attn_per_step) = (0, 0);
    for p in &prompts {
        let mut st = m.new_state();
        let (mut next, mut out) = (p.clone(), Vec::new());
        for step in 0..4 {
            let before = cuda.counts();
            let l = m.forward(&mut [SeqStep { state: &mut st, input: input(&next) }], false).expect("alone").logits;
            if step > 0 {
                let after = cuda.counts();
                per_step = count(&after, "gated_delta_step") - count(&before, "gated_delta_step");
                attn_per_step = count(&after, "attention_flash") - count(&before, "attention_flash");
                let writes = count(&after, "kv_write_rope") - count(&before, "kv_write_rope");
                assert_eq!(writes, attn_per_step, "one K/V write an attention layer");
            }
            next = vec![best(&l[0])];
            out.push(l[0].clone());
        }
        alone.push(out);
    }
    // Together: the same prompts one by one, then the three decode steps as one batch, the sequences'
    // pages from one pool as a server's are (each state above had its own).
    let geo = osprey_models::PageGeometry::new(m.kv_layout(), 16);
    let mut pool = osprey_models::KvPool::new(geo, 64, cuda.clone());
    let mut states: Vec<_> = prompts.iter().map(|_| m.new_state_with(pool.table()).expect("state")).collect();
    let mut next: Vec<Vec<u32>> = Vec::new();
    for (st, p) in states.iter_mut().zip(&prompts) {
        pool.reserve(st.pages_mut(), p.len() + 4).expect("pages");
        let l = m.forward(&mut [SeqStep { state: st, input: input(p) }], false).expect("prompt").logits;
        next.push(vec![best(&l[0])]);
    }
    let before = cuda.counts();
    for step in 1..4 {
        let mut steps: Vec<SeqStep<'_, '_>> =
            states.iter_mut().zip(&next).map(|(st, t)| SeqStep { state: st, input: input(t) }).collect();
        let logits = m.forward(&mut steps, false).expect("together").logits;
        for (i, l) in logits.iter().enumerate() {
            assert!(*l == alone[i][step], "sequence {i}, decode step {step}: together equals alone");
        }
        next = logits.iter().map(|l| vec![best(l)]).collect();
    }
    let after = cuda.counts();
    let launched = |k: &str| after.kernels.get(k).copied().unwrap_or(0) - before.kernels.get(k).copied().unwrap_or(0);
    assert!(per_step > 0, "the model has Gated DeltaNet layers");
    assert_eq!(launched("gated_delta_step"), 3 * per_step, "one delta launch a layer and step, not one a sequence");
    assert_eq!(launched("causal_conv_silu_rows"), 3 * per_step, "one conv launch a layer and step");
    assert_eq!(launched("gated_delta_slab") + launched("causal_conv_silu"), 0, "no launch per sequence");
    assert!(attn_per_step > 0, "the model has attention layers");
    assert_eq!(launched("attention_flash"), 3 * attn_per_step, "one attention launch a layer and step");
    assert_eq!(launched("kv_write_rope"), 3 * attn_per_step, "one K/V write a layer and step");
    assert_eq!(launched("rotate_half_f32"), 0, "q's and K's RoPE ride with their norms");
}
