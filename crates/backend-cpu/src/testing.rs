//! An explicit host-fallback wrapper for tests: [`HostOps`] runs the ops only `qwen4_exp` uses, and the
//! unrenormalised router, on the host (download, compute with [`crate::host`], upload) around any
//! backend, and forwards everything else (it is a [`Wrapper`]). The seam has no silent fallbacks; this is how a test runs a
//! family on a backend that lacks those ops on purpose, and compares the result with a backend that
//! has them (the CPU's in-place versions must give the same bits).

use std::ops::Range;
use std::sync::Arc;

use osprey_backend::{AttnShape, Backend, BackendRef, HostData, Op, PagedView, Result, Routing, Tensor, Wrapper};

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

impl Wrapper for HostOps {
    fn inner(&self) -> &dyn Backend {
        self.inner.as_ref()
    }
    fn describe(&self) -> String {
        format!("{} with host qwen4_exp ops", self.inner.describe())
    }
    fn supports(&self, op: Op) -> bool {
        ON_HOST.contains(&op) || self.inner.supports(op)
    }
    // --- on the host ------------------------------------------------------------------------------------

    fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing> {
        if renorm {
            return self.inner.route(logits, k, renorm);
        }
        let (ids, weights) = fb::route_sorted(&self.inner.download_f32(logits)?, logits.cols(), k, false);
        let t = logits.rows();
        Ok(Routing {
            ids: self.inner.upload(HostData::I32(&ids), &[t, k])?,
            weights: self.inner.upload_f32(&weights, &[t, k])?,
        })
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
        self.inner.upload_f32(
            &fb::hc_combine(&self.inner.download_f32(m)?, &self.inner.download_f32(xn)?, hc, h),
            &[m.rows(), h],
        )
    }
    fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize) {
        let mut h = self.host(x);
        fb::hc_inject(&mut h, &self.host(out), &self.host(inj), hc, out.cols());
        self.put(x, &h);
    }
    fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Result<Tensor> {
        let g = fb::ple_gate(
            &self.inner.download_f32(k)?,
            &self.inner.download_f32(q)?,
            &self.inner.download_f32(v)?,
            hc,
            v.cols(),
        );
        self.inner.upload_f32(&g, k.shape())
    }
    fn causal_conv_dilated_silu(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        dilation: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let mut s = self.inner.download_f32(state)?;
        let c = x.cols();
        let out = fb::causal_conv_dilated_silu(
            &self.inner.download_f32(x)?,
            c,
            &self.inner.download_f32(w)?,
            kernel,
            dilation,
            &mut s,
        );
        *state = self.inner.upload_f32(&s, state.shape())?;
        self.inner.upload_f32(&out, x.shape())
    }
    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        let mut h = self.host(x);
        fb::rms_norm_gated_sigmoid(&mut h, &self.host(z), &self.host(w), eps);
        self.put(x, &h);
    }
    fn mean_rows(&self, x: &Tensor, rows: Range<usize>) -> Result<Tensor> {
        let c = x.cols();
        let h = self.inner.download_f32(x)?;
        self.inner.upload_f32(&fb::mean_rows(&h[rows.start * c..rows.end * c], rows.len(), c), &[1, c])
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
        let qh = self.inner.download_f32(q)?;
        let ids = fb::qsa_select(
            &qh[rows.start * c..rows.end * c],
            &self.inner.download_f32(keys)?,
            (past, ratio, top),
            heads,
            d,
            scale,
        );
        self.inner.upload(HostData::I32(&ids), &[rows.len(), top])
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
        let pool = match self.inner.download(kv.pool).expect("a host copy for a test backend") {
            osprey_backend::HostVec::F32(v) => v,
            osprey_backend::HostVec::Bf16(v) => v.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect(),
            _ => panic!("KV pools are f32 or bf16"),
        };
        let table = match self.inner.download(kv.table).expect("a host copy for a test backend") {
            osprey_backend::HostVec::I32(v) => v,
            _ => panic!("page tables are i32"),
        };
        let ps = kv.page_size;
        let fetch = |pos: usize| {
            let at = kv.k_row(table[pos / ps] as usize, 0) * row;
            fb::kv_rows((&pool[at..at + ps * row], &pool[at + ps * row..at + 2 * ps * row]), pos % ps, row)
        };
        let top = blocks.cols();
        let ids = match self.inner.download(blocks).expect("a host copy for a test backend") {
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
        self.inner.download_f32(t).expect("a host copy for a test backend")
    }

    /// Replaces `t` with `data` of its shape.
    fn put(&self, t: &mut Tensor, data: &[f32]) {
        *t = self.inner.upload_f32(data, t.shape()).expect("an upload for a test backend");
    }
}
