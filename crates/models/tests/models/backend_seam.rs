//! The compute-backend seam seen from outside: a model is built on whatever backend it is given, every
//! weight is placed by that backend at load, and a forward crosses to the host only where the seam says
//! it may (token ids and positions in, one router top-k per MoE layer, the sampled rows' logits out) —
//! never once per layer. A counting backend wraps the CPU one to check it, and the answers must be the
//! CPU backend's to the bit.

use crate::common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use osprey_backend::{
    Backend, CoreOps, DType, ExpertKey, ExpertOps, ExpertPool, Fence, HostData, HostExpert, HostMatrix, HostVec, MRope,
    MemoryOps, Op, Result, RopeTable, Tensor, Wrapper,
};
use osprey_backend_cpu::testing::HostOps;
use osprey_backend_cpu::CpuBackend;
use osprey_models::layers::predict::{Ahead, ExpertPredictor, Replay};
use osprey_models::{CausalLm, LogitsWanted, Positions, SeqInput, SeqStep};

/// The CPU backend with its host crossings counted.
#[derive(Debug, Default)]
struct Counting {
    cpu: CpuBackend,
    placed: AtomicUsize,
    /// f32 uploads (token embeddings of injected rows, rope tables).
    uploads: AtomicUsize,
    /// f32 downloads (logits).
    downloads: AtomicUsize,
    /// i32 downloads: routed expert ids (the routing sync).
    routing: AtomicUsize,
    /// i32 uploads: slot ids of a wave.
    slot_ids: AtomicUsize,
    /// Experts copied into slots.
    expert_uploads: AtomicUsize,
    /// Whether it runs `qwen4_exp`'s ops (the CPU's, in place).
    qwen4: bool,
}

fn bump(c: &AtomicUsize) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Wrapper for Counting {
    fn inner(&self) -> &dyn Backend {
        &self.cpu
    }
    fn describe(&self) -> String {
        format!("counting {}", self.cpu.describe())
    }
    /// Like a device backend still without them, it has none of the ops only `qwen4_exp` runs, unless
    /// built with them (`qwen4`).
    fn supports(&self, op: Op) -> bool {
        self.qwen4 || !matches!(op, Op::GroupedNorms | Op::HyperConnections | Op::Ple | Op::AttentionSelected)
    }
    fn place_weight(&self, w: Arc<dyn HostMatrix>) -> Result<Tensor> {
        bump(&self.placed);
        self.cpu.place_weight(w)
    }
    fn upload(&self, data: HostData<'_>, shape: &[usize]) -> Result<Tensor> {
        bump(if matches!(data, HostData::I32(_)) { &self.slot_ids } else { &self.uploads });
        self.cpu.upload(data, shape)
    }
    fn download(&self, t: &Tensor) -> Result<HostVec> {
        bump(if t.dtype() == DType::I32 { &self.routing } else { &self.downloads });
        self.cpu.download(t)
    }
    fn rope_table(&self, rope: &MRope, positions: &[[i64; 3]]) -> Result<RopeTable> {
        // Tables are computed where the positions are (the host) and sent once per forward.
        bump(&self.uploads);
        self.cpu.rope_table(rope, positions)
    }
    fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, expert: HostExpert, after: Fence) -> Result<Fence> {
        bump(&self.expert_uploads);
        self.cpu.upload_expert(pool, slot, expert, after)
    }
}

/// `[placed, f32 uploads, f32 downloads, routing syncs, slot-id uploads, expert uploads]` since the last call.
fn counts(c: &Counting) -> [usize; 6] {
    [&c.placed, &c.uploads, &c.downloads, &c.routing, &c.slot_ids, &c.expert_uploads]
        .map(|a| a.swap(0, Ordering::Relaxed))
}

fn run(m: &dyn CausalLm, st: &mut osprey_models::SeqState, ids: &[u32], logits: LogitsWanted) -> Vec<f32> {
    let input = SeqInput { tokens: ids, positions: Positions::Text, injected: &[], logits };
    m.forward(&mut [SeqStep { state: st, input }], false).expect("forward").logits.remove(0)
}

fn argmax(l: &[f32]) -> u32 {
    l.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("logits")
}

#[test]
fn weights_are_placed_at_load_and_a_forward_crosses_to_the_host_only_for_routing_and_logits() {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let counting = Arc::new(Counting::default());
    let model = osprey_models::load_on(&dir, counting.clone()).expect("load on the counting backend");
    let reference = osprey_models::load_on(&dir, CpuBackend::shared()).expect("load on the CPU backend");
    let info = model.info().clone();
    let [placed, ..] = counts(&counting);
    // Every linear of every layer, the router, the shared expert and the embedding went through the
    // backend (the routed experts go into slots when a step needs them, not here).
    assert!(placed >= 4 * info.num_layers, "{placed} weights placed for {} layers", info.num_layers);

    let prompt: Vec<u32> = (1..=12).collect();
    let (mut st, mut want) = (model.new_state(), reference.new_state());
    // A prefill chunk that wants no logits downloads only the routed ids, once per MoE layer.
    assert!(run(&model, &mut st, &prompt[..8], LogitsWanted::None).is_empty());
    run(&reference, &mut want, &prompt[..8], LogitsWanted::None);
    let [_, uploads, downloads, routing, _, expert_uploads] = counts(&counting);
    assert_eq!((downloads, uploads), (0, 1), "only the rope table goes up; no activation comes down");
    assert_eq!(routing, info.moe_layers, "one routing sync per MoE layer");
    assert_eq!(expert_uploads as u64, model.slot_stats().misses, "an upload per slot miss");
    // The rest of the prompt, then decode steps: one logits download each.
    let mut got = run(&model, &mut st, &prompt[8..], LogitsWanted::Last);
    let mut reference_logits = run(&reference, &mut want, &prompt[8..], LogitsWanted::Last);
    for step in 0..4 {
        assert_eq!(got, reference_logits, "step {step}: the counting backend computes the CPU backend's answer");
        let [_, _, downloads, routing, ..] = counts(&counting);
        assert_eq!(downloads, 1, "step {step}: one download per forward, not per layer");
        assert_eq!(routing, info.moe_layers);
        let next = argmax(&got);
        got = run(&model, &mut st, &[next], LogitsWanted::Last);
        reference_logits = run(&reference, &mut want, &[next], LogitsWanted::Last);
    }
}

/// Every expert resident in a slot: a decode step uploads no expert, syncs once per MoE layer and
/// downloads the logits once. With one slot per layer every miss is an upload, in waves, and the logits
/// are the same bits.
#[test]
fn resident_experts_cost_no_upload_and_one_slot_per_layer_gives_the_same_bits() {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let cfg = osprey_models::ModelConfig::from_dir(&dir).expect("config");
    let ck = osprey_models::Checkpoint::open(&dir).expect("checkpoint");
    let load = |slots: Option<usize>, b: Arc<Counting>| {
        let opts = osprey_models::LoadOptions { expert_slots: slots, ..Default::default() };
        osprey_models::load_with_options(&cfg, &ck, opts, b, &mut |_, _| {}).expect("load")
    };
    let (all, one) = (Arc::new(Counting::default()), Arc::new(Counting::default()));
    let (wide, narrow) = (load(None, all.clone()), load(Some(1), one.clone()));
    let info = wide.info().clone();
    let experts = info.moe_layers * 8;
    let (mut s_all, mut s_one) = (wide.new_state(), narrow.new_state());
    // Warm every expert of every layer into the wide model's slots.
    let (mut uploaded, mut one_uploads) = (0, 0);
    for chunk in 0..32u32 {
        let ids: Vec<u32> = (0..16).map(|i| (chunk * 131 + i * 37 + 3) % 1000).collect();
        assert_eq!(
            run(&wide, &mut s_all, &ids, LogitsWanted::Last),
            run(&narrow, &mut s_one, &ids, LogitsWanted::Last),
            "chunk {chunk}: one slot per layer, in waves, gives the same bits"
        );
        uploaded += counts(&all)[5];
        one_uploads += counts(&one)[5];
        if uploaded == experts {
            break;
        }
    }
    assert_eq!(uploaded, experts, "each expert uploaded once while the pool holds them all");
    let mut next = 7;
    for step in 0..6 {
        let a = run(&wide, &mut s_all, &[next], LogitsWanted::Last);
        assert_eq!(a, run(&narrow, &mut s_one, &[next], LogitsWanted::Last), "step {step}");
        let [_, _, downloads, routing, _, expert_uploads] = counts(&all);
        assert_eq!((expert_uploads, routing, downloads), (0, info.moe_layers, 1), "step {step}: all resident");
        let [.., expert_uploads] = counts(&one);
        assert!(expert_uploads >= info.moe_layers, "step {step}: with one slot, every layer uploads");
        one_uploads += expert_uploads;
        next = argmax(&a);
    }
    let narrow_stats = narrow.slot_stats();
    assert_eq!(one_uploads as u64, narrow_stats.misses, "with one slot per layer, uploads equal misses");
    assert!(narrow_stats.waves >= narrow_stats.misses, "each miss runs in a wave of its own");
    assert_eq!(wide.slot_stats().misses as usize, experts);
}

/// The seam has no silent host fallbacks: a backend that lacks `qwen4_exp`'s ops is refused at load,
/// naming them; wrapped in the explicit host-ops test wrapper it runs the family, and the wrapper's
/// download-compute-upload versions give the CPU backend's in-place logits to the bit.
#[test]
fn a_backend_without_qwen4_exp_ops_is_refused_and_the_host_wrapper_equals_the_cpu() {
    let dir = common::fixtures().join("models/qwen4_exp-tiny");
    let counting = Arc::new(Counting::default());
    let Err(e) = osprey_models::load_on(&dir, counting.clone()) else { panic!("a backend without the ops loaded") };
    let e = e.to_string();
    for op in ["GroupedNorms", "HyperConnections", "Ple", "AttentionSelected"] {
        assert!(e.contains(op), "{e}");
    }
    let qwen35 = common::fixtures().join("models/qwen3_5_moe-tiny");
    assert!(osprey_models::load_on(&qwen35, counting.clone()).is_ok(), "Qwen3.5 needs none of them");
    let model = osprey_models::load_on(&dir, HostOps::wrap(counting.clone())).expect("load on the wrapper");
    let reference = osprey_models::load_on(&dir, CpuBackend::shared()).expect("load on the CPU backend");
    let prompt: Vec<u32> = (1..=40).map(|i| (i * 37) % 1000).collect();
    let (mut st, mut want) = (model.new_state(), reference.new_state());
    let run = |m: &dyn CausalLm, st: &mut osprey_models::SeqState, ids: &[u32]| {
        let input = SeqInput { tokens: ids, positions: Positions::Text, injected: &[], logits: LogitsWanted::All };
        m.forward(&mut [SeqStep { state: st, input }], false).expect("forward").logits.remove(0)
    };
    counts(&counting);
    for chunk in [&prompt[..23], &prompt[23..], &[7u32][..]] {
        assert_eq!(run(&model, &mut st, chunk), run(&reference, &mut want, chunk));
    }
    assert!(counts(&counting)[2] > 3, "the wrapper downloaded their inputs");
}

/// `qwen4_exp` on a backend that runs all of its ops: the QSA indexer's keys, scores and selected blocks
/// stay on the backend, so a decode step with every expert in a slot downloads the routing ids once per
/// MoE layer and the logits once (no index download), uploads no expert, and gives the CPU's bits.
#[test]
fn qwen4_exp_decode_downloads_only_routing_and_logits() {
    let dir = common::fixtures().join("models/qwen4_exp-tiny");
    let counting = Arc::new(Counting { qwen4: true, ..Counting::default() });
    let model = osprey_models::load_on(&dir, counting.clone()).expect("load with the qwen4_exp ops");
    let reference = osprey_models::load_on(&dir, CpuBackend::shared()).expect("load on the CPU backend");
    let info = model.info().clone();
    let (mut st, mut want) = (model.new_state(), reference.new_state());
    // Warm every expert into its slot (8 per layer; the prompt routes to all of them).
    let prompt: Vec<u32> = (1..=96).map(|i| (i * 37) % 1000).collect();
    let mut got = run(&model, &mut st, &prompt, LogitsWanted::Last);
    assert_eq!(got, run(&reference, &mut want, &prompt, LogitsWanted::Last));
    let warm = counts(&counting);
    assert_eq!(warm[5], info.moe_layers * 8, "the prompt put every expert in a slot");
    for step in 0..4 {
        let next = argmax(&got);
        got = run(&model, &mut st, &[next], LogitsWanted::Last);
        assert_eq!(got, run(&reference, &mut want, &[next], LogitsWanted::Last), "step {step}");
        let [_, _, downloads, routing, _, expert_uploads] = counts(&counting);
        assert_eq!((downloads, routing, expert_uploads), (1, info.moe_layers, 0), "step {step}");
    }
}

/// Records each MoE layer's routing, in order, and guesses nothing.
#[derive(Debug, Default)]
pub(crate) struct Recorder(pub(crate) std::sync::Mutex<Vec<(usize, Vec<usize>)>>);

impl ExpertPredictor for Recorder {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        self.0.lock().expect("lock").push((layer, touched.iter().map(|k| k.expert()).collect()));
    }
    fn predict(&self, _: &Ahead<'_>) -> osprey_models::Result<Vec<ExpertKey>> {
        Ok(Vec::new())
    }
}

/// Guesses `n` experts the replayed trace says the next layer will not route to.
#[derive(Debug)]
struct Wrong(Replay, usize);

impl ExpertPredictor for Wrong {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        self.0.observe(layer, touched);
    }
    fn predict(&self, a: &Ahead<'_>) -> osprey_models::Result<Vec<ExpertKey>> {
        let right = self.0.predict(a)?;
        Ok((0..8).map(|e| ExpertKey::new(a.next, e)).filter(|k| !right.contains(k)).take(self.1).collect())
    }
}

/// Guesses that claim a measured precision of 0 (as a `Calibrated` policy's do once never right).
#[derive(Debug)]
struct Unsure<P>(P);

impl<P: ExpertPredictor> ExpertPredictor for Unsure<P> {
    fn observe(&self, layer: usize, touched: &[ExpertKey]) {
        self.0.observe(layer, touched);
    }
    fn predict(&self, a: &Ahead<'_>) -> osprey_models::Result<Vec<ExpertKey>> {
        self.0.predict(a)
    }
    fn predict_scored(&self, a: &Ahead<'_>) -> osprey_models::Result<Vec<(ExpertKey, f32)>> {
        Ok(self.0.predict(a)?.into_iter().map(|k| (k, 0.0)).collect())
    }
}

/// Issue 36: the guesses drive uploads into the next layer's slots while the layer before computes. With
/// the next layer's true experts guessed (a replayed trace of the same prompt), every decode step finds
/// each routed expert already in its slot: no upload waits for a layer's routing, each guess is used,
/// and the logits are the CPU's bits. With every guess wrong, every guess is wasted, each routed expert
/// is still uploaded when its layer routes, and the logits are the same bits; with the same wrong guesses
/// measured never right (precision 0, under any slot hit rate's break-even), none goes up (issue 55).
#[test]
fn guessed_experts_go_up_into_slots_before_their_layer_routes_and_answers_do_not_change() {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let cfg = osprey_models::ModelConfig::from_dir(&dir).expect("config");
    let ck = osprey_models::Checkpoint::open(&dir).expect("checkpoint");
    let prompt: Vec<u32> = (0..24).map(|i| (i * 53 + 7) % 1000).collect();
    // Prompt, then 6 greedy steps; the logits of each forward and the slot counters after the prompt.
    let decode = |predictor: Arc<dyn ExpertPredictor>, uploads: bool, b: Arc<Counting>| {
        let opts = osprey_models::LoadOptions {
            expert_slots: Some(4),
            predictor: Some(predictor),
            guess_uploads: uploads,
            ..Default::default()
        };
        let m = osprey_models::load_with_options(&cfg, &ck, opts, b.clone(), &mut |_, _| {}).expect("load");
        let mut st = m.new_state();
        let mut out = vec![run(&m, &mut st, &prompt, LogitsWanted::Last)];
        let (after_prompt, _) = (m.slot_stats(), counts(&b));
        for _ in 0..6 {
            let next = argmax(out.last().expect("logits"));
            out.push(run(&m, &mut st, &[next], LogitsWanted::Last));
        }
        let uploaded = counts(&b)[5] as u64;
        (out, after_prompt, m.slot_stats(), uploaded)
    };
    let recorder = Arc::new(Recorder::default());
    let (reference, ..) = decode(recorder.clone(), false, Arc::new(Counting::default()));
    let trace = recorder.0.lock().expect("lock").clone();
    assert_eq!(trace.len(), 7 * 4, "four MoE layers, seven forwards");

    let (got, before, after, uploaded) =
        decode(Arc::new(Replay::new(trace.clone())), true, Arc::new(Counting::default()));
    assert!(got == reference, "perfect guesses uploaded ahead: the same bits");
    let routed: u64 = trace[4..].iter().map(|(_, e)| e.len() as u64).sum();
    assert_eq!(after.misses, before.misses, "decode: no routed expert waited for an upload after routing");
    assert_eq!(after.hits - before.hits, routed, "decode: every routed expert was in its slot");
    assert_eq!(after.guesses_used - before.guesses_used, after.guesses - before.guesses, "every guess used");
    assert_eq!(after.guesses_wasted, before.guesses_wasted);
    assert!(after.guesses > before.guesses, "experts went up on guesses");
    assert_eq!(uploaded, after.guesses - before.guesses, "decode's uploads are the guesses");

    let (got, before, after, uploaded) =
        decode(Arc::new(Unsure(Wrong(Replay::new(trace.clone()), 2))), true, Arc::new(Counting::default()));
    assert!(got == reference, "guesses never right: the same bits");
    assert_eq!(after.guesses, 0, "issue 55: a guess measured never right is not uploaded");
    assert_eq!(uploaded, after.misses - before.misses, "decode uploads only what layers routed to");

    let (got, before, after, uploaded) =
        decode(Arc::new(Wrong(Replay::new(trace), 2)), true, Arc::new(Counting::default()));
    assert!(got == reference, "wrong guesses uploaded ahead: the same bits");
    assert!(after.guesses > before.guesses, "wrong experts went up");
    assert_eq!(after.guesses_used, 0, "no wrong guess is used");
    assert_eq!(uploaded, (after.guesses - before.guesses) + (after.misses - before.misses));
    assert!(after.misses > before.misses, "the routed experts were uploaded when their layer routed");
}
