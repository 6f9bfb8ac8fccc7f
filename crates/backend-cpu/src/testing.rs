//! An explicit host-fallback wrapper for tests: [`HostOps`] runs the ops only `qwen4_exp` uses, and the
//! unrenormalised router, on the host (download, compute with [`crate::host`], upload) around any
//! backend, and forwards everything else. The seam has no silent fallbacks; this is how a test runs a
//! family on a backend that lacks those ops on purpose, and compares the result with a backend that
//! has them (the CPU's in-place versions must give the same bits).

use std::ops::Range;
use std::sync::Arc;

use osprey_backend::{
    AttnShape, Backend, BackendRef, Device, GdnShape, HostMatrix, MRope, Op, PagedView, RopeTable, Tensor,
};

use crate::host as fb;

/// `inner` with the `qwen4_exp` ops and the router's unrenormalised form run on the host.
#[derive(Debug)]
pub struct HostOps {
    /// The wrapped backend.
    pub inner: BackendRef,
}

impl HostOps {
    /// Wraps `inner`, shared.
    pub fn wrap(inner: BackendRef) -> BackendRef {
        Arc::new(HostOps { inner })
    }
}

/// The ops [`HostOps`] runs on the host itself.
const ON_HOST: [Op; 4] = [Op::GroupedNorms, Op::HyperConnections, Op::Ple, Op::AttentionSelected];

impl Backend for HostOps {
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn describe(&self) -> String {
        format!("{} with host qwen4_exp ops", self.inner.describe())
    }
    fn supports(&self, op: Op) -> bool {
        ON_HOST.contains(&op) || self.inner.supports(op)
    }
    fn place_weight(&self, w: Arc<dyn HostMatrix>) -> Tensor {
        self.inner.place_weight(w)
    }
    fn upload(&self, data: &[f32], shape: &[usize]) -> Tensor {
        self.inner.upload(data, shape)
    }
    fn download(&self, t: &Tensor) -> Vec<f32> {
        self.inner.download(t)
    }
    fn zeros(&self, shape: &[usize]) -> Tensor {
        self.inner.zeros(shape)
    }
    fn write_rows(&self, dst: &mut Tensor, at: usize, src: &Tensor, rows: Range<usize>) {
        self.inner.write_rows(dst, at, src, rows)
    }
    fn gather_rows(&self, x: &Tensor, rows: &[usize]) -> Tensor {
        self.inner.gather_rows(x, rows)
    }
    fn scatter_add_rows(&self, out: &mut Tensor, rows: &[usize], weights: &[f32], y: &Tensor) {
        self.inner.scatter_add_rows(out, rows, weights, y)
    }
    fn split_cols(&self, x: &Tensor, heads: usize, parts: &[usize]) -> Vec<Tensor> {
        self.inner.split_cols(x, heads, parts)
    }
    fn linear(&self, x: &Tensor, w: &Tensor) -> Tensor {
        self.inner.linear(x, w)
    }
    fn linear_pair(&self, x: &Tensor, w1: &Tensor, w2: &Tensor) -> (Tensor, Tensor) {
        self.inner.linear_pair(x, w1, w2)
    }
    fn embed(&self, table: &Tensor, ids: &[u32]) -> Tensor {
        self.inner.embed(table, ids)
    }
    fn add(&self, x: &mut Tensor, y: &Tensor) {
        self.inner.add(x, y)
    }
    fn add_bias(&self, x: &mut Tensor, bias: &Tensor) {
        self.inner.add_bias(x, bias)
    }
    fn scale(&self, x: &mut Tensor, s: f32) {
        self.inner.scale(x, s)
    }
    fn silu_mul(&self, gate: &mut Tensor, up: &Tensor) {
        self.inner.silu_mul(gate, up)
    }
    fn sigmoid_mul(&self, x: &mut Tensor, gate: &Tensor) {
        self.inner.sigmoid_mul(x, gate)
    }
    fn add_sigmoid_gated(&self, out: &mut Tensor, y: &Tensor, gate: &Tensor) {
        self.inner.add_sigmoid_gated(out, y, gate)
    }
    fn gelu(&self, x: &mut Tensor, tanh: bool) {
        self.inner.gelu(x, tanh)
    }
    fn rms_norm(&self, x: &mut Tensor, w: &Tensor, eps: f32, one_plus: bool) {
        self.inner.rms_norm(x, w, eps, one_plus)
    }
    fn rms_norm_gated(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        self.inner.rms_norm_gated(x, z, w, eps)
    }
    fn l2_norm(&self, x: &mut Tensor, group: usize, eps: f32) {
        self.inner.l2_norm(x, group, eps)
    }
    fn layer_norm(&self, x: &mut Tensor, w: &Tensor, b: &Tensor, eps: f32) {
        self.inner.layer_norm(x, w, b, eps)
    }
    fn rope_table(&self, rope: &MRope, positions: &[[i64; 3]]) -> RopeTable {
        self.inner.rope_table(rope, positions)
    }
    fn rope(&self, x: &mut Tensor, rope: &MRope, table: &RopeTable) {
        self.inner.rope(x, rope, table)
    }
    fn rotate_half(&self, x: &mut Tensor, head_dim: usize, cos: &Tensor, sin: &Tensor) {
        self.inner.rotate_half(x, head_dim, cos, sin)
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
        self.inner.attention_paged(q, rows, kv, past, shape, scale, out)
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
        self.inner.attention_bidirectional(q, k, v, rows, shape, scale, out)
    }
    fn causal_conv_silu(
        &self,
        x: &Tensor,
        rows: Range<usize>,
        w: &Tensor,
        kernel: usize,
        state: &mut Tensor,
    ) -> Tensor {
        self.inner.causal_conv_silu(x, rows, w, kernel, state)
    }
    fn delta_gates(
        &self,
        a: &Tensor,
        b: &Tensor,
        rows: Range<usize>,
        neg_a: &Tensor,
        dt_bias: &Tensor,
    ) -> (Tensor, Tensor) {
        self.inner.delta_gates(a, b, rows, neg_a, dt_bias)
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
    ) -> Tensor {
        self.inner.gated_delta(shape, recurrent, q, k, v, g, beta, state)
    }
    fn router_topk(&self, logits: &Tensor, k: usize) -> Vec<(Vec<usize>, Vec<f32>)> {
        self.inner.router_topk(logits, k)
    }

    // --- on the host ------------------------------------------------------------------------------------

    fn router_topk_with(&self, logits: &Tensor, k: usize, renorm: bool) -> Vec<(Vec<usize>, Vec<f32>)> {
        if renorm {
            return self.router_topk(logits, k);
        }
        let l = self.download(logits);
        l.chunks(logits.cols()).map(|row| fb::route(row, k, false)).collect()
    }
    fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32) {
        let mut h = self.download(x);
        fb::rms_norm_grouped(&mut h, &self.download(w), group, eps);
        *x = self.upload(&h, x.shape());
    }
    fn silu(&self, x: &mut Tensor) {
        let h: Vec<f32> = self.download(x).into_iter().map(|v| v / (1.0 + (-v).exp())).collect();
        *x = self.upload(&h, x.shape());
    }
    fn sigmoid(&self, x: &mut Tensor) {
        let h: Vec<f32> = self.download(x).into_iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        *x = self.upload(&h, x.shape());
    }
    fn hc_combine(&self, m: &Tensor, xn: &Tensor, hc: usize) -> Tensor {
        let h = m.cols() / hc;
        self.upload(&fb::hc_combine(&self.download(m), &self.download(xn), hc, h), &[m.rows(), h])
    }
    fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize) {
        let mut h = self.download(x);
        fb::hc_inject(&mut h, &self.download(out), &self.download(inj), hc, out.cols());
        *x = self.upload(&h, x.shape());
    }
    fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Tensor {
        let g = fb::ple_gate(&self.download(k), &self.download(q), &self.download(v), hc, v.cols());
        self.upload(&g, k.shape())
    }
    fn causal_conv_dilated_silu(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        dilation: usize,
        state: &mut Tensor,
    ) -> Tensor {
        let mut s = self.download(state);
        let c = x.cols();
        let out = fb::causal_conv_dilated_silu(&self.download(x), c, &self.download(w), kernel, dilation, &mut s);
        *state = self.upload(&s, state.shape());
        self.upload(&out, x.shape())
    }
    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        let mut h = self.download(x);
        fb::rms_norm_gated_sigmoid(&mut h, &self.download(z), &self.download(w), eps);
        *x = self.upload(&h, x.shape());
    }
    fn attention_selected(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        kv: PagedView<'_>,
        selected: &[Vec<usize>],
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        let pages: Vec<Vec<f32>> = kv.pages.iter().map(|p| self.download(p)).collect();
        let row = shape.kv_heads * shape.head_dim;
        let fetch = |pos: usize| fb::kv_rows(&pages[pos / kv.page_size], &kv, pos % kv.page_size, row);
        let c = q.cols();
        let qh = self.download(q);
        let mut o = self.download(out);
        fb::attention_selected(
            &qh[rows.start * c..rows.end * c],
            selected,
            &fetch,
            (shape.heads, shape.kv_heads, shape.head_dim),
            scale,
            &mut o[rows.start * c..rows.end * c],
        );
        *out = self.upload(&o, out.shape());
    }
}
