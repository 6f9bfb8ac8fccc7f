//! The router and routed experts on the device. A layer's pool is one device allocation of `slots`
//! fixed-stride slots, each `[gate | up | down]` (NVFP4: each projection's codes, then its scales); an
//! upload copies the host expert's bytes into its slot. `moe_routed` reads the wave's slot ids back (one
//! small sync per wave: the first, host-driven version of GPU.md's plan), then runs each referenced slot
//! on all of its tokens — gather, gate and up, SwiGLU, down — and writes the weighted rows into their
//! entries of `partials`, slot by slot in ascending order as the CPU does.

use std::collections::BTreeMap;

use osprey_backend::{
    BackendError, DType, ExpertOps, ExpertPool, ExpertShape, Fence, HostData, HostExpert, HostMatrix, MemoryOps,
    Result, Routing, Tensor, WeightView,
};

use super::core::RawWeight;
use super::{ptr, seam_error, u32_of, Buf, CudaBackend};
use crate::device::{DeviceLayer as _, Event, LaunchConfig};
use crate::launch;

/// Where one projection sits in a slot.
#[derive(Clone, Copy, Debug)]
struct Part {
    rows: usize,
    cols: usize,
    data: usize,
    scales: usize,
}

/// A layer's slots on the device, each slot's three global scales (NVFP4; 1 otherwise), and each slot's
/// last copy that the compute stream has not waited for yet.
#[derive(Debug)]
struct CudaPool {
    mem: Buf,
    stride: usize,
    parts: [Part; 3],
    globals: Vec<[f32; 3]>,
    /// The compute stream waits for a slot's copy only when a wave first reads the slot, so an upload
    /// made ahead (a guess, while the layer before computes) overlaps the compute queued meanwhile.
    copying: std::sync::Mutex<Vec<Option<Event>>>,
}

/// Bytes of a `rows × cols` projection of `dtype`: (codes or elements, scales).
fn sizes(dtype: DType, rows: usize, cols: usize) -> (usize, usize) {
    match dtype {
        DType::Nvfp4 => (rows * cols / 2, rows * cols / 16),
        other => (rows * cols * other.size(), 0),
    }
}

/// The slot layout of `shape`: gate and up `[inter, hidden]`, down `[hidden, inter]`.
fn layout(shape: ExpertShape) -> ([Part; 3], usize) {
    let mut at = 0;
    let dims = [(shape.inter, shape.hidden), (shape.inter, shape.hidden), (shape.hidden, shape.inter)];
    let parts = dims.map(|(rows, cols)| {
        let (d, s) = sizes(shape.dtype, rows, cols);
        let part = Part { rows, cols, data: at, scales: at + d };
        at += (d + s).div_ceil(16) * 16; // 16-byte aligned projections
        part
    });
    (parts, at)
}

/// A host projection's memory as bytes, in place: (elements or codes, scales, global scale). The device
/// is little-endian, as the host (x86-64) is, so typed elements are already its bytes.
fn raw_bytes(m: &dyn HostMatrix) -> (&[u8], &[u8], f32) {
    // SAFETY: plain numbers reinterpreted as the bytes they occupy, for as long as `m` lends them.
    let bytes = |p: *const u8, n: usize| unsafe { std::slice::from_raw_parts(p, n) };
    match m.view() {
        WeightView::F32(v) => (bytes(v.as_ptr().cast(), 4 * v.len()), &[], 1.0),
        WeightView::Bf16(v) | WeightView::F16(v) => (bytes(v.as_ptr().cast(), 2 * v.len()), &[], 1.0),
        WeightView::Nvfp4 { packed, scales, global } => (packed, scales, global),
    }
}

impl CudaBackend {
    /// One projection of slot `slot` as the linear kernel reads it.
    fn part(&self, pool: &CudaPool, dtype: DType, slot: usize, which: usize, g: f32) -> RawWeight {
        let base = pool.mem.ptr.offset(slot * pool.stride);
        let p = pool.parts[which];
        RawWeight { data: base.offset(p.data), scales: base.offset(p.scales), global: g, dtype }
    }
}

/// One wave as groups of rows: per slot its first row, its row count and its three projections; the
/// token row and partials entry of every row, slot after slot.
#[derive(Default)]
struct Groups {
    row0: Vec<i32>,
    counts: Vec<i32>,
    /// Per projection (gate, up, down): each group's weight, scales and global scale.
    weights: [(Vec<u64>, Vec<u64>, Vec<f32>); 3],
    rows: Vec<usize>,
    entries: Vec<usize>,
}

impl Groups {
    fn add(&mut self, b: &CudaBackend, pool: &CudaPool, dtype: DType, slot: usize, entries: &[usize], k: usize) {
        self.row0.push(self.rows.len() as i32);
        self.counts.push(entries.len() as i32);
        for (which, (w, s, g)) in self.weights.iter_mut().enumerate() {
            let part = b.part(pool, dtype, slot, which, pool.globals[slot][which]);
            w.push(part.data.0);
            s.push(part.scales.0);
            g.push(part.global);
        }
        self.rows.extend(entries.iter().map(|&en| en / k));
        self.entries.extend_from_slice(entries);
    }
}

impl CudaBackend {
    /// Projection `which` of every group over its rows of `x` → `[rows, n]` (`dims` = (n, k)).
    fn grouped(&self, x: &Tensor, g: &Groups, which: usize, (n, k): (usize, usize), dtype: DType) -> Result<Tensor> {
        let (w, s, glob) = &g.weights[which];
        let bytes = |v: &[u64]| v.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<u8>>();
        let wp = self.upload(HostData::U8(&bytes(w)), &[w.len() * 8])?;
        let sp = self.upload(HostData::U8(&bytes(s)), &[s.len() * 8])?;
        let gp = self.upload_f32(glob, &[glob.len()])?;
        let r0 = self.upload(HostData::I32(&g.row0), &[g.row0.len()])?;
        let rc = self.upload(HostData::I32(&g.counts), &[g.counts.len()])?;
        let out = self.empty(DType::F32, &[g.rows.len(), n])?;
        let wtype = super::core::wtype(dtype)?;
        let call = launch::linear_grouped(
            ptr(x),
            ptr(&wp),
            ptr(&sp),
            ptr(&gp),
            ptr(&r0),
            ptr(&rc),
            wtype,
            ptr(&out),
            u32_of(n),
            u32_of(k),
        );
        let tall = g.counts.iter().copied().max().unwrap_or(0) as usize;
        let cfg = LaunchConfig {
            grid: [n.div_ceil(16) as u32, tall.div_ceil(16) as u32, w.len() as u32],
            block: [16, 16, 1],
        };
        self.try_run(call, cfg)?;
        Ok(out)
    }
}

impl ExpertOps for CudaBackend {
    fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing> {
        let (rows, experts) = (logits.rows(), logits.cols());
        let ids = self.empty(DType::I32, &[rows, k])?;
        let weights = self.empty(DType::F32, &[rows, k])?;
        let call = launch::route_topk(
            ptr(logits),
            ptr(&ids),
            ptr(&weights),
            u32_of(rows),
            u32_of(experts),
            u32_of(k),
            i32::from(renorm),
        );
        let cfg = LaunchConfig { grid: [rows.div_ceil(64).max(1) as u32, 1, 1], block: [64, 1, 1] };
        self.try_run(call, cfg)?;
        Ok(Routing { ids, weights })
    }

    fn alloc_expert_pool(&self, layer: u32, slots: usize, shape: ExpertShape) -> Result<ExpertPool> {
        let (parts, stride) = layout(shape);
        let mem = self.buf(stride * slots.max(1))?;
        let copying = std::sync::Mutex::new(vec![None; slots]);
        let pool = CudaPool { mem, stride, parts, globals: vec![[1.0; 3]; slots], copying };
        Ok(ExpertPool::new(layer, shape, slots, Box::new(pool)))
    }

    fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, expert: HostExpert) -> Result<Fence> {
        let key = expert.key;
        let cuda =
            pool.storage_mut::<CudaPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        if slot >= cuda.globals.len() {
            return Err(BackendError::Slot(format!("slot {slot} out of the pool")));
        }
        let base = cuda.mem.ptr.offset(slot * cuda.stride);
        // The three projections go up on the copy stream, straight from the host expert's memory (the
        // pinned arena on a GPU); the compute stream waits for the last copy before it reads the slot.
        let mut last = None;
        for (i, m) in [&expert.gate, &expert.up, &expert.down].into_iter().enumerate() {
            let p = cuda.parts[i];
            if (m.rows(), m.cols()) != (p.rows, p.cols) {
                return Err(BackendError::Slot(format!(
                    "an expert projection of {}×{} for a {}×{} slot",
                    m.rows(),
                    m.cols(),
                    p.rows,
                    p.cols
                )));
            }
            let (data, scales, global) = raw_bytes(m.as_ref());
            for (at, bytes) in [(p.data, data), (p.scales, scales)] {
                if !bytes.is_empty() {
                    // SAFETY: `expert` owns this memory and is kept in `uploading` until the copy's event
                    // completes.
                    last = Some(unsafe { self.upload_async(base.offset(at), bytes) }?);
                }
            }
            cuda.globals[slot][i] = global;
        }
        cuda.copying.get_mut().unwrap_or_else(|e| e.into_inner())[slot] = last;
        pool.set_key(slot, key);
        let Some(last) = last else { return Ok(Fence(self.dev.record().map_err(super::seam_error)?.0)) };
        let mut uploading = self.uploading.lock().unwrap_or_else(|e| e.into_inner());
        uploading.retain(|(e, _)| !self.dev.is_complete(*e)); // finished copies give their leases back
        uploading.push((last, expert));
        Ok(Fence(last.0))
    }

    fn moe_routed(
        &self,
        x: &Tensor,
        ids: &[i32],
        weights: &Tensor,
        pool: &ExpertPool,
        partials: &mut Tensor,
    ) -> Result<()> {
        // The slot ids come from the host, which built them: no readback of what was just uploaded.
        if ids.len() != weights.numel() {
            return Err(BackendError::Slot(format!("{} slot ids for {} weights", ids.len(), weights.numel())));
        }
        let cuda = pool.storage::<CudaPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        let (k, h, dtype) = (weights.cols(), x.cols(), pool.shape.dtype);
        let mut by_slot: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
        for (entry, &s) in ids.iter().enumerate() {
            if s >= 0 {
                by_slot.entry(s as usize).or_default().push(entry);
            }
        }
        if by_slot.is_empty() {
            return Ok(());
        }
        // The wave's tokens, slot after slot (ascending), as one batch of rows: one grouped GEMM per
        // projection runs every slot on its own rows.
        let mut groups = Groups::default();
        let mut copying = cuda.copying.lock().unwrap_or_else(|e| e.into_inner());
        for (&slot, entries) in &by_slot {
            if pool.key(slot).is_none() {
                return Err(BackendError::Slot(format!("slot {slot} of layer {}'s pool read while empty", pool.layer)));
            }
            // The slot's bytes must have landed before the first kernel that reads them.
            if let Some(copy) = copying[slot].take() {
                self.dev.wait_event(copy).map_err(seam_error)?;
            }
            groups.add(self, cuda, dtype, slot, entries, k);
        }
        drop(copying);
        let (inter, hidden) = (pool.shape.inter, pool.shape.hidden);
        let xs = self.gather_rows(x, &groups.rows)?;
        let mut gate = self.grouped(&xs, &groups, 0, (inter, hidden), dtype)?;
        let up = self.grouped(&xs, &groups, 1, (inter, hidden), dtype)?;
        osprey_backend::CoreOps::silu_mul(self, &mut gate, &up);
        let d = self.grouped(&gate, &groups, 2, (hidden, inter), dtype)?;
        let en: Vec<i32> = groups.entries.iter().map(|&e| e as i32).collect();
        let en = self.upload(HostData::I32(&en), &[en.len()])?;
        let n = groups.entries.len();
        let call = launch::moe_scatter_rows(ptr(partials), ptr(&en), ptr(weights), ptr(&d), u32_of(n), u32_of(h));
        self.try_run(call, LaunchConfig::elements(n * h))
    }

    fn moe_combine(&self, partials: &Tensor, k: usize) -> Result<Tensor> {
        let (h, t) = (partials.cols(), partials.rows() / k);
        let out = self.empty(DType::F32, &[t, h])?;
        let call = launch::moe_combine(ptr(partials), ptr(&out), u32_of(t), u32_of(k), u32_of(h));
        self.try_run(call, LaunchConfig::elements(t * h))?;
        Ok(out)
    }
}
