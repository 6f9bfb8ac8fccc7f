//! Speculative decoding with the draft head, through the one generation driver: greedy answers are the
//! non-speculative ones token for token, for K = 1…4, on the dense and MoE tiny checkpoints with a head,
//! with one expert slot per layer too (answers identical whatever the budget); the counters add up.

use crate::common;

use std::sync::Arc;

use osprey_backend_cpu::CpuBackend;
use osprey_models::{LoadOptions, Model};
use osprey_protocol::scheduler::{FinishReason, SamplingParams};
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_runner::{Driver, GenerateOptions, NoMedia};

const MODELS: [&str; 2] = ["qwen3_5-tiny-mtp", "qwen3_5_moe-tiny-mtp"];

fn load(name: &str, draft_head: bool, expert_slots: Option<usize>) -> Model {
    let dir = common::fixtures().join("models").join(name);
    let cfg = osprey_models::ModelConfig::from_dir(&dir).expect("config");
    let ck = osprey_models::Checkpoint::open(&dir).expect("checkpoint");
    let opts = LoadOptions { draft_head, expert_slots, ..LoadOptions::default() };
    osprey_models::load_with_options(&cfg, &ck, opts, CpuBackend::shared(), &mut |_, _| {}).expect("load")
}

fn prompts() -> Vec<Arc<PreparedPrompt>> {
    [(23, 37u32, 11u32), (70, 13, 5), (9, 101, 3)]
        .iter()
        .map(|&(n, a, c)| Arc::new(PreparedPrompt::text((0..n).map(|i| (i * a + c) % 990).collect())))
        .collect()
}

fn generate(d: &mut Driver, p: &Arc<PreparedPrompt>, max_tokens: usize, stop: &[u32]) -> (Vec<u32>, FinishReason) {
    let greedy = SamplingParams { temperature: 0.0, ..SamplingParams::default() };
    let opts = GenerateOptions { chunk: 16, max_tokens, stop_token_ids: stop.to_vec() };
    let g = d.generate(p.clone(), greedy, &opts, &mut NoMedia).expect("generate");
    (g.tokens, g.finish)
}

#[test]
fn greedy_speculative_answers_are_the_plain_answers() {
    for name in MODELS {
        let mut plain = Driver::new(load(name, false, None), 16);
        let want: Vec<_> = prompts().iter().map(|p| generate(&mut plain, p, 33, &[])).collect();
        for slots in [None, Some(1)] {
            for k in 1..=4 {
                let mut d = Driver::new(load(name, true, slots), 16).with_speculative(k).expect("head");
                for (p, w) in prompts().iter().zip(&want) {
                    assert_eq!(&generate(&mut d, p, 33, &[]), w, "{name} K={k} slots={slots:?}");
                }
                let c = d.spec_counters();
                println!("{name} K={k} slots={slots:?}: {c:?} ({:.2} tokens per forward)", c.tokens_per_forward());
                assert!(c.forwards > 0 && c.drafted == c.drafted_at.iter().sum::<u64>(), "{name} K={k}");
                assert_eq!(c.accepted, c.accepted_at.iter().sum::<u64>());
                assert!(
                    c.accepted_at.windows(2).all(|w| w[0] >= w[1]),
                    "a later draft is accepted only after the earlier"
                );
                // Each verification emits its accepted drafts plus one token (fewer only at the end).
                assert!(c.emitted <= c.accepted + c.forwards && c.emitted + 3 >= c.accepted + c.forwards);
            }
        }
    }
}

#[test]
fn a_stop_token_inside_a_step_ends_the_answer_there() {
    for name in MODELS {
        let mut plain = Driver::new(load(name, false, None), 16);
        let p = &prompts()[1];
        let (all, _) = generate(&mut plain, p, 30, &[]);
        // Stop at the sixth token: whatever a speculative step emitted after it is dropped.
        let stop = all[5];
        let first = all.iter().position(|&t| t == stop).expect("present");
        for k in 1..=4 {
            let mut d = Driver::new(load(name, true, None), 16).with_speculative(k).expect("head");
            let (got, finish) = generate(&mut d, p, 30, &[stop]);
            assert_eq!((got.as_slice(), finish), (&all[..=first], FinishReason::Stop), "{name} K={k}");
        }
    }
}

#[test]
fn speculation_needs_a_loaded_head_and_at_most_four_drafts() {
    assert!(Driver::new(load("qwen3_5_moe-tiny-mtp", false, None), 16).with_speculative(2).is_err());
    assert!(Driver::new(load("qwen3_5_moe-tiny-mtp", true, None), 16).with_speculative(5).is_err());
    assert!(Driver::new(common::model("qwen3_5-tiny"), 16).with_speculative(0).is_ok());
}

/// Drafts that agree with the plain answer except where the test makes them wrong: the acceptance path,
/// the rewind to a partial acceptance and the head's pending rows are all exercised (a random-weight
/// head accepts almost nothing by itself).
#[test]
fn agreeing_drafts_are_accepted_and_the_answer_is_unchanged() {
    for name in MODELS {
        let mut plain = Driver::new(load(name, false, None), 16);
        for p in prompts() {
            let (all, _) = generate(&mut plain, &p, 33, &[]);
            let plen = p.input_ids.len();
            for (k, wrong_every) in [(1, 0), (2, 0), (3, 0), (4, 0), (1, 3), (2, 4), (3, 5), (4, 3), (4, 2)] {
                let truth = all.clone();
                let oracle = move |ctx: &[u32]| {
                    let i = ctx.len() - plen;
                    let t = *truth.get(i)?;
                    Some(if wrong_every > 0 && i.is_multiple_of(wrong_every) { (t + 1) % 990 } else { t })
                };
                let mut d =
                    Driver::new(load(name, true, None), 16).with_speculative(k).expect("head").override_drafts(oracle);
                assert_eq!(generate(&mut d, &p, 33, &[]).0, all, "{name} K={k} wrong every {wrong_every}");
                let c = d.spec_counters();
                if wrong_every == 0 {
                    // 32 tokens after the first, K + 1 per verification.
                    assert_eq!(c.forwards, 32u64.div_ceil(k as u64 + 1), "{name} K={k}: {c:?}");
                    assert_eq!(c.emitted, 32);
                } else {
                    assert!(c.accepted > 0 && c.accepted < c.drafted, "{name} K={k}: {c:?}");
                }
            }
        }
    }
}
