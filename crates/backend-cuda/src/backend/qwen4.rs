//! `qwen4_exp`'s ops on the device (`kernels/qwen4.cu`, and the grouped norms of `norm.cu`): grouped
//! norms, hyper-connections, PLE, QSA.

use std::ops::Range;

use osprey_backend::{AttnShape, DType, PagedView, Qwen4Ops, Result, Tensor};

use super::core::Form;
use super::{ptr, u32_of, CudaBackend};
use crate::device::LaunchConfig;
use crate::launch;

impl Qwen4Ops for CudaBackend {
    fn rms_norm_grouped(&self, x: &mut Tensor, w: &Tensor, group: usize, eps: f32) {
        self.rms(x, w, group, eps, Form::OnePlus);
    }

    fn silu(&self, x: &mut Tensor) {
        self.each(x, launch::activate_f32(ptr(x), u32_of(x.numel()), 0));
    }

    fn sigmoid(&self, x: &mut Tensor) {
        self.each(x, launch::activate_f32(ptr(x), u32_of(x.numel()), 1));
    }

    fn rms_norm_gated_sigmoid(&self, x: &mut Tensor, z: &Tensor, w: &Tensor, eps: f32) {
        self.rms(x, w, w.numel(), eps, Form::Sigmoid(z));
    }

    fn hc_combine(&self, m: &Tensor, xn: &Tensor, hc: usize) -> Result<Tensor> {
        let (n, h) = (m.rows(), m.cols() / hc);
        let out = self.empty(DType::F32, &[n, h])?;
        let call = launch::hc_combine(ptr(m), ptr(xn), ptr(&out), u32_of(n), u32_of(hc), u32_of(h));
        self.try_run(call, LaunchConfig::elements(n * h))?;
        Ok(out)
    }

    fn hc_inject(&self, x: &mut Tensor, out: &Tensor, inj: &Tensor, hc: usize) {
        let (n, h) = (x.rows(), out.cols());
        self.each(x, launch::hc_inject(ptr(x), ptr(out), ptr(inj), u32_of(n), u32_of(hc), u32_of(h)));
    }

    fn ple_gate(&self, k: &Tensor, q: &Tensor, v: &Tensor, hc: usize) -> Result<Tensor> {
        let (n, h) = (v.rows(), v.cols());
        let out = self.empty(DType::F32, k.shape())?;
        let call = launch::ple_gate(ptr(k), ptr(q), ptr(v), ptr(&out), u32_of(hc), u32_of(h));
        self.try_run(call, LaunchConfig::per_group(n * hc, 128))?;
        Ok(out)
    }

    fn causal_conv_dilated_silu(
        &self,
        x: &Tensor,
        w: &Tensor,
        kernel: usize,
        dilation: usize,
        state: &mut Tensor,
    ) -> Result<Tensor> {
        let (n, c) = (x.rows(), x.cols());
        let out = self.empty(DType::F32, &[n, c])?;
        let call = launch::causal_conv_dilated_silu(
            ptr(x),
            u32_of(n),
            u32_of(c),
            ptr(w),
            u32_of(kernel),
            u32_of(dilation),
            ptr(state),
            ptr(&out),
        );
        self.try_run(call, LaunchConfig::elements(c))?;
        Ok(out)
    }

    fn mean_rows(&self, x: &Tensor, rows: Range<usize>) -> Result<Tensor> {
        let cols = x.cols();
        let out = self.empty(DType::F32, &[1, cols])?;
        let call = launch::mean_rows(ptr(x), u32_of(rows.start), u32_of(rows.len()), u32_of(cols), ptr(&out));
        self.try_run(call, LaunchConfig::elements(cols))?;
        Ok(out)
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
        let n = rows.len();
        let out = self.empty(DType::I32, &[n, top])?;
        let call = launch::qsa_select(
            ptr(q),
            u32_of(rows.start),
            u32_of(n),
            ptr(keys),
            u32_of(past),
            u32_of(ratio),
            u32_of(top),
            u32_of(heads),
            u32_of(keys.cols()),
            scale,
            ptr(&out),
        );
        let cfg = LaunchConfig { grid: [n.div_ceil(64).max(1) as u32, 1, 1], block: [64, 1, 1] };
        self.try_run(call, cfg)?;
        Ok(out)
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
        let n = rows.len();
        if n == 0 {
            return;
        }
        let top = blocks.cols();
        let stride = top * ratio + ratio; // selected blocks plus at most one incomplete block
        let Some(scratch) = self.scores(n * shape.heads, stride) else { return };
        let (pool, bf16, table, page_size) = super::attention::paged(kv);
        let call = launch::attention_selected(
            ptr(q),
            ptr(out),
            pool,
            bf16,
            table,
            page_size,
            ptr(blocks),
            u32_of(top),
            u32_of(rows.start),
            u32_of(past),
            u32_of(ratio),
            u32_of(shape.heads),
            u32_of(shape.kv_heads),
            u32_of(shape.head_dim),
            scale,
            ptr(&scratch),
            u32_of(stride),
        );
        self.run(call, LaunchConfig::per_group(n * shape.heads, 128));
    }
}
