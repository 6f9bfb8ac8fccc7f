//! An explicit host-fallback wrapper for tests: [`HostOps`] runs the ops only `qwen4_exp` uses, and the
//! unrenormalised router, on the host (download, compute with [`crate::host`], upload) around any
//! backend, and forwards everything else. The seam has no silent fallbacks; this is how a test runs a
//! family on a backend that lacks those ops on purpose, and compares the result with a backend that
//! has them (the CPU's in-place versions must give the same bits).

use std::ops::Range;
use std::sync::Arc;

use osprey_backend::{
    AttnShape, Backend, BackendRef, HostData, MRope, Op, PagedView, Result, RopeTable, Routing, Tensor,
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

/// Forwards the seam's core ops (all but the `qwen4_exp` ones, `rope_table`, the router, expert slots
/// and fences) of a backend to the
/// `BackendRef` field `$inner`: test wrappers override only what they watch or replace.
#[macro_export]
macro_rules! forward_core_ops {
    ($inner:ident) => {
        fn device(&self) -> $crate::reexport::Device {
            self.$inner.device()
        }
        fn place_weight(
            &self,
            w: std::sync::Arc<dyn $crate::reexport::HostMatrix>,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.place_weight(w)
        }
        fn upload(
            &self,
            data: $crate::reexport::HostData<'_>,
            shape: &[usize],
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.upload(data, shape)
        }
        fn download(&self, t: &$crate::reexport::Tensor) -> $crate::reexport::Result<$crate::reexport::HostVec> {
            self.$inner.download(t)
        }
        fn zeros(
            &self,
            dtype: $crate::reexport::DType,
            shape: &[usize],
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.zeros(dtype, shape)
        }
        fn alloc_host_arena(&self, bytes: usize) -> $crate::reexport::Result<$crate::reexport::HostArena> {
            self.$inner.alloc_host_arena(bytes)
        }
        fn write_rows(
            &self,
            dst: &mut $crate::reexport::Tensor,
            at: usize,
            src: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
        ) {
            self.$inner.write_rows(dst, at, src, rows)
        }
        fn gather_rows(
            &self,
            x: &$crate::reexport::Tensor,
            rows: &[usize],
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.gather_rows(x, rows)
        }
        fn scatter_add_rows(
            &self,
            out: &mut $crate::reexport::Tensor,
            rows: &[usize],
            weights: &[f32],
            y: &$crate::reexport::Tensor,
        ) {
            self.$inner.scatter_add_rows(out, rows, weights, y)
        }
        fn split_cols(
            &self,
            x: &$crate::reexport::Tensor,
            heads: usize,
            parts: &[usize],
        ) -> $crate::reexport::Result<Vec<$crate::reexport::Tensor>> {
            self.$inner.split_cols(x, heads, parts)
        }
        fn linear(
            &self,
            x: &$crate::reexport::Tensor,
            w: &$crate::reexport::Tensor,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.linear(x, w)
        }
        fn linear_pair(
            &self,
            x: &$crate::reexport::Tensor,
            w1: &$crate::reexport::Tensor,
            w2: &$crate::reexport::Tensor,
        ) -> $crate::reexport::Result<($crate::reexport::Tensor, $crate::reexport::Tensor)> {
            self.$inner.linear_pair(x, w1, w2)
        }
        fn embed(
            &self,
            table: &$crate::reexport::Tensor,
            ids: &[u32],
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.embed(table, ids)
        }
        fn add(&self, x: &mut $crate::reexport::Tensor, y: &$crate::reexport::Tensor) {
            self.$inner.add(x, y)
        }
        fn add_bias(&self, x: &mut $crate::reexport::Tensor, bias: &$crate::reexport::Tensor) {
            self.$inner.add_bias(x, bias)
        }
        fn scale(&self, x: &mut $crate::reexport::Tensor, s: f32) {
            self.$inner.scale(x, s)
        }
        fn silu_mul(&self, gate: &mut $crate::reexport::Tensor, up: &$crate::reexport::Tensor) {
            self.$inner.silu_mul(gate, up)
        }
        fn sigmoid_mul(&self, x: &mut $crate::reexport::Tensor, gate: &$crate::reexport::Tensor) {
            self.$inner.sigmoid_mul(x, gate)
        }
        fn add_sigmoid_gated(
            &self,
            out: &mut $crate::reexport::Tensor,
            y: &$crate::reexport::Tensor,
            gate: &$crate::reexport::Tensor,
        ) {
            self.$inner.add_sigmoid_gated(out, y, gate)
        }
        fn gelu(&self, x: &mut $crate::reexport::Tensor, tanh: bool) {
            self.$inner.gelu(x, tanh)
        }
        fn rms_norm(&self, x: &mut $crate::reexport::Tensor, w: &$crate::reexport::Tensor, eps: f32, one_plus: bool) {
            self.$inner.rms_norm(x, w, eps, one_plus)
        }
        fn rms_norm_gated(
            &self,
            x: &mut $crate::reexport::Tensor,
            z: &$crate::reexport::Tensor,
            w: &$crate::reexport::Tensor,
            eps: f32,
        ) {
            self.$inner.rms_norm_gated(x, z, w, eps)
        }
        fn l2_norm(&self, x: &mut $crate::reexport::Tensor, group: usize, eps: f32) {
            self.$inner.l2_norm(x, group, eps)
        }
        fn layer_norm(
            &self,
            x: &mut $crate::reexport::Tensor,
            w: &$crate::reexport::Tensor,
            b: &$crate::reexport::Tensor,
            eps: f32,
        ) {
            self.$inner.layer_norm(x, w, b, eps)
        }
        fn rope(
            &self,
            x: &mut $crate::reexport::Tensor,
            rope: &$crate::reexport::MRope,
            table: &$crate::reexport::RopeTable,
        ) {
            self.$inner.rope(x, rope, table)
        }
        fn rotate_half(
            &self,
            x: &mut $crate::reexport::Tensor,
            head_dim: usize,
            cos: &$crate::reexport::Tensor,
            sin: &$crate::reexport::Tensor,
        ) {
            self.$inner.rotate_half(x, head_dim, cos, sin)
        }
        fn attention_paged(
            &self,
            q: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
            kv: $crate::reexport::PagedView<'_>,
            past: usize,
            shape: $crate::reexport::AttnShape,
            scale: f32,
            out: &mut $crate::reexport::Tensor,
        ) {
            self.$inner.attention_paged(q, rows, kv, past, shape, scale, out)
        }
        fn attention_bidirectional(
            &self,
            q: &$crate::reexport::Tensor,
            k: &$crate::reexport::Tensor,
            v: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
            shape: $crate::reexport::AttnShape,
            scale: f32,
            out: &mut $crate::reexport::Tensor,
        ) {
            self.$inner.attention_bidirectional(q, k, v, rows, shape, scale, out)
        }
        fn causal_conv_silu(
            &self,
            x: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
            w: &$crate::reexport::Tensor,
            kernel: usize,
            state: &mut $crate::reexport::Tensor,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.causal_conv_silu(x, rows, w, kernel, state)
        }
        fn delta_gates(
            &self,
            a: &$crate::reexport::Tensor,
            b: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
            neg_a: &$crate::reexport::Tensor,
            dt_bias: &$crate::reexport::Tensor,
        ) -> $crate::reexport::Result<($crate::reexport::Tensor, $crate::reexport::Tensor)> {
            self.$inner.delta_gates(a, b, rows, neg_a, dt_bias)
        }
        fn gated_delta(
            &self,
            shape: $crate::reexport::GdnShape,
            recurrent: bool,
            q: &$crate::reexport::Tensor,
            k: &$crate::reexport::Tensor,
            v: &$crate::reexport::Tensor,
            g: &$crate::reexport::Tensor,
            beta: &$crate::reexport::Tensor,
            state: &mut $crate::reexport::Tensor,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.gated_delta(shape, recurrent, q, k, v, g, beta, state)
        }
    };
}

/// Forwards a backend's expert-slot ops (`alloc_expert_pool`, `upload_expert`, `moe_routed`,
/// `moe_combine`) to the `BackendRef` field `$inner`.
#[macro_export]
macro_rules! forward_expert_ops {
    ($inner:ident) => {
        fn alloc_expert_pool(
            &self,
            layer: u32,
            slots: usize,
            shape: $crate::reexport::ExpertShape,
        ) -> $crate::reexport::Result<$crate::reexport::ExpertPool> {
            self.$inner.alloc_expert_pool(layer, slots, shape)
        }
        fn upload_expert(
            &self,
            pool: &mut $crate::reexport::ExpertPool,
            slot: usize,
            expert: $crate::reexport::HostExpert,
        ) -> $crate::reexport::Result<$crate::reexport::Fence> {
            self.$inner.upload_expert(pool, slot, expert)
        }
        fn moe_routed(
            &self,
            x: &$crate::reexport::Tensor,
            slots: &$crate::reexport::Tensor,
            weights: &$crate::reexport::Tensor,
            pool: &$crate::reexport::ExpertPool,
            partials: &mut $crate::reexport::Tensor,
        ) -> $crate::reexport::Result<()> {
            self.$inner.moe_routed(x, slots, weights, pool, partials)
        }
        fn moe_combine(
            &self,
            partials: &$crate::reexport::Tensor,
            k: usize,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.moe_combine(partials, k)
        }
    };
}

/// Forwards a backend's fences (`record_fence`, `fence_complete`, `wait_fence`) to the `BackendRef` field
/// `$inner`.
#[macro_export]
macro_rules! forward_fences {
    ($inner:ident) => {
        fn record_fence(&self) -> $crate::reexport::Fence {
            self.$inner.record_fence()
        }
        fn fence_complete(&self, fence: $crate::reexport::Fence) -> bool {
            self.$inner.fence_complete(fence)
        }
        fn wait_fence(&self, fence: $crate::reexport::Fence) -> $crate::reexport::Result<()> {
            self.$inner.wait_fence(fence)
        }
    };
}

/// Forwards the router, the rope tables and the `qwen4_exp` ops to the `BackendRef` field `$inner` (with
/// [`forward_core_ops`], [`forward_expert_ops`] and [`forward_fences`], a whole wrapper).
#[macro_export]
macro_rules! forward_model_ops {
    ($inner:ident) => {
        fn route(
            &self,
            logits: &$crate::reexport::Tensor,
            k: usize,
            renorm: bool,
        ) -> $crate::reexport::Result<$crate::reexport::Routing> {
            self.$inner.route(logits, k, renorm)
        }
        fn rope_table(
            &self,
            rope: &$crate::reexport::MRope,
            positions: &[[i64; 3]],
        ) -> $crate::reexport::Result<$crate::reexport::RopeTable> {
            self.$inner.rope_table(rope, positions)
        }
        fn rms_norm_grouped(
            &self,
            x: &mut $crate::reexport::Tensor,
            w: &$crate::reexport::Tensor,
            group: usize,
            eps: f32,
        ) {
            self.$inner.rms_norm_grouped(x, w, group, eps)
        }
        fn silu(&self, x: &mut $crate::reexport::Tensor) {
            self.$inner.silu(x)
        }
        fn sigmoid(&self, x: &mut $crate::reexport::Tensor) {
            self.$inner.sigmoid(x)
        }
        fn hc_combine(
            &self,
            m: &$crate::reexport::Tensor,
            xn: &$crate::reexport::Tensor,
            hc: usize,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.hc_combine(m, xn, hc)
        }
        fn hc_inject(
            &self,
            x: &mut $crate::reexport::Tensor,
            out: &$crate::reexport::Tensor,
            inj: &$crate::reexport::Tensor,
            hc: usize,
        ) {
            self.$inner.hc_inject(x, out, inj, hc)
        }
        fn ple_gate(
            &self,
            k: &$crate::reexport::Tensor,
            q: &$crate::reexport::Tensor,
            v: &$crate::reexport::Tensor,
            hc: usize,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.ple_gate(k, q, v, hc)
        }
        fn causal_conv_dilated_silu(
            &self,
            x: &$crate::reexport::Tensor,
            w: &$crate::reexport::Tensor,
            kernel: usize,
            dilation: usize,
            state: &mut $crate::reexport::Tensor,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.causal_conv_dilated_silu(x, w, kernel, dilation, state)
        }
        fn rms_norm_gated_sigmoid(
            &self,
            x: &mut $crate::reexport::Tensor,
            z: &$crate::reexport::Tensor,
            w: &$crate::reexport::Tensor,
            eps: f32,
        ) {
            self.$inner.rms_norm_gated_sigmoid(x, z, w, eps)
        }
        fn mean_rows(
            &self,
            x: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.mean_rows(x, rows)
        }
        fn qsa_select(
            &self,
            q: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
            keys: &$crate::reexport::Tensor,
            past: usize,
            ratio: usize,
            top: usize,
            heads: usize,
            scale: f32,
        ) -> $crate::reexport::Result<$crate::reexport::Tensor> {
            self.$inner.qsa_select(q, rows, keys, past, ratio, top, heads, scale)
        }
        fn attention_selected(
            &self,
            q: &$crate::reexport::Tensor,
            rows: std::ops::Range<usize>,
            kv: $crate::reexport::PagedView<'_>,
            blocks: &$crate::reexport::Tensor,
            at: (usize, usize),
            shape: $crate::reexport::AttnShape,
            scale: f32,
            out: &mut $crate::reexport::Tensor,
        ) {
            self.$inner.attention_selected(q, rows, kv, blocks, at, shape, scale, out)
        }
    };
}

impl Backend for HostOps {
    forward_core_ops!(inner);
    forward_expert_ops!(inner);
    forward_fences!(inner);

    fn describe(&self) -> String {
        format!("{} with host qwen4_exp ops", self.inner.describe())
    }
    fn supports(&self, op: Op) -> bool {
        ON_HOST.contains(&op) || self.inner.supports(op)
    }
    fn rope_table(&self, rope: &MRope, positions: &[[i64; 3]]) -> Result<RopeTable> {
        self.inner.rope_table(rope, positions)
    }

    // --- on the host ------------------------------------------------------------------------------------

    fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing> {
        if renorm {
            return self.inner.route(logits, k, renorm);
        }
        let (ids, weights) = fb::route_sorted(&self.download_f32(logits)?, logits.cols(), k, false);
        let t = logits.rows();
        Ok(Routing { ids: self.upload(HostData::I32(&ids), &[t, k])?, weights: self.upload_f32(&weights, &[t, k])? })
    }
    fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32) {
        let mut h = self.host(x);
        fb::rms_norm_grouped(&mut h, &self.host(w), group, eps);
        self.put(x, &h);
    }
    fn silu(&self, x: &mut Tensor) {
        let h: Vec<f32> = self.host(x).into_iter().map(|v| v / (1.0 + (-v).exp())).collect();
        self.put(x, &h);
    }
    fn sigmoid(&self, x: &mut Tensor) {
        let h: Vec<f32> = self.host(x).into_iter().map(|v| 1.0 / (1.0 + (-v).exp())).collect();
        self.put(x, &h);
    }
    fn hc_combine(&self, m: &Tensor, xn: &Tensor, hc: usize) -> Result<Tensor> {
        let h = m.cols() / hc;
        self.upload_f32(&fb::hc_combine(&self.download_f32(m)?, &self.download_f32(xn)?, hc, h), &[m.rows(), h])
    }
    fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize) {
        let mut h = self.host(x);
        fb::hc_inject(&mut h, &self.host(out), &self.host(inj), hc, out.cols());
        self.put(x, &h);
    }
    fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Result<Tensor> {
        let g = fb::ple_gate(&self.download_f32(k)?, &self.download_f32(q)?, &self.download_f32(v)?, hc, v.cols());
        self.upload_f32(&g, k.shape())
    }
    fn causal_conv_dilated_silu(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        dilation: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let mut s = self.download_f32(state)?;
        let c = x.cols();
        let out =
            fb::causal_conv_dilated_silu(&self.download_f32(x)?, c, &self.download_f32(w)?, kernel, dilation, &mut s);
        *state = self.upload_f32(&s, state.shape())?;
        self.upload_f32(&out, x.shape())
    }
    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        let mut h = self.host(x);
        fb::rms_norm_gated_sigmoid(&mut h, &self.host(z), &self.host(w), eps);
        self.put(x, &h);
    }
    fn mean_rows(&self, x: &Tensor, rows: Range<usize>) -> Result<Tensor> {
        let c = x.cols();
        let h = self.download_f32(x)?;
        self.upload_f32(&fb::mean_rows(&h[rows.start * c..rows.end * c], rows.len(), c), &[1, c])
    }
    fn qsa_select(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        keys: &Tensor,
        past: usize,
        ratio: usize,
        top: usize,
        heads: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (c, d) = (q.cols(), keys.cols());
        let qh = self.download_f32(q)?;
        let ids = fb::qsa_select(
            &qh[rows.start * c..rows.end * c],
            &self.download_f32(keys)?,
            (past, ratio, top),
            heads,
            d,
            scale,
        );
        self.upload(HostData::I32(&ids), &[rows.len(), top])
    }
    fn attention_selected(
        &self,
        q: &Tensor,
        rows: Range<usize>,
        kv: PagedView<'_>,
        blocks: &Tensor,
        (past, ratio): (usize, usize),
        shape: AttnShape,
        scale: f32,
        out: &mut Tensor,
    ) {
        let row = shape.kv_heads * shape.head_dim;
        let pool = match self.download(kv.pool).expect("a host copy for a test backend") {
            osprey_backend::HostVec::F32(v) => v,
            osprey_backend::HostVec::Bf16(v) => v.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect(),
            _ => panic!("KV pools are f32 or bf16"),
        };
        let table = match self.download(kv.table).expect("a host copy for a test backend") {
            osprey_backend::HostVec::I32(v) => v,
            _ => panic!("page tables are i32"),
        };
        let ps = kv.page_size;
        let fetch = |pos: usize| {
            let at = kv.k_row(table[pos / ps] as usize, 0) * row;
            fb::kv_rows((&pool[at..at + ps * row], &pool[at + ps * row..at + 2 * ps * row]), pos % ps, row)
        };
        let top = blocks.cols();
        let ids = match self.download(blocks).expect("a host copy for a test backend") {
            osprey_backend::HostVec::I32(v) => v,
            _ => panic!("QSA blocks are i32"),
        };
        let selected: Vec<Vec<usize>> =
            (0..rows.len()).map(|j| fb::selected_positions(&ids[j * top..(j + 1) * top], past + j, ratio)).collect();
        let c = q.cols();
        let qh = self.host(q);
        let mut o = self.host(out);
        fb::attention_selected(
            &qh[rows.start * c..rows.end * c],
            &selected,
            &fetch,
            (shape.heads, shape.kv_heads, shape.head_dim),
            scale,
            &mut o[rows.start * c..rows.end * c],
        );
        self.put(out, &o);
    }
}

impl HostOps {
    /// An f32 tensor's elements (the in-place ops cannot report errors: a failing copy is a test bug).
    fn host(&self, t: &Tensor) -> Vec<f32> {
        self.download_f32(t).expect("a host copy for a test backend")
    }

    /// Replaces `t` with `data` of its shape.
    fn put(&self, t: &mut Tensor, data: &[f32]) {
        *t = self.upload_f32(data, t.shape()).expect("an upload for a test backend");
    }
}
