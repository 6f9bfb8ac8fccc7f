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
        let pages = (past + rows.len()).div_ceil(kv.page_size);
        let c = q.cols();
        let q = &host(q)[rows.start * c..rows.end * c];
        let out = &mut host_mut(out)[rows.start * c..rows.end * c];
        // A bf16 pool is read as bf16: decode widens it in registers (half the bytes of f32).
        match host_data(kv.pool) {
            HostVec::F32(d) => {
                let (k, v) = typed_planes(d, &kv, pages, row);
                causal_attention_paged(q, PagedKv { k: &k, v: &v, page: kv.page_size }, past, shape, scale, out);
            }
            HostVec::Bf16(d) => {
                let (k, v) = typed_planes(d, &kv, pages, row);
                causal_attention_paged(q, PagedKv { k: &k, v: &v, page: kv.page_size }, past, shape, scale, out);
            }
            other => panic!("a KV pool of {:?}: this is a bug", other.as_data().dtype()),
        }
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
