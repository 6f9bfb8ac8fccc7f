//! Attention on the device (`kernels/attention.cu`): one block per (query row, head) over a scratch
//! row of scores.

use std::ops::Range;

use osprey_backend::{AttentionOps, AttnShape, DType, PagedView, Tensor};

use super::{arg, u32_of, CudaBackend};
use crate::device::{Arg, LaunchConfig};

impl CudaBackend {
    /// Scratch for `blocks` rows of `stride` scores (an allocation failure here is the device's
    /// out-of-memory inside an op that cannot report it: a bug in the memory plan).
    pub(super) fn scores(&self, blocks: usize, stride: usize) -> Tensor {
        self.empty(DType::F32, &[blocks.max(1), stride.max(1)])
            .unwrap_or_else(|e| panic!("attention scratch: {e}: this is a bug"))
    }
}

/// A sequence's paged KV as the attention kernels take it: pool, whether it is bf16, page table, page size.
pub(super) fn paged(kv: PagedView<'_>) -> [Arg; 4] {
    [arg(kv.pool), Arg::I32(i32::from(kv.pool.dtype() == DType::BF16)), arg(kv.table), u32_of(kv.page_size)]
}

/// 128 threads: a head's 128 or 256 dims in one or two passes, a context's scores in strides of 128.
const THREADS: u32 = 128;

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
        let stride = past + n;
        let scratch = self.scores(n * shape.heads, stride);
        let [pool, bf16, table, page_size] = paged(kv);
        let args = [
            arg(q),
            arg(out),
            pool,
            bf16,
            table,
            page_size,
            u32_of(rows.start),
            u32_of(past),
            u32_of(shape.heads),
            u32_of(shape.kv_heads),
            u32_of(shape.head_dim),
            Arg::F32(scale),
            arg(&scratch),
            u32_of(stride),
        ];
        self.run("attention_paged", LaunchConfig::per_group(n * shape.heads, THREADS), &args);
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
        let scratch = self.scores(n * shape.heads, n);
        let args = [
            arg(q),
            arg(k),
            arg(v),
            arg(out),
            u32_of(rows.start),
            u32_of(n),
            u32_of(shape.heads),
            u32_of(shape.kv_heads),
            u32_of(shape.head_dim),
            Arg::F32(scale),
            arg(&scratch),
        ];
        self.run("attention_full", LaunchConfig::per_group(n * shape.heads, THREADS), &args);
    }
}
