//! Attention on the device (`kernels/attention.cu`): one block per (query row, head) over a scratch
//! row of scores.

use std::ops::Range;

use osprey_backend::{AttentionOps, AttnShape, DType, PagedView, Tensor};

use super::{ptr, u32_of, CudaBackend};
use crate::device::{DevPtr, LaunchConfig};
use crate::launch;

impl CudaBackend {
    /// Scratch for `blocks` rows of `stride` scores. An op that cannot report errors needs it: a failed
    /// allocation (a memory plan that left too little) is recorded as the device's fault and the op is
    /// skipped, so the step fails at its next fallible op instead of the process panicking.
    pub(super) fn scores(&self, blocks: usize, stride: usize) -> Option<Tensor> {
        let t = self.empty(DType::F32, &[blocks.max(1), stride.max(1)]);
        t.map_err(|e| self.fail("attention scratch", format!("{blocks} × {stride} scores: {e}"))).ok()
    }
}

/// A sequence's paged KV as the attention kernels take it: pool, whether it is bf16, page table, page size.
pub(super) fn paged(kv: PagedView<'_>) -> (DevPtr, i32, DevPtr, u32) {
    (ptr(kv.pool), i32::from(kv.pool.dtype() == DType::BF16), ptr(kv.table), u32_of(kv.page_size))
}

/// 128 threads: a head's 128 or 256 dims in one or two passes, a context's scores in strides of 128.
const THREADS: u32 = 128;

impl CudaBackend {
    /// Query rows per launch so a band's scores (`rows × heads × keys` f32) stay within the scratch cap:
    /// attention's scratch is bounded by the cap, not by the chunk times the context (at least one row).
    fn band(&self, n: usize, heads: usize, keys: usize) -> usize {
        (self.scratch_cap / (heads * keys.max(1) * 4).max(1)).clamp(1, n.max(1))
    }
}

impl AttentionOps for CudaBackend {
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
        let n = rows.len();
        if n == 0 {
            return;
        }
        // Bands of query rows: row `j` of the chunk is row `rows.start + j` of `q` after `past + j` tokens,
        // so a band starting at `j0` is the same kernel at (`rows.start + j0`, `past + j0`).
        let stride = past + n;
        let band = self.band(n, shape.heads, stride);
        let Some(scratch) = self.scores(band * shape.heads, stride) else { return };
        let (pool, bf16, table, page_size) = paged(kv);
        let (heads, kv_heads, head_dim) = (u32_of(shape.heads), u32_of(shape.kv_heads), u32_of(shape.head_dim));
        for j0 in (0..n).step_by(band) {
            let m = band.min(n - j0);
            let call = launch::attention_paged(
                ptr(q),
                ptr(out),
                pool,
                bf16,
                table,
                page_size,
                u32_of(rows.start + j0),
                u32_of(past + j0),
                heads,
                kv_heads,
                head_dim,
                scale,
                ptr(&scratch),
                u32_of(stride),
            );
            self.run(call, LaunchConfig::per_group(m * shape.heads, THREADS));
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
        let n = rows.len();
        if n == 0 {
            return;
        }
        // Bands of query rows over all `n` keys (a large image's `n × n` scores never exist at once).
        let band = self.band(n, shape.heads, n);
        let Some(scratch) = self.scores(band * shape.heads, n) else { return };
        let (heads, kv_heads, head_dim) = (u32_of(shape.heads), u32_of(shape.kv_heads), u32_of(shape.head_dim));
        let (row0, n32) = (u32_of(rows.start), u32_of(n));
        for j0 in (0..n).step_by(band) {
            let m = band.min(n - j0);
            let call = launch::attention_full(
                ptr(q),
                ptr(k),
                ptr(v),
                ptr(out),
                row0,
                n32,
                u32_of(j0),
                heads,
                kv_heads,
                head_dim,
                scale,
                ptr(&scratch),
            );
            self.run(call, LaunchConfig::per_group(m * shape.heads, THREADS));
        }
    }
}
