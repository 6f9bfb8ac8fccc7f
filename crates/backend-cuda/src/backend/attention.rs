//! Attention on the device (`kernels/attention.cu`). Causal attention over paged KV is flash attention:
//! K/V tiles through shared memory read once for a KV head's query heads, online softmax, and for
//! decode the context split across blocks (flash-decoding) with a combine kernel, so no score is stored
//! and memory does not grow with the context. The sequences of a decode step attend in one launch (and
//! one combine), each row with its own sequence's page table and split, and their new K/V rows go into
//! the pool in one launch that norms and rotates K on the way (`kernels/rope.cu`). Bidirectional
//! attention (vision) is one block per (query row, head) over a scratch row of scores, in bands under a
//! cap.

use std::ops::Range;

use osprey_backend::{
    AttentionOps, AttnShape, BackendError, DType, MRope, PagedRows, PagedView, Result, RopeTable, Tensor,
};

use super::core::{threads_for, NORM_ROPE_MAX_D};
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

/// `attention_flash`'s widest head and the query heads × width one block holds (`FMAX_D`, `FMAX_QD` in
/// `kernels/attention.cu`), and its tile of positions (`FT`).
const FLASH_MAX_D: usize = 256;
const FLASH_MAX_QD: usize = 2048;
const FLASH_TILE: usize = 16;
/// Blocks a flash launch aims for (about two per SM of a large card): the context is split until rows ×
/// KV heads × splits reach it, so a decode step (one row, a few KV heads) still fills the card.
const FLASH_BLOCKS: usize = 256;
/// The fewest positions a split takes (below this the combine costs more than the split saves).
const FLASH_MIN_SPAN: usize = 64;

/// How a flash launch divides its work: query heads a block (`hchunk`, `chunks` blocks a KV head) and
/// the context's splits of `span` positions.
#[derive(Debug, PartialEq, Eq)]
pub(super) struct FlashPlan {
    pub(super) hchunk: usize,
    pub(super) chunks: usize,
    pub(super) span: usize,
    pub(super) splits: usize,
}

impl FlashPlan {
    /// The plan for `n` query rows after `past` tokens.
    pub(super) fn new(n: usize, past: usize, shape: AttnShape) -> Self {
        let group = shape.heads / shape.kv_heads;
        let hchunk = group.min(FLASH_MAX_QD / shape.head_dim.max(1)).clamp(1, 32);
        let chunks = group.div_ceil(hchunk);
        let keys = past + n;
        let want = FLASH_BLOCKS.div_ceil(n * shape.kv_heads * chunks);
        let span = keys.div_ceil(want).max(FLASH_MIN_SPAN).next_multiple_of(FLASH_TILE);
        FlashPlan { hchunk, chunks, span, splits: keys.div_ceil(span) }
    }
}

impl CudaBackend {
    /// Query rows per launch so a band's scores (`rows × heads × keys` f32) stay within the scratch cap:
    /// attention's scratch is bounded by the cap, not by the chunk times the context (at least one row).
    fn band(&self, n: usize, heads: usize, keys: usize) -> usize {
        (self.scratch_cap / (heads * keys.max(1) * 4).max(1)).clamp(1, n.max(1))
    }
}

/// Bytes of one `FlashRow` (`kernels/attention.cu`): the page table's address, then the row of `q`, the
/// positions it sees, its split width and a pad, `u32` each.
const FLASH_ROW: usize = 24;

impl CudaBackend {
    /// One `attention_flash` launch (and its combine) for the rows of `seqs`, which share a pool: every
    /// row with its own sequence's plan, so it computes the bits it would in a launch of its own.
    fn flash(&self, q: &Tensor, seqs: &[&PagedRows<'_>], shape: AttnShape, scale: f32, out: &mut Tensor) {
        let (heads, kv_heads, head_dim) = (shape.heads, shape.kv_heads, shape.head_dim);
        let Some(first) = seqs.first() else { return };
        // A block's query heads depend on the shape alone; the splits on each sequence's rows and past.
        let FlashPlan { hchunk, chunks, .. } = FlashPlan::new(1, 0, shape);
        let (mut desc, mut splits, mut keys) = (Vec::new(), 1, 0usize);
        for s in seqs {
            let plan = FlashPlan::new(s.rows.len(), s.past, shape);
            splits = splits.max(plan.splits);
            let table = ptr(s.kv.table).0;
            for (i, row) in s.rows.clone().enumerate() {
                let len = s.past + i + 1;
                keys += len;
                desc.extend_from_slice(&table.to_le_bytes());
                for v in [u32_of(row), u32_of(len), u32_of(plan.span), 0] {
                    desc.extend_from_slice(&v.to_le_bytes());
                }
            }
        }
        let n = desc.len() / FLASH_ROW;
        let desc = match self.upload_bytes(&desc) {
            Ok(d) => d,
            Err(e) => return self.fail("attention rows", e),
        };
        let part = if splits > 1 {
            // The splits' partial sums: rows × heads × splits × (head_dim + 2) floats, bounded by the
            // blocks a launch aims for, not by the context.
            match self.empty(DType::F32, &[n * heads * splits, head_dim + 2]) {
                Ok(t) => Some(t),
                Err(e) => return self.fail("attention partial sums", e),
            }
        } else {
            None
        };
        let (pool, bf16, _, page_size) = paged(first.kv);
        let (h, kvh, hd) = (u32_of(heads), u32_of(kv_heads), u32_of(head_dim));
        let part_ptr = part.as_ref().map_or(ptr(out), ptr);
        let call = launch::attention_flash(
            ptr(q),
            ptr(out),
            pool,
            bf16,
            desc.ptr,
            page_size,
            u32_of(n),
            u32_of(keys), // the declared arithmetic's; saturates past 2^32 positions a launch
            h,
            kvh,
            hd,
            scale,
            u32_of(hchunk),
            part_ptr,
        );
        let grid = [u32_of(n), u32_of(kv_heads * chunks), u32_of(splits)];
        self.run(call, LaunchConfig { grid, block: [THREADS, 1, 1] });
        if let Some(part) = part {
            let call = launch::attention_combine(ptr(&part), ptr(out), desc.ptr, u32_of(n), h, hd, u32_of(splits));
            self.run(call, LaunchConfig::per_group(n * heads, THREADS));
        }
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
        self.attention_paged_rows(q, &[PagedRows { rows, kv, past }], shape, scale, out);
    }

    fn attention_paged_rows(&self, q: &Tensor, seqs: &[PagedRows<'_>], shape: AttnShape, scale: f32, out: &mut Tensor) {
        let seqs: Vec<&PagedRows<'_>> = seqs.iter().filter(|s| !s.rows.is_empty()).collect();
        let Some(first) = seqs.first() else { return };
        let (heads, kv_heads, head_dim) = (shape.heads, shape.kv_heads, shape.head_dim);
        if head_dim > FLASH_MAX_D || kv_heads == 0 || heads % kv_heads != 0 {
            return self
                .fail("attention_paged", format!("no flash attention for {shape:?} (heads of at most {FLASH_MAX_D})"));
        }
        // One launch reads one pool: sequences of one pool (a served batch's) together, others apart.
        let pool_of = |s: &PagedRows<'_>| (ptr(s.kv.pool), s.kv.pool.dtype(), s.kv.page_size);
        if seqs.iter().all(|s| pool_of(s) == pool_of(first)) {
            self.flash(q, &seqs, shape, scale, out);
        } else {
            seqs.iter().for_each(|s| self.flash(q, &[s], shape, scale, out));
        }
    }

    fn write_kv(
        &self,
        pool: &mut Tensor,
        k: &Tensor,
        v: &Tensor,
        slots: &[(usize, usize)],
        page_size: usize,
        (w, eps, one_plus): (&Tensor, f32, bool),
        (rope, table): (&MRope, &RopeTable),
    ) -> Result<()> {
        if slots.is_empty() {
            return Ok(()); // a zero-size grid is not a launch
        }
        let (hd, row) = (rope.head_dim(), k.cols());
        let fits = hd <= NORM_ROPE_MAX_D && w.numel() == hd && hd > 0 && row.is_multiple_of(hd) && pool.cols() == row;
        let types =
            k.dtype() == DType::F32 && v.dtype() == DType::F32 && matches!(pool.dtype(), DType::F32 | DType::BF16);
        if !fits || !types {
            return Err(BackendError::Device(format!(
                "write_kv of {:?} {:?} K rows into a {:?} {:?} pool, heads of {hd} (at most {NORM_ROPE_MAX_D}): this is a bug",
                k.shape(),
                k.dtype(),
                pool.shape(),
                pool.dtype()
            )));
        }
        let pairs: Vec<u8> =
            slots.iter().flat_map(|&(s, d)| [u32_of(s), u32_of(d)]).flat_map(u32::to_le_bytes).collect();
        let pairs = self.upload_bytes(&pairs)?;
        let call = launch::kv_write_rope(
            ptr(k),
            ptr(v),
            ptr(pool),
            i32::from(pool.dtype() == DType::BF16),
            pairs.ptr,
            u32_of(page_size),
            u32_of(row / hd),
            u32_of(hd),
            ptr(w),
            ptr(&table.cos),
            ptr(&table.sin),
            u32_of(table.cos.cols()),
            eps,
            i32::from(one_plus),
        );
        self.try_run(call, LaunchConfig::per_group(slots.len() * (row / hd), threads_for(hd)))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The partial sums a flash launch needs: rows × heads × splits × (head_dim + 2) floats.
    fn part_bytes(n: usize, past: usize, s: AttnShape) -> usize {
        let p = FlashPlan::new(n, past, s);
        if p.splits > 1 {
            n * s.heads * p.splits * (s.head_dim + 2) * 4
        } else {
            0
        }
    }

    #[test]
    fn flash_attention_memory_does_not_grow_with_the_context() {
        // Qwen3.5-35B-A3B's attention: 16 query heads over 2 KV heads of 256.
        let s = AttnShape { heads: 16, kv_heads: 2, head_dim: 256 };
        // Decode: the context split until the launch has ~256 blocks, every split whole tiles.
        let p = FlashPlan::new(1, 65_535, s);
        assert_eq!((p.hchunk, p.chunks), (8, 1), "a KV head's 8 query heads share its tiles");
        assert_eq!((p.span, p.splits), (512, 128));
        assert!(FlashPlan::new(1, 10, s).splits == 1, "a short context is one split, no combine");
        // A 512-token chunk: its rows fill the card, one split, no partial sums at any context.
        assert_eq!(FlashPlan::new(512, 65_024, s).splits, 1);
        // The partial sums for 1, 8 and 512 rows at 1k, 32k and 64k tokens stay under 4 MiB: bounded by
        // the blocks a launch aims for, not by the context (the score scratch this replaced was
        // rows × heads × context × 4 bytes: 1 GiB for 512 rows at 32k).
        for n in [1, 8, 512] {
            for ctx in [1024, 32_768, 65_536] {
                let bytes = part_bytes(n, ctx - n, s);
                assert!(bytes <= 4 << 20, "{n} rows at {ctx} tokens: {bytes} bytes of partial sums");
            }
        }
        assert_eq!(part_bytes(1, 65_535, s), 16 * 128 * 258 * 4, "decode at 64k: 2.1 MB");
    }
}
