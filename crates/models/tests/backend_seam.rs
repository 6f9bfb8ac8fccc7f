//! The compute-backend seam seen from outside: a model is built on whatever backend it is given, every
//! weight is placed by that backend at load, and a forward crosses to the host only where the seam says
//! it may (token ids and positions in, one router top-k per MoE layer, the sampled rows' logits out) —
//! never once per layer. A counting backend wraps the CPU one to check it, and the answers must be the
//! CPU backend's to the bit.

mod common;

use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use osprey_backend::{
    AttnShape, Backend, DType, Device, GdnShape, HostData, HostMatrix, HostVec, MRope, Op, PagedView, Result,
    RopeTable, Tensor,
};
use osprey_backend_cpu::testing::HostOps;
use osprey_backend_cpu::CpuBackend;
use osprey_models::{CausalLm, LogitsWanted, Positions, SeqInput, SeqStep};

/// The CPU backend with its host crossings counted.
#[derive(Debug, Default)]
struct Counting {
    cpu: CpuBackend,
    placed: AtomicUsize,
    uploads: AtomicUsize,
    downloads: AtomicUsize,
    router: AtomicUsize,
}

fn bump(c: &AtomicUsize) {
    c.fetch_add(1, Ordering::Relaxed);
}

impl Backend for Counting {
    fn device(&self) -> Device {
        self.cpu.device()
    }
    fn describe(&self) -> String {
        format!("counting {}", self.cpu.describe())
    }
    /// Like a device backend still without them, it has none of the ops only `qwen4_exp` runs.
    fn supports(&self, op: Op) -> bool {
        !matches!(op, Op::GroupedNorms | Op::HyperConnections | Op::Ple | Op::AttentionSelected)
    }
    fn place_weight(&self, w: Arc<dyn HostMatrix>) -> Result<Tensor> {
        bump(&self.placed);
        self.cpu.place_weight(w)
    }
    fn upload(&self, data: HostData<'_>, shape: &[usize]) -> Result<Tensor> {
        bump(&self.uploads);
        self.cpu.upload(data, shape)
    }
    fn download(&self, t: &Tensor) -> Result<HostVec> {
        bump(&self.downloads);
        self.cpu.download(t)
    }
    fn zeros(&self, dtype: DType, shape: &[usize]) -> Result<Tensor> {
        self.cpu.zeros(dtype, shape)
    }
    fn write_rows(&self, dst: &mut Tensor, at: usize, src: &Tensor, rows: Range<usize>) {
        self.cpu.write_rows(dst, at, src, rows)
    }
    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Result<Tensor> {
        self.cpu.gather_rows(x, rows)
    }
    fn scatter_add_rows(&self, out: &mut Tensor, rows: &[usize], weights: &[f32], y: &Tensor) {
        self.cpu.scatter_add_rows(out, rows, weights, y)
    }
    fn split_cols(&self, x: &Tensor, heads: usize, parts: &[usize]) -> Result<Vec<Tensor>> {
        self.cpu.split_cols(x, heads, parts)
    }
    fn linear(&self, x: &Tensor, w: &Tensor) -> Result<Tensor> {
        self.cpu.linear(x, w)
    }
    fn linear_pair(&self, x: &Tensor, w1: &Tensor, w2: &Tensor) -> Result<(Tensor, Tensor)> {
        self.cpu.linear_pair(x, w1, w2)
    }
    fn embed(&self, table: &Tensor, ids: &[u32]) -> Result<Tensor> {
        self.cpu.embed(table, ids)
    }
    fn add(&self, x: &mut Tensor, y: &Tensor) {
        self.cpu.add(x, y)
    }
    fn add_bias(&self, x: &mut Tensor, bias: &Tensor) {
        self.cpu.add_bias(x, bias)
    }
    fn scale(&self, x: &mut Tensor, s: f32) {
        self.cpu.scale(x, s)
    }
    fn silu_mul(&self, gate: &mut Tensor, up: &Tensor) {
        self.cpu.silu_mul(gate, up)
    }
    fn sigmoid_mul(&self, x: &mut Tensor, gate: &Tensor) {
        self.cpu.sigmoid_mul(x, gate)
    }
    fn add_sigmoid_gated(&self, out: &mut Tensor, y: &Tensor, gate: &Tensor) {
        self.cpu.add_sigmoid_gated(out, y, gate)
    }
    fn gelu(&self, x: &mut Tensor, tanh: bool) {
        self.cpu.gelu(x, tanh)
    }
    fn rms_norm(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool) {
        self.cpu.rms_norm(x, w, eps, one_plus)
    }
    fn rms_norm_gated(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        self.cpu.rms_norm_gated(x, z, w, eps)
    }
    fn l2_norm(&self, x: &mut Tensor, group: usize, eps: f32) {
        self.cpu.l2_norm(x, group, eps)
    }
    fn layer_norm(&self, x: &mut Tensor, w: &Tensor, b: &Tensor, eps: f32) {
        self.cpu.layer_norm(x, w, b, eps)
    }
    fn rope_table(&self, rope: &MRope, positions: &[[i64; 3]]) -> Result<RopeTable> {
        // Tables are computed where the positions are (the host) and sent once per forward.
        bump(&self.uploads);
        self.cpu.rope_table(rope, positions)
    }
    fn rope(&self, x: &mut Tensor, rope: &MRope, table: &RopeTable) {
        self.cpu.rope(x, rope, table)
    }
    fn rotate_half(&self, x: &mut Tensor, head_dim: usize, cos: &Tensor, sin: &Tensor) {
        self.cpu.rotate_half(x, head_dim, cos, sin)
    }
    fn attention_paged(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        kv: PagedView<'_>,
        past: usize,
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        self.cpu.attention_paged(q, rows, kv, past, shape, scale, out)
    }
    fn attention_bidirectional(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        rows: Range<usize>,
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        self.cpu.attention_bidirectional(q, k, v, rows, shape, scale, out)
    }
    fn causal_conv_silu(
        &self,
        x: &Tensor,
        rows: Range<usize>,
        w: &Tensor,
        kernel: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        self.cpu.causal_conv_silu(x, rows, w, kernel, state)
    }
    fn delta_gates(
        &self,
        a: &Tensor,
        b: &Tensor,
        rows: Range<usize>,
        neg_a: &Tensor,
        dt_bias: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.cpu.delta_gates(a, b, rows, neg_a, dt_bias)
    }
    fn gated_delta(
        &self,
        shape: GdnShape,
        recurrent: bool,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        g: &Tensor,
        beta: &Tensor,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        self.cpu.gated_delta(shape, recurrent, q, k, v, g, beta, state)
    }
    fn router_topk(&self, logits: &Tensor, k: usize) -> Result<Vec<(Vec<usize>, Vec<f32>)>> {
        bump(&self.router);
        self.cpu.router_topk(logits, k)
    }
    fn router_topk_with(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Vec<(Vec<usize>, Vec<f32>)>> {
        bump(&self.router);
        self.cpu.router_topk_with(logits, k, renorm)
    }
    fn rms_norm_grouped(&self, _: &mut Tensor, _: &Tensor, _: usize, _: f32) {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn silu(&self, _: &mut Tensor) {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn sigmoid(&self, _: &mut Tensor) {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn hc_combine(&self, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn hc_inject(&self, _: &mut Tensor, _: &Tensor, _: &Tensor, _: usize) {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn ple_gate(&self, _: &Tensor, _: &Tensor, _: &Tensor, _: usize) -> Result<Tensor> {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn causal_conv_dilated_silu(&self, _: &Tensor, _: &Tensor, _: usize, _: usize, _: &mut Tensor) -> Result<Tensor> {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn rms_norm_gated_sigmoid(&self, _: &mut Tensor, _: &Tensor, _: &Tensor, _: f32) {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
    fn attention_selected(
        &self,
        _: &Tensor,
        _: Range<usize>,
        _: PagedView<'_>,
        _: &[Vec<usize>],
        _: AttnShape,
        _: f32,
        _: &mut Tensor,
    ) {
        unreachable!("not supported: the loader refuses a model that needs it")
    }
}

fn counts(c: &Counting) -> [usize; 4] {
    [&c.placed, &c.uploads, &c.downloads, &c.router].map(|a| a.swap(0, Ordering::Relaxed))
}

#[test]
fn weights_are_placed_at_load_and_a_forward_crosses_to_the_host_only_for_logits() {
    let dir = common::fixtures().join("models/qwen3_5_moe-tiny");
    let counting = Arc::new(Counting::default());
    let model = osprey_models::load_on(&dir, counting.clone()).expect("load on the counting backend");
    let reference = osprey_models::load_on(&dir, CpuBackend::shared()).expect("load on the CPU backend");
    let info = model.info().clone();
    let [placed, _, _, _] = counts(&counting);
    // Every linear of every layer, the router, the shared expert and the embedding went through the
    // backend (the routed experts are placed when they arrive, not here).
    assert!(placed >= 4 * info.num_layers, "{placed} weights placed for {} layers", info.num_layers);

    let prompt: Vec<u32> = (1..=12).collect();
    let (mut st, mut want) = (model.new_state(), reference.new_state());
    let run = |m: &dyn CausalLm, st: &mut osprey_models::SeqState, ids: &[u32], logits: LogitsWanted| {
        let input = SeqInput { tokens: ids, positions: Positions::Text, injected: &[], logits };
        m.forward(&mut [SeqStep { state: st, input }], false).expect("forward").logits.remove(0)
    };
    // A prefill chunk that wants no logits downloads nothing, whatever the depth.
    assert!(run(&model, &mut st, &prompt[..8], LogitsWanted::None).is_empty());
    run(&reference, &mut want, &prompt[..8], LogitsWanted::None);
    let [placed, uploads, downloads, router] = counts(&counting);
    assert_eq!((downloads, uploads), (0, 1), "only the rope table goes up; nothing comes down");
    // Every MoE layer asks the host once which experts to fetch (and places the ones it gets).
    assert_eq!(router, info.moe_layers);
    assert!(placed > 0);
    // The rest of the prompt, then decode steps: one download each (the last row's logits).
    let mut got = run(&model, &mut st, &prompt[8..], LogitsWanted::Last);
    let mut reference_logits = run(&reference, &mut want, &prompt[8..], LogitsWanted::Last);
    for step in 0..4 {
        assert_eq!(got, reference_logits, "step {step}: the counting backend computes the CPU backend's answer");
        let [_, _, downloads, router] = counts(&counting);
        assert_eq!(downloads, 1, "step {step}: one download per forward, not per layer");
        assert_eq!(router, info.moe_layers);
        let next = got.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).map(|(i, _)| i as u32).expect("logits");
        got = run(&model, &mut st, &[next], LogitsWanted::Last);
        reference_logits = run(&reference, &mut want, &[next], LogitsWanted::Last);
    }
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
