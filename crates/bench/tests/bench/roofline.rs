//! Issue 51, item 6: `bench roofline` measures each step on a metering emulated device and prices it on
//! a card. On a synthetic checkpoint: a decode token must move at least the weights it reads (the dense
//! part and its top-k experts), the launches' bytes cover the step's must-move bytes, and the model of a
//! deeper checkpoint, built from the head-only copy, adds layers at the measured average.

use osprey_bench::roofline::{self, head_only, RooflineBench};
use osprey_bench::synth::{synth, TINY};
use osprey_runner::Driver;

fn measure(dir: &std::path::Path, b: &RooflineBench) -> Vec<(String, roofline::Work)> {
    let backend = osprey_backend_cuda::open_emulated_measuring(1 << 30, osprey_models::backend::Precision::Exact);
    let model = osprey_models::load_on(dir, backend).expect("load on cuda-emu");
    roofline::measure(&mut Driver::new(model, 16), b).expect("measure")
}

#[test]
fn a_decode_step_moves_at_least_the_weights_it_reads_and_the_model_scales_by_layers() {
    let base = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("roofline");
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join("tiny-L4");
    synth(&dir, TINY, 4, 5).expect("synth");
    let b = RooflineBench {
        prompt: 3,
        decode_tokens: 2,
        batches: vec![1, 2],
        prefill: 8,
        contexts: vec![],
        attention: None,
    };
    let steps = measure(&dir, &b);
    let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["decode x1", "decode x2", "prefill 8"]);

    let cpu = osprey_models::load_on(&dir, osprey_backend_cpu::CpuBackend::shared()).expect("load");
    let (dense, per_expert) = cpu.weight_bytes();
    let info = cpu.info();
    let weights = (dense + info.moe_layers * info.experts_per_token * per_expert) as f64;
    let (_, one) = &steps[0];
    let launched: f64 = one.kernels.iter().map(|k| k.bytes[0] + k.bytes[1]).sum();
    // The head's embedding table is read one row per token, so the step may move less than `dense`;
    // never less than the routed experts and the LM head.
    let lm_head = (info.vocab_size * info.hidden_size * 2) as f64;
    let experts = (info.moe_layers * info.experts_per_token * per_expert) as f64;
    assert!(one.must_move >= lm_head + experts, "{} < {}", one.must_move, lm_head + experts);
    assert!(one.must_move <= 1.5 * weights, "{} vs {weights}", one.must_move);
    assert!(launched >= one.must_move, "each launch's distinct bytes sum over the step's windows");
    assert!(one.kernels.iter().any(|k| k.name == "linear_grouped_gemv" && k.flops[0] > 0.0), "declared arithmetic");
    // Two sequences read the same dense weights once per step.
    let (_, two) = &steps[1];
    assert!(two.must_move < 2.0 * one.must_move, "{} vs {}", two.must_move, one.must_move);

    // The head-only copy; the model of the same depth is the measurement itself.
    let (head_dir, layers) = head_only(&dir, &base.join("tiny-L0")).expect("head-only copy");
    assert_eq!(layers, 4);
    let head = measure(&head_dir, &b);
    let same = roofline::scale(one, &head[0].1, 4, 4, (info.vocab_size, info.vocab_size));
    assert!((same.must_move - one.must_move).abs() < 1.0, "{} vs {}", same.must_move, one.must_move);
    let deep = roofline::scale(one, &head[0].1, 4, 40, (info.vocab_size, info.vocab_size));
    let per_layer = (one.must_move - head[0].1.must_move) / 4.0;
    assert!((deep.must_move - (head[0].1.must_move + 40.0 * per_layer)).abs() < 1.0);
    assert!(head[0].1.must_move >= lm_head, "the head alone reads the LM head");

    let card = roofline::card("rtx-4090").expect("a card");
    let (eager, graph) = (roofline::price(&deep, &card, false), roofline::price(&deep, &card, true));
    assert!(graph.secs < eager.secs && eager.roofline_secs > 0.0 && eager.fraction < 1.0);
}

/// Issue 52's long-context target: decode at a context is the one-sequence step with its attention
/// layers measured at that context instead of at the prompt's. Everything but attention is the step's;
/// the attention reads each position's K and V once per KV head (f32 or bf16), so its bytes and the
/// step's must-move bytes grow by that, and the modelled step slows with the context.
#[test]
fn decode_at_a_long_context_reads_its_kv_once_beside_the_same_step() {
    let base = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("roofline-context");
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join("tiny-L4");
    synth(&dir, TINY, 4, 5).expect("synth");
    let cfg = osprey_models::ModelConfig::from_dir(&dir).expect("config").text;
    let shape = osprey_models::backend::AttnShape {
        heads: cfg.num_attention_heads,
        kv_heads: cfg.num_key_value_heads,
        head_dim: cfg.head_dim(),
    };
    let b = RooflineBench {
        prompt: 3,
        decode_tokens: 2,
        batches: vec![1],
        prefill: 0,
        contexts: vec![4096],
        attention: Some(shape),
    };
    let steps = measure(&dir, &b);
    let names: Vec<&str> = steps.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, ["decode x1", "decode x1 at 4096, f32 KV", "decode x1 at 4096, bf16 KV"]);
    let kinds = cfg.layer_kinds().expect("layers");
    let layers = kinds.iter().filter(|k| matches!(k, osprey_models::config::LayerKind::Full)).count() as f64;
    assert!(layers > 0.0, "the checkpoint has attention layers");
    let attn = |w: &roofline::Work| -> f64 {
        w.kernels.iter().filter(|k| k.name.starts_with("attention_")).map(|k| k.bytes[0] + k.bytes[1]).sum()
    };
    let rest = |w: &roofline::Work| -> Vec<(String, [f64; 2])> {
        w.kernels.iter().filter(|k| !k.name.starts_with("attention_")).map(|k| (k.name.clone(), k.bytes)).collect()
    };
    let one = &steps[0].1;
    for (i, size) in [(1, 4.0), (2, 2.0)] {
        let w = &steps[i].1;
        let kv = layers * 4096.0 * 2.0 * (shape.kv_heads * shape.head_dim) as f64 * size;
        assert!(attn(w) >= kv, "{}: {} < {kv}: K and V read", steps[i].0, attn(w));
        assert!(attn(w) <= 1.1 * kv + attn(one), "{}: {} vs {kv}: read once per KV head", steps[i].0, attn(w));
        let mut a = rest(w);
        let mut b = rest(one);
        a.sort_by(|x, y| x.0.cmp(&y.0));
        b.sort_by(|x, y| x.0.cmp(&y.0));
        assert_eq!(a, b, "{}: the rest of the step is the measured one", steps[i].0);
        assert!(w.must_move >= one.must_move + 0.9 * kv, "{}: {} vs {}", steps[i].0, w.must_move, one.must_move);
    }
    let card = roofline::card("rtx-4090").expect("a card");
    let secs = |w: &roofline::Work| roofline::price(w, &card, true).secs;
    assert!(secs(one) < secs(&steps[2].1) && secs(&steps[2].1) < secs(&steps[1].1), "bf16 KV between");
}

#[test]
fn the_cards_in_docs_cuda_md_are_the_ones_the_model_prices() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/cuda.md")).expect("docs/cuda.md");
    let rows: Vec<Vec<String>> = doc
        .lines()
        .filter(|l| l.starts_with("| ") && roofline::card(l[2..].split(' ').next().unwrap_or("")).is_some())
        .map(|l| l.trim_matches('|').split('|').map(|c| c.trim().to_string()).collect())
        .collect();
    assert_eq!(rows.len(), roofline::CARDS.len(), "one row per card");
    for (row, c) in rows.iter().zip(roofline::CARDS) {
        let nums: Vec<f64> = row[1..].iter().map(|v| v.parse().expect("a number")).collect();
        assert_eq!(row[0], c.name);
        assert_eq!(nums, [c.bandwidth_gb_s, c.fp32_tflops, c.bf16_tflops, c.int8_tops, c.pcie_gb_s], "{}", c.name);
    }
}

/// The head-only copy of a `qwen4_exp` checkpoint loads too: its PLE layer list names no layer.
#[test]
fn a_flash_next_checkpoint_has_a_head_only_copy_that_loads() {
    let base = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("roofline-flash");
    let _ = std::fs::remove_dir_all(&base);
    let dir = base.join("tiny-flash-L4");
    synth(&dir, osprey_bench::synth::TINY_FLASH, 4, 6).expect("synth");
    // Named relative to the working directory, as `--model DIR` may be: the copy's links must not dangle.
    let cwd = std::env::current_dir().expect("cwd");
    let up: std::path::PathBuf = cwd.components().skip(1).map(|_| "..").collect();
    let relative = up.join(dir.strip_prefix("/").expect("an absolute directory"));
    let (head_dir, layers) = head_only(&relative, &base.join("head")).expect("head-only copy");
    assert_eq!(layers, 4);
    let head = osprey_models::load_on(&head_dir, osprey_backend_cpu::CpuBackend::shared()).expect("the head loads");
    assert_eq!(head.info().num_layers, 0);
}
