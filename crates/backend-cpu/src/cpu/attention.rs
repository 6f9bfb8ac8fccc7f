//! The CPU's attention: causal attention over the paged KV pool, bidirectional attention for vision.

use super::*;

impl AttentionOps for CpuBackend {
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
        let row = shape.kv_heads * shape.head_dim;
        let (k, v) = kv_planes(&kv, (past + rows.len()).div_ceil(kv.page_size), row);
        let (k, v): (Vec<&[f32]>, Vec<&[f32]>) = (k.iter().map(|p| &**p).collect(), v.iter().map(|p| &**p).collect());
        let c = q.cols();
        let paged = PagedKv { k: &k, v: &v, page: kv.page_size };
        let q = &host(q)[rows.start * c..rows.end * c];
        causal_attention_paged(q, paged, past, shape, scale, &mut host_mut(out)[rows.start * c..rows.end * c]);
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
        let (qc, kc) = (q.cols(), k.cols());
        let (q, k, v) = (
            &host(q)[rows.start * qc..rows.end * qc],
            &host(k)[rows.start * kc..rows.end * kc],
            &host(v)[rows.start * kc..rows.end * kc],
        );
        let out = &mut host_mut(out)[rows.start * qc..rows.end * qc];
        // The fast precision takes bf16 tiles where the CPU has them (a 448×448 image's 784 patches
        // attend 784 × 784 per head in every layer of the tower).
        match self.precision {
            Precision::Int8 => bidirectional_attention_fast(q, k, v, shape, scale, out),
            Precision::Exact => bidirectional_attention(q, k, v, shape, scale, out),
        }
    }
}
