//! `osprey bench synth` writes a checkpoint osprey loads and runs like a real one: the tiny geometry at
//! two layers (both Gated DeltaNet) and four (the fourth is attention), NVFP4 experts, gives finite,
//! varied logits, and its experts stream under a quarter budget (`bench experts`) with a residency below
//! one and bytes read every token.

use osprey_bench::synth::{synth, TINY};
use osprey_models::{LogitsWanted, SeqInput, SeqStep};

fn scratch(tag: &str) -> std::path::PathBuf {
    let d = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("synth-{tag}"));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn a_synthetic_checkpoint_loads_runs_and_streams_its_experts() {
    for layers in [2, 4] {
        let dir = scratch(&format!("{layers}"));
        let r = synth(&dir, TINY, layers, 3).expect("synth");
        assert_eq!(r.layers, layers);
        assert_eq!(r.expert_bytes, (layers * 8 * 3 * (64 * 128 / 2 + 64 * 128 / 16)) as u64);
        let m = osprey_models::load_on(&dir, cpu()).expect("load the synthetic checkpoint");
        assert_eq!(m.info().num_layers, layers);
        let ids: Vec<u32> = (1..=20).collect();
        let mut st = m.new_state();
        let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&ids) };
        let logits = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward").logits.remove(0);
        assert!(logits.iter().all(|v| v.is_finite()), "finite logits");
        let (lo, hi) = logits.iter().fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        assert!(hi - lo > 1e-3, "varied logits");
        let rep = osprey_bench::bench_experts(&dir, run(0.25, 1.0, 4), cpu()).expect("bench experts");
        assert!(rep.residency < 1.0 && rep.bytes_read_per_token > 0.0, "experts streamed from disk");
    }
}

/// A run's routing trace, written and read back as a file, replays the policies at several budgets
/// without the model: more room never lowers LRU's hit rate, and the whole budget holds every expert.
#[test]
fn a_recorded_routing_trace_replays_the_policies_at_other_budgets() {
    let dir = scratch("trace");
    synth(&dir, TINY, 2, 9).expect("synth");
    let (_, trace) = osprey_bench::bench_experts_traced(&dir, run(0.25, 1.0, 6), cpu()).expect("run");
    assert_eq!((trace.layers, trace.experts_per_layer, trace.top_k), (2, 8, 2));
    assert!(!trace.trace.is_empty());
    let file = dir.join("trace.json");
    std::fs::write(&file, serde_json::to_string(&trace).expect("json")).expect("write");
    let back: osprey_bench::TraceFile =
        serde_json::from_str(&std::fs::read_to_string(&file).expect("read")).expect("parse");
    let rates = osprey_bench::replay(&back, &[0.25, 0.5, 1.0]);
    let lru: Vec<f64> = rates.iter().map(|(_, p)| p.lru).collect();
    assert!(lru.windows(2).all(|w| w[0] <= w[1] + 1e-9), "{lru:?}");
    assert!(lru[2] > 0.99, "every expert fits: {lru:?}");
}

/// The `qwen4_exp` geometry: hyper-connections, PLE (a table sized as transformers sizes it) and QSA
/// indexers; osprey loads it as that family and runs it, its experts streaming under a budget.
#[test]
fn a_synthetic_flash_next_checkpoint_loads_and_runs_as_qwen4_exp() {
    let dir = scratch("flash");
    synth(&dir, osprey_bench::synth::TINY_FLASH, 4, 5).expect("synth");
    let m = osprey_models::load_on(&dir, cpu()).expect("load the synthetic qwen4_exp checkpoint");
    assert_eq!(m.info().family, "qwen4_exp");
    let ids: Vec<u32> = (1..=24).collect();
    let mut st = m.new_state();
    let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&ids) };
    let logits = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward").logits.remove(0);
    assert!(logits.iter().all(|v| v.is_finite()));
    let rep = osprey_bench::bench_experts(&dir, run(0.25, 0.5, 4), cpu()).expect("bench experts");
    assert!(rep.residency < 1.0 && rep.ple_bytes_read_per_token.is_some());
}

/// With a vision tower (`--vision-layers`): the multimodal `qwen3_5_moe` layout (the decoder under
/// `model.language_model`), a tower of the geometry's widths and the depth asked for, the context asked
/// for, Qwen3.5's preprocessing; the decoder runs, the tower encodes a 4×4-patch image into 4 rows of the
/// decoder's width, and a greedy token is one the embedded tokenizer has (the head's rows past its 1,024
/// tokens are zero).
#[test]
fn a_synthetic_checkpoint_with_a_vision_tower_loads_encodes_and_answers_in_the_tokenizers_range() {
    let dir = scratch("vision");
    let o = osprey_bench::synth::Options { vision_layers: 2, context: 65536 };
    let g = osprey_bench::synth::Geometry { vocab: 2048, ..TINY };
    osprey_bench::synth::synth_with(&dir, g, 4, 3, o).expect("synth");
    let cfg = osprey_models::config::ModelConfig::from_dir(&dir).expect("config");
    assert_eq!((cfg.model_type.as_str(), cfg.text.max_position_embeddings), ("qwen3_5_moe", 65536));
    let vision = cfg.vision.expect("a vision config");
    assert_eq!((vision["depth"].as_u64(), vision["hidden_size"].as_u64()), (Some(2), Some(64)));
    let pc: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("processor_config.json")).expect("processor"))
            .expect("json");
    assert_eq!(pc["image_processor"]["size"]["shortest_edge"], 65536);
    let tower = osprey_models::vision::VisionTower::from_dir(&dir, cpu()).expect("load").expect("a tower");
    let rows: Vec<f32> = (0..16 * 3 * 2 * 16 * 16).map(|i| ((i * 7919) % 255) as f32 / 127.0 - 1.0).collect();
    let out = tower.encode(&rows, [1, 4, 4]).expect("encode");
    assert_eq!(out.len(), 4 * TINY.hidden);
    assert!(out.iter().all(|v| v.is_finite()) && out.iter().any(|v| v.abs() > 1e-3));
    let m = osprey_models::load_on(&dir, cpu()).expect("load the decoder");
    let mut st = m.new_state();
    let ids: Vec<u32> = (1..=20).collect();
    let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&ids) };
    let logits = m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("forward").logits.remove(0);
    assert_eq!(logits.len(), 2048);
    assert!(logits[..1024].iter().all(|v| v.is_finite()) && logits[1024..].iter().all(|&v| v == 0.0));
    let best = logits.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i);
    assert!(best.is_some_and(|i| i < 1024), "greedy picks a token the tokenizer has: {best:?}");
}

fn cpu() -> osprey_models::backend::BackendRef {
    osprey_backend_cpu::CpuBackend::shared()
}

fn run(fraction: f64, ple_fraction: f64, decode_tokens: usize) -> osprey_bench::ExpertsRun {
    osprey_bench::ExpertsRun {
        fraction,
        ple_fraction,
        prompt_len: 8,
        decode_tokens,
        wait_all: false,
        warmup: false,
        prefetch: osprey_bench::Prefetch::Off,
        prefetch_depth: 1,
    }
}
