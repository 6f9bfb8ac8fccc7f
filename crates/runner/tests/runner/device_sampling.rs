//! Issue 51, item 2: sampling on the device. On `cuda-emu` a request's draws — temperature, top-k,
//! top-p, min-p, penalties, logit bias, a grammar's mask — happen where the logits are: one id per
//! sequence comes back, every sequence of a step in one download, and the tokens are the host sampler's
//! (the same request asking for logprobs samples on the host from the same logits).

use crate::common;

use std::sync::Arc;

use osprey_models::backend::{BackendRef, DeviceStats};
use osprey_protocol::constraint::{CompiledGrammar, Constraint, GrammarError, TokenMatcher};
use osprey_protocol::scheduler::SamplingParams;
use osprey_protocol::tokenizer::PreparedPrompt;
use osprey_runner::{Driver, GenerateOptions, NoMedia, Work};

/// A grammar over a vocabulary of `.0` tokens that allows, at step `i`, the tokens `t` with
/// `t % 3 == i % 3` (and refuses any other).
#[derive(Debug)]
struct Thirds(usize);

/// Its matcher: the step and the vocabulary.
#[derive(Debug)]
struct ThirdsAt(u32, usize);

impl CompiledGrammar for Thirds {
    fn start(&self, _budget: Option<usize>) -> Box<dyn TokenMatcher> {
        Box::new(ThirdsAt(0, self.0))
    }
    fn shortest_answer(&self) -> usize {
        1
    }
}

impl TokenMatcher for ThirdsAt {
    fn allowed(&mut self, allowed: &mut Vec<u32>) -> Result<(), GrammarError> {
        allowed.clear();
        allowed.extend(
            (0..self.1.div_ceil(32) as u32)
                .map(|w| (0..32).filter(|b| (w * 32 + b) % 3 == self.0 % 3).fold(0u32, |m, b| m | 1 << b)),
        );
        Ok(())
    }
    fn commit(&mut self, token: u32) -> Result<(), GrammarError> {
        if token % 3 != self.0 % 3 {
            return Err(GrammarError(format!("token {token} at step {}", self.0)));
        }
        self.0 += 1;
        Ok(())
    }
}

fn device() -> (Driver, BackendRef) {
    let backend = osprey_backend_cuda::open_emulated(1 << 30);
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let model = osprey_models::load_on(&dir, backend.clone()).expect("load on cuda-emu");
    (Driver::new(model, 16), backend)
}

/// The request settings the tests draw under: every cut, every penalty and a bias; and a grammar.
fn settings(vocab: usize) -> Vec<(&'static str, SamplingParams)> {
    let hot = SamplingParams {
        temperature: 0.9,
        top_k: 40,
        top_p: 0.9,
        min_p: 0.02,
        repetition_penalty: 1.2,
        presence_penalty: 0.3,
        frequency_penalty: 0.2,
        logit_bias: vec![(5, 2.0), (7, -3.0)],
        seed: Some(11),
        ..SamplingParams::default()
    };
    let masked = SamplingParams {
        temperature: 1.0,
        seed: Some(5),
        constraint: Some(Constraint { grammar: Arc::new(Thirds(vocab)), budget: None }),
        ..SamplingParams::default()
    };
    vec![("every cut and penalty", hot), ("a grammar's mask", masked)]
}

fn between(a: &DeviceStats, b: &DeviceStats) -> (u64, u64) {
    (b.host_waits - a.host_waits, b.bytes_from_device - a.bytes_from_device)
}

/// One request at a time: its decode tokens each read back 4 bytes in one host wait, and its tokens are
/// the ones the host sampler draws from the same device's logits (the request asking for logprobs, which
/// the host computes, samples there). Mutation: the device's draw with a different u (`u * total` →
/// `(1 - u) * total` in `kernels/sample.cu`) fails it.
#[test]
fn a_request_draws_on_the_device_the_host_samplers_tokens_reading_back_its_ids() {
    let (mut d, backend) = device();
    let vocab = d.model().info().vocab_size;
    let prompt = Arc::new(PreparedPrompt::text((0..11u32).map(|i| (i * 53 + 7) % vocab as u32).collect()));
    let opts = GenerateOptions { chunk: 64, max_tokens: 10, stop_token_ids: Vec::new() };
    for (name, p) in settings(vocab) {
        let mut at_first = backend.stats();
        let on_device = d
            .generate_observed(prompt.clone(), p.clone(), &opts, &mut NoMedia, &mut || at_first = backend.stats())
            .expect("generate on the device");
        let (waits, bytes) = between(&at_first, &backend.stats());
        let decode = on_device.tokens.len() as u64 - 1;
        assert_eq!(on_device.tokens.len(), 10, "{name}");
        assert_eq!((waits, bytes), (decode, 4 * decode), "{name}: one id, one wait a decode token");
        let host = SamplingParams { logprobs: Some(1), ..p.clone() };
        let on_host = d.generate(prompt.clone(), host, &opts, &mut NoMedia).expect("generate on the host");
        assert_eq!(on_device.tokens, on_host.tokens, "{name}");
        if name == "a grammar's mask" {
            assert!(
                on_device.tokens.iter().enumerate().all(|(i, t)| *t as usize % 3 == i % 3),
                "{:?}",
                on_device.tokens
            );
        }
    }
}

/// Three sequences decoding together — greedy, sampled with every cut and penalty, and under a grammar —
/// read their three ids back in one host wait a step, their head computed in one call (one read of its
/// weights), and each draws the tokens it draws decoded alone.
#[test]
fn a_batch_reads_back_every_sequences_id_in_one_wait() {
    let (mut d, backend) = device();
    let vocab = d.model().info().vocab_size;
    let mut all = vec![SamplingParams { temperature: 0.0, ..SamplingParams::default() }];
    all.extend(settings(vocab).into_iter().map(|(_, p)| p));
    let plen = 9;
    for (s, p) in all.iter().enumerate() {
        let ids = (0..plen as u32).map(|i| (i * 31 + 3 * s as u32) % vocab as u32).collect();
        d.admit(s as u64, Arc::new(PreparedPrompt::text(ids)), p.clone(), None, &[]).expect("admit");
    }
    let work = |start: usize, end: usize| -> Vec<Work> {
        (0..all.len() as u64)
            .map(|seq| Work {
                seq,
                admit: None,
                start,
                end,
                sample: true,
                snapshot: false,
                budget: 1 << 20,
                span: tracing::Span::none(),
            })
            .collect()
    };
    let mut together: Vec<Vec<u32>> = vec![Vec::new(); all.len()];
    let mut run = |d: &mut Driver, w: &[Work]| {
        for (seq, r) in d.step(w, &mut NoMedia) {
            let done = r.expect("a step");
            assert_eq!(done.sampled.len(), 1, "sequence {seq}");
            together[seq as usize].push(done.sampled[0].0);
        }
    };
    run(&mut d, &work(0, plen));
    let before = backend.stats();
    for i in 0..3 {
        run(&mut d, &work(plen + i, plen + i + 1));
    }
    let heads = |s: &DeviceStats| s.kernels.iter().find(|(k, _)| k == "linear_gemv").map_or(0, |(_, n)| *n);
    let per_step = (heads(&backend.stats()) - heads(&before)) / 3;
    let (waits, bytes) = between(&before, &backend.stats());
    assert_eq!((waits, bytes), (3, 3 * 4 * all.len() as u64), "one wait a step, 4 bytes a sequence");
    let launched = backend.stats().kernels.into_iter().find(|(k, _)| k == "sample_rows").map_or(0, |(_, n)| n);
    assert!(launched >= 3, "{launched}");
    // Alone, each sequence draws the same four tokens; a decode step alone launches as many GEMVs as
    // the three together (the head is one call for the three rows, every other GEMV one for the batch).
    for (s, p) in all.iter().enumerate() {
        let (mut alone, backend) = device();
        let ids = (0..plen as u32).map(|i| (i * 31 + 3 * s as u32) % vocab as u32).collect();
        let opts = GenerateOptions { chunk: 64, max_tokens: 4, stop_token_ids: Vec::new() };
        let mut at_first = backend.stats();
        let g = alone
            .generate_observed(Arc::new(PreparedPrompt::text(ids)), p.clone(), &opts, &mut NoMedia, &mut || {
                at_first = backend.stats()
            })
            .expect("alone");
        assert_eq!(g.tokens, together[s], "sequence {s}: together and alone");
        assert_eq!((heads(&backend.stats()) - heads(&at_first)) / 3, per_step, "GEMV launches a decode step");
    }
}
