//! The CPU's `qwen4_exp` ops, in place on host memory with the host reference routines.

use super::*;

impl Qwen4Ops for CpuBackend {
    // qwen4_exp's ops: the host code of `host.rs`, on the tensors in place (no copies).
    fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32) {
        fb::rms_norm_grouped(host_mut(x), host(w), group, eps);
    }

    fn silu(&self, x: &mut Tensor) {
        host_mut(x).iter_mut().for_each(|v| *v = silu(*v));
    }

    fn sigmoid(&self, x: &mut Tensor) {
        host_mut(x).iter_mut().for_each(|v| *v = sigmoid(*v));
    }

    fn hc_combine(&self, m: &Tensor, xn: &Tensor, hc: usize) -> Result<Tensor> {
        let h = m.cols() / hc;
        self.tensor(&[m.rows(), h], fb::hc_combine(host(m), host(xn), hc, h))
    }

    fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize) {
        fb::hc_inject(host_mut(x), host(out), host(inj), hc, out.cols());
    }

    fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Result<Tensor> {
        self.tensor(k.shape(), fb::ple_gate(host(k), host(q), host(v), hc, v.cols()))
    }

    fn causal_conv_dilated_silu(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        dilation: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let out = fb::causal_conv_dilated_silu(host(x), x.cols(), host(w), kernel, dilation, host_mut(state));
        self.tensor(x.shape(), out)
    }

    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        fb::rms_norm_gated_sigmoid(host_mut(x), host(z), host(w), eps);
    }

    fn mean_rows(&self, x: &Tensor, rows: Range<usize>) -> Result<Tensor> {
        let c = x.cols();
        let mean = fb::mean_rows(&host(x)[rows.start * c..rows.end * c], rows.len(), c);
        self.tensor(&[1, c], mean)
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
        let ids =
            fb::qsa_select(&host(q)[rows.start * c..rows.end * c], host(keys), (past, ratio, top), heads, d, scale);
        self.typed(&[rows.len(), top], HostVec::I32(ids))
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
        let ps = kv.page_size;
        let (kp, vp) = kv_planes(&kv, (past + rows.len()).div_ceil(ps), row);
        let fetch = |pos: usize| fb::kv_rows((&kp[pos / ps], &vp[pos / ps]), pos % ps, row);
        let (c, top) = (q.cols(), blocks.cols());
        let ids = host_i32(blocks);
        let selected: Vec<Vec<usize>> =
            (0..rows.len()).map(|j| fb::selected_positions(&ids[j * top..(j + 1) * top], past + j, ratio)).collect();
        let qh = &host(q)[rows.start * c..rows.end * c];
        // Query rows are independent: blocks of 4 split across the pool.
        const BLOCK: usize = 4;
        osprey_kernels::pool::chunks_mut(&mut host_mut(out)[rows.start * c..rows.end * c], BLOCK * c, |b, o| {
            let r0 = b * BLOCK;
            let n = o.len() / c;
            fb::attention_selected(
                &qh[r0 * c..(r0 + n) * c],
                &selected[r0..r0 + n],
                &fetch,
                (shape.heads, shape.kv_heads, shape.head_dim),
                scale,
                o,
            );
        });
    }
}
