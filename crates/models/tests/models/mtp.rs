//! The draft head (`mtp.*`) against its PyTorch reference (`tools/gen_mtp_fixtures.py`, built from
//! vLLM's description: transformers has none), and the verification rewind speculative decoding needs.
//!
//! Tolerance: `ATOL = 1e-4`, parity.rs's, for the same reasons (values of magnitude up to ~8, our sums in
//! other orders; a wrong norm, half of `fc` or rope position moves values by 1e-2 or more). The head is
//! one layer, so its stages are compared free running from the reference's main hidden states (teacher
//! forcing at the head's input): fc output, layer output, normed output, logits.

use crate::common;

use common::{assert_close, assert_rows_close, fixtures, Ref};
use osprey_backend_cpu::CpuBackend;
use osprey_models::{
    CausalLm, DraftStep, ForwardOptions, LoadOptions, LogitsWanted, Model, Positions, SeqInput, SeqStep,
};

const ATOL: f32 = 1e-4;
const MODELS: [&str; 2] = ["qwen3_5-tiny-mtp", "qwen3_5_moe-tiny-mtp"];

fn load(name: &str, draft_head: bool) -> Model {
    let dir = fixtures().join("models").join(name);
    let cfg = osprey_models::ModelConfig::from_dir(&dir).expect("config");
    let ck = osprey_models::Checkpoint::open(&dir).expect("checkpoint");
    let opts = LoadOptions { draft_head, ..LoadOptions::default() };
    osprey_models::load_with_options(&cfg, &ck, opts, CpuBackend::exact(), &mut |_, _| {}).expect("load")
}

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("logits")
}

#[test]
fn the_draft_head_matches_its_reference_stage_by_stage() {
    for name in MODELS {
        let m = load(name, true);
        assert!(m.has_draft_head(), "{name}");
        let b = m.backend().clone();
        let h = m.info().hidden_size;
        for case in ["text", "long"] {
            let r = Ref::load(name, case);
            let (tokens, hidden) = (r.ids("mtp_tokens"), r.f32s("main_hidden"));
            let n = tokens.len();
            // The main model fills the sequence's KV (the head's plane is its own), then the head runs
            // over every entry from the reference's hidden states.
            let mut st = m.new_state();
            let ids = r.ids("input_ids");
            let input = SeqInput { logits: LogitsWanted::None, ..SeqInput::text(&ids) };
            m.forward(&mut [SeqStep { state: &mut st, input }], false).expect("main forward");
            let hid = b.upload_f32(&hidden, &[n, h]).expect("upload");
            let step = DraftStep { state: &mut st, tokens: &tokens, hidden: hid, start: 0, positions: Positions::Text };
            let out = m.draft(&mut [step], true).expect("draft");
            for (i, stage) in ["fc", "layer", "out", "logits"].iter().enumerate() {
                assert_rows_close(
                    &format!("{name} {case} {stage}"),
                    &out.captured[i],
                    &r,
                    &format!("mtp.{stage}"),
                    ATOL,
                );
            }
            // The reference's rows end at the last entry (tools/trim_refs.py).
            let want = r.f32s("mtp.logits");
            let v = out.logits[0].len();
            assert_close(&format!("{name} {case} last logits"), &out.logits[0], &want[want.len() - v..], ATOL);
        }
    }
}

#[test]
fn drafting_chains_the_head_like_the_reference_in_any_split() {
    for name in MODELS {
        let m = load(name, true);
        let b = m.backend().clone();
        let h = m.info().hidden_size;
        for case in ["text", "long"] {
            let r = Ref::load(name, case);
            let (tokens, ids) = (r.ids("mtp_tokens"), r.ids("input_ids"));
            let n = tokens.len();
            let mut st = m.new_state();
            // Our own main forward gives the hidden rows (what the driver feeds the head).
            let input = SeqInput { logits: LogitsWanted::Last, ..SeqInput::text(&ids) };
            let opts = ForwardOptions { keep_hidden: true, ..ForwardOptions::default() };
            let main = m.forward_with(&mut [SeqStep { state: &mut st, input }], &opts).expect("main");
            assert_eq!(argmax(&main.logits[0]), r.ids("next_token")[0], "{name} {case}: the main model's next token");
            let hidden = main.last_hidden.expect("kept hidden rows");
            // The entries in two pieces (the head's KV carries across), then the chain.
            let cut = n / 3;
            let rows = |r: std::ops::Range<usize>| b.gather_rows(&hidden, &r.collect::<Vec<_>>()).expect("rows");
            let first = DraftStep {
                state: &mut st,
                tokens: &tokens[..cut],
                hidden: rows(0..cut),
                start: 0,
                positions: Positions::Text,
            };
            m.draft(&mut [first], false).expect("draft");
            let rest = DraftStep {
                state: &mut st,
                tokens: &tokens[cut..],
                hidden: rows(cut..n),
                start: cut,
                positions: Positions::Text,
            };
            let mut out = m.draft(&mut [rest], false).expect("draft");
            let want_ids = r.ids("draft_ids");
            let want_logits = r.f32s("draft_logits");
            let v = m.info().vocab_size;
            let mut drafts = Vec::new();
            for j in 0..want_ids.len() {
                assert_close(
                    &format!("{name} {case} draft {j}"),
                    &out.logits[0],
                    &want_logits[j * v..(j + 1) * v],
                    ATOL,
                );
                let d = argmax(&out.logits[0]);
                drafts.push(d);
                let next = [d];
                let hid = out.hidden.remove(0);
                assert_eq!(hid.shape(), [1, h]);
                let step =
                    DraftStep { state: &mut st, tokens: &next, hidden: hid, start: n + j, positions: Positions::Text };
                out = m.draft(&mut [step], false).expect("draft ahead");
            }
            assert_eq!(drafts, want_ids, "{name} {case}: greedy drafts");
        }
    }
}

#[test]
fn a_rewound_verification_continues_like_single_token_steps_bit_for_bit() {
    for name in MODELS {
        let m = load(name, true);
        let prompt: Vec<u32> = (0..37).map(|i| (i * 41 + 3) % 990).collect();
        let verify: [u32; 4] = [17, 230, 5, 911];
        for keep in 1..=verify.len() {
            // Speculative: one verification forward of four tokens, rewound to `keep` of them.
            let mut spec = m.new_state();
            let input = SeqInput { logits: LogitsWanted::None, ..SeqInput::text(&prompt) };
            m.forward(&mut [SeqStep { state: &mut spec, input }], false).expect("prefill");
            let input = SeqInput { logits: LogitsWanted::All, ..SeqInput::text(&verify) };
            let opts = ForwardOptions { verify: &[true], ..ForwardOptions::default() };
            let all =
                m.forward_with(&mut [SeqStep { state: &mut spec, input }], &opts).expect("verify").logits.remove(0);
            spec.rewind(prompt.len() + keep, verify.len()).expect("rewind");
            // Plain: the same tokens one step at a time.
            let mut plain = m.new_state();
            let input = SeqInput { logits: LogitsWanted::None, ..SeqInput::text(&prompt) };
            m.forward(&mut [SeqStep { state: &mut plain, input }], false).expect("prefill");
            let v = m.info().vocab_size;
            for (j, t) in verify[..keep].iter().enumerate() {
                let one = [*t];
                let got =
                    m.forward(&mut [SeqStep { state: &mut plain, input: SeqInput::text(&one) }], false).expect("step");
                assert_eq!(
                    got.logits[0],
                    all[j * v..(j + 1) * v],
                    "{name}: verification row {j} is a decode step's bits"
                );
            }
            // Both continue from the same state.
            let next = [444u32];
            let a = m.forward(&mut [SeqStep { state: &mut spec, input: SeqInput::text(&next) }], false).expect("a");
            let b = m.forward(&mut [SeqStep { state: &mut plain, input: SeqInput::text(&next) }], false).expect("b");
            assert_eq!(a.logits, b.logits, "{name}: after a rewind to {keep} of 4");
            assert_eq!(spec.len(), plain.len());
        }
        // A rewind that was not prepared by a verification is refused.
        let mut st = m.new_state();
        m.forward(&mut [SeqStep { state: &mut st, input: SeqInput::text(&prompt) }], false).expect("prefill");
        assert!(st.rewind(prompt.len() - 2, 4).is_err(), "{name}: no kept states");
    }
}

#[test]
fn without_the_option_the_head_is_not_loaded_and_takes_no_kv_plane() {
    for name in MODELS {
        let (plain, spec) = (load(name, false), load(name, true));
        assert!(!plain.has_draft_head());
        assert_eq!(spec.kv_layout().layers, plain.kv_layout().layers + 1, "{name}");
        let base =
            osprey_models::load_on(&fixtures().join("models").join(name.trim_end_matches("-mtp")), CpuBackend::exact())
                .expect("base");
        let ids: Vec<u32> = (0..20).map(|i| i * 7 % 900).collect();
        let mut a = plain.new_state();
        let mut c = base.new_state();
        let la = plain.forward(&mut [SeqStep { state: &mut a, input: SeqInput::text(&ids) }], false).expect("a");
        let lc = base.forward(&mut [SeqStep { state: &mut c, input: SeqInput::text(&ids) }], false).expect("c");
        assert_eq!(la.logits, lc.logits, "{name}: the head changes nothing of the main model");
    }
}
