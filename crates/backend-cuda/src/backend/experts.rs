//! The router and routed experts on the device. A layer's pool is one device allocation of `slots`
//! fixed-stride slots, each `[gate | up | down]` (NVFP4: each projection's codes, then its scales); an
//! upload copies the host expert's bytes into its slot. A wave's experts run as groups of rows — gather,
//! gate and up, SwiGLU, down, each projection one grouped GEMM over every group — and their weighted rows
//! go into their entries of `partials`, slot by slot in ascending order as the CPU does. The groups come
//! from the host (`moe_routed`: the layer's slot ids, packed with the groups' tables into one upload per
//! wave) or, with every expert in a slot, from the router's ids on the device (`moe_routed_on_device`:
//! `moe_align` builds them; no readback, no upload).

use std::collections::BTreeMap;

use osprey_backend::{
    BackendError, DType, ExpertOps, ExpertPool, ExpertShape, Fence, HostExpert, HostMatrix, Result, Routing, Tensor,
    WeightView,
};

use super::core::RawWeight;
use super::{ptr, seam_error, u32_of, Buf, CudaBackend};
use crate::device::{DevPtr, DeviceLayer as _, Event, LaunchConfig};
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
    /// Every slot's three projections as `moe_align` reads them (`[3, slots]` weights, scales and global
    /// scales), made at the first step routed on the device and again after an upload changed a slot.
    tables: std::sync::Mutex<Option<[Buf; 3]>>,
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

/// One wave as groups of rows, built on the host: per slot its first row, its row count and its three
/// projections; the token row and partials entry of every row, slot after slot.
#[derive(Default)]
struct Groups {
    row0: Vec<u32>,
    counts: Vec<u32>,
    /// Per projection (gate, up, down): each group's weight, scales and global scale.
    weights: [(Vec<u64>, Vec<u64>, Vec<f32>); 3],
    tokens: Vec<i32>,
    entries: Vec<i32>,
}

impl Groups {
    fn add(&mut self, b: &CudaBackend, pool: &CudaPool, dtype: DType, slot: usize, entries: &[usize], k: usize) {
        self.row0.push(self.tokens.len() as u32);
        self.counts.push(entries.len() as u32);
        for (which, (w, s, g)) in self.weights.iter_mut().enumerate() {
            let part = b.part(pool, dtype, slot, which, pool.globals[slot][which]);
            w.push(part.data.0);
            s.push(part.scales.0);
            g.push(part.global);
        }
        self.tokens.extend(entries.iter().map(|&en| (en / k) as i32));
        self.entries.extend(entries.iter().map(|&en| en as i32));
    }

    /// Every array in one buffer, each section 8-byte aligned, in [`OnDevice`]'s order: one upload per
    /// wave.
    fn packed(&self) -> (Vec<u8>, [usize; 7]) {
        let mut out = Vec::new();
        let mut at = [0; 7];
        let mut section = |i: usize, bytes: &mut dyn Iterator<Item = u8>| {
            at[i] = out.len();
            out.extend(bytes);
            out.resize(out.len().div_ceil(8) * 8, 0);
        };
        let [(w0, s0, g0), (w1, s1, g1), (w2, s2, g2)] = &self.weights;
        let le64 = |v: &[u64]| v.iter().flat_map(|p| p.to_le_bytes()).collect::<Vec<u8>>();
        section(0, &mut self.row0.iter().flat_map(|v| v.to_le_bytes()));
        section(1, &mut self.counts.iter().flat_map(|v| v.to_le_bytes()));
        section(2, &mut [w0, w1, w2].into_iter().flat_map(|v| le64(v)));
        section(3, &mut [s0, s1, s2].into_iter().flat_map(|v| le64(v)));
        section(
            4,
            &mut [g0, g1, g2].into_iter().flat_map(|v| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>()),
        );
        section(5, &mut self.entries.iter().flat_map(|v| v.to_le_bytes()));
        section(6, &mut self.tokens.iter().flat_map(|v| v.to_le_bytes()));
        (out, at)
    }
}

/// A wave's groups in device memory, from the host ([`Groups::packed`], one upload) or from the router's
/// ids (`moe_align`): per group its first row and row count, the three projections' tables (`[3,
/// groups]` weights, scales, global scales), and each row's partials entry and token.
pub(super) struct OnDevice {
    pub(super) row0: DevPtr,
    pub(super) rows: DevPtr,
    pub(super) w: DevPtr,
    pub(super) s: DevPtr,
    pub(super) g: DevPtr,
    pub(super) entries: DevPtr,
    pub(super) tokens: DevPtr,
    /// Groups (the tables' stride), rows in all, the most rows a group may have.
    pub(super) groups: usize,
    pub(super) n: usize,
    pub(super) tall: usize,
    /// The step's tokens (a group's rows are at most these).
    pub(super) step_rows: usize,
}

impl OnDevice {
    /// Projection `which`'s row of the tables: every group's weight, scales and global scale.
    pub(super) fn projection(&self, which: usize) -> (DevPtr, DevPtr, DevPtr) {
        let at = which * self.groups;
        (self.w.offset(8 * at), self.s.offset(8 * at), self.g.offset(4 * at))
    }
}

impl CudaBackend {
    /// Projection `which` of every group over its rows of `x` → `[rows, cols]` (`dims` = (cols, depth)).
    fn grouped(
        &self,
        x: &Tensor,
        g: &OnDevice,
        which: usize,
        (cols, depth): (usize, usize),
        dtype: DType,
    ) -> Result<Tensor> {
        let out = self.empty(DType::F32, &[g.n, cols])?;
        let (w, s, gl) = g.projection(which);
        let (wtype, o, n, k) = (super::core::wtype(dtype)?, ptr(&out), u32_of(cols), u32_of(depth));
        if g.step_rows <= super::core::GEMV_ROWS {
            // Decode: a warp per output column reads each weight row once for its group's rows. Chosen by
            // the step's rows, which bound every group's on either path, so a step's experts compute the
            // same bits whether the host or the device grouped them.
            let call = launch::linear_grouped_gemv(ptr(x), w, s, gl, g.row0, g.rows, wtype, o, n, k);
            let grid = [cols.div_ceil(8) as u32, 1, g.groups as u32];
            self.try_run(call, LaunchConfig { grid, block: [256, 1, 1] })?;
        } else {
            let call = launch::linear_grouped(ptr(x), w, s, gl, g.row0, g.rows, wtype, o, n, k);
            let grid = [cols.div_ceil(16) as u32, g.tall.div_ceil(16) as u32, g.groups as u32];
            self.try_run(call, LaunchConfig { grid, block: [16, 16, 1] })?;
        }
        Ok(out)
    }

    /// Every group on its rows of `x` — gather, gate and up, SwiGLU, down — and each row's output, times
    /// its weight, into its entry of `partials`.
    fn run_groups(
        &self,
        x: &Tensor,
        weights: &Tensor,
        shape: ExpertShape,
        g: &OnDevice,
        partials: &mut Tensor,
    ) -> Result<()> {
        let (h, n) = (x.cols(), g.n);
        let q8_fits = shape.inter.is_multiple_of(super::q8::Q8_COLS) && h <= super::q8::Q8_MAX_HIDDEN;
        if self.q8_path(g.step_rows, shape.dtype, h) && q8_fits {
            return self.experts_q8(x, weights, shape, g, partials);
        }
        if self.mma_path(g.step_rows, shape.dtype, h) && shape.inter.is_multiple_of(super::q8::MMA_COLS) {
            return self.experts_mma(x, weights, shape, g, partials);
        }
        let xs = self.empty(DType::F32, &[n, h])?;
        let call = launch::gather_rows(ptr(x), g.tokens, ptr(&xs), u32_of(n), u32_of(h), 4);
        self.try_run(call, LaunchConfig::elements(n * h * 4))?;
        let (inter, hidden, dtype) = (shape.inter, shape.hidden, shape.dtype);
        let mut gate = self.grouped(&xs, g, 0, (inter, hidden), dtype)?;
        let up = self.grouped(&xs, g, 1, (inter, hidden), dtype)?;
        osprey_backend::CoreOps::silu_mul(self, &mut gate, &up);
        let d = self.grouped(&gate, g, 2, (hidden, inter), dtype)?;
        let call = launch::moe_scatter_rows(ptr(partials), g.entries, ptr(weights), ptr(&d), u32_of(n), u32_of(h));
        self.try_run(call, LaunchConfig::elements(n * h))
    }
}

impl CudaBackend {
    /// `cuda`'s per-slot tables for `moe_align`, made if an upload changed a slot since they were.
    fn slot_tables<'a>(&self, cuda: &'a CudaPool, dtype: DType) -> Result<std::sync::MutexGuard<'a, Option<[Buf; 3]>>> {
        let mut tables = cuda.tables.lock().unwrap_or_else(|e| e.into_inner());
        if tables.is_none() {
            let slots = cuda.globals.len();
            let (mut w, mut s, mut g) = (Vec::new(), Vec::new(), Vec::new());
            for which in 0..3 {
                for slot in 0..slots {
                    let part = self.part(cuda, dtype, slot, which, cuda.globals[slot][which]);
                    w.extend_from_slice(&part.data.0.to_le_bytes());
                    s.extend_from_slice(&part.scales.0.to_le_bytes());
                    g.extend_from_slice(&part.global.to_le_bytes());
                }
            }
            *tables = Some([self.upload_bytes(&w)?, self.upload_bytes(&s)?, self.upload_bytes(&g)?]);
        }
        Ok(tables)
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
        let tables = std::sync::Mutex::new(None);
        let pool = CudaPool { mem, stride, parts, globals: vec![[1.0; 3]; slots], copying, tables };
        Ok(ExpertPool::new(layer, shape, slots, Box::new(pool)))
    }

    fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, expert: HostExpert, after: Fence) -> Result<Fence> {
        let key = expert.key;
        let cuda =
            pool.storage_mut::<CudaPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        if slot >= cuda.globals.len() {
            return Err(BackendError::Slot(format!("slot {slot} out of the pool")));
        }
        let base = cuda.mem.ptr.offset(slot * cuda.stride);
        // The slot's last reader runs before the copy overwrites it: the copy stream waits for it.
        if after != Fence::DONE {
            self.dev.copies_after(Event(after.0)).map_err(seam_error)?;
        }
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
        *cuda.tables.get_mut().unwrap_or_else(|e| e.into_inner()) = None;
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
        let (k, dtype) = (weights.cols(), pool.shape.dtype);
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
        let (bytes, at) = groups.packed();
        let buf = self.upload_bytes(&bytes)?;
        let p = |i: usize| buf.ptr.offset(at[i]);
        let tall = groups.counts.iter().copied().max().unwrap_or(0) as usize;
        let g = OnDevice {
            row0: p(0),
            rows: p(1),
            w: p(2),
            s: p(3),
            g: p(4),
            entries: p(5),
            tokens: p(6),
            groups: groups.counts.len(),
            n: groups.entries.len(),
            tall,
            step_rows: x.rows(),
        };
        self.run_groups(x, weights, pool.shape, &g, partials)
    }

    fn moe_routed_on_device(
        &self,
        x: &Tensor,
        routing: &Routing,
        slot_of: &Tensor,
        pool: &ExpertPool,
        partials: &mut Tensor,
    ) -> Result<()> {
        let cuda = pool.storage::<CudaPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        let (t, k) = (routing.weights.rows(), routing.weights.cols());
        let (n, slots, dtype) = (t * k, cuda.globals.len(), pool.shape.dtype);
        if let Some(s) = (0..slots).find(|&s| pool.key(s).is_none()) {
            return Err(BackendError::Slot(format!(
                "slot {s} of layer {}'s pool is empty: every slot must hold an expert",
                pool.layer
            )));
        }
        if n == 0 {
            return Ok(());
        }
        // Every slot's copy must have landed before a kernel reads it: stream waits, no host wait.
        for copy in cuda.copying.lock().unwrap_or_else(|e| e.into_inner()).iter_mut() {
            if let Some(e) = copy.take() {
                self.dev.wait_event(e).map_err(seam_error)?;
            }
        }
        // At most one group per entry; a group has at most `t` rows (a token takes an expert once).
        let groups = n.min(slots);
        let (row0, rows) = (self.buf(4 * groups)?, self.buf(4 * groups)?);
        let (w, s, g) = (self.buf(8 * 3 * groups)?, self.buf(8 * 3 * groups)?, self.buf(4 * 3 * groups)?);
        let (entries, tokens) = (self.empty(DType::I32, &[n])?, self.empty(DType::I32, &[n])?);
        {
            let tables = self.slot_tables(cuda, dtype)?;
            let Some([tw, ts, tg]) = tables.as_ref() else { return Err(BackendError::Slot("no slot tables".into())) };
            let call = launch::moe_align(
                ptr(&routing.ids),
                ptr(slot_of),
                u32_of(n),
                u32_of(k),
                u32_of(slots),
                u32_of(groups),
                tw.ptr,
                ts.ptr,
                tg.ptr,
                row0.ptr,
                rows.ptr,
                w.ptr,
                s.ptr,
                g.ptr,
                ptr(&entries),
                ptr(&tokens),
            );
            self.try_run(call, LaunchConfig { grid: [1, 1, 1], block: [32, 1, 1] })?;
        }
        let on_device = OnDevice {
            row0: row0.ptr,
            rows: rows.ptr,
            w: w.ptr,
            s: s.ptr,
            g: g.ptr,
            entries: ptr(&entries),
            tokens: ptr(&tokens),
            groups,
            n,
            tall: t,
            step_rows: t,
        };
        self.run_groups(x, &routing.weights, pool.shape, &on_device, partials)
    }

    fn moe_combine(&self, partials: &Tensor, k: usize) -> Result<Tensor> {
        self.combine(partials, k, None)
    }

    fn moe_combine_shared(&self, partials: &Tensor, k: usize, shared: &Tensor, gate: &Tensor) -> Result<Tensor> {
        self.combine(partials, k, Some((shared, gate)))
    }
}

impl CudaBackend {
    /// `moe_combine`, with the shared expert added under its gate in the same launch where given.
    fn combine(&self, partials: &Tensor, k: usize, shared: Option<(&Tensor, &Tensor)>) -> Result<Tensor> {
        let (h, t) = (partials.cols(), partials.rows() / k.max(1));
        if let Some((s, g)) = shared {
            if s.shape() != [t, h] || g.numel() != t {
                return Err(BackendError::Device(format!(
                    "moe_combine_shared of {t} × {h} with a shared output {:?} and {} gates: this is a bug",
                    s.shape(),
                    g.numel()
                )));
            }
        }
        let out = self.empty(DType::F32, &[t, h])?;
        // Without a shared expert the kernel reads neither pointer; it is given the partials' (a launch
        // names no null address).
        let (sp, gp) = shared.map_or((ptr(partials), ptr(partials)), |(s, g)| (ptr(s), ptr(g)));
        let with = i32::from(shared.is_some());
        let call = launch::moe_combine(ptr(partials), ptr(&out), u32_of(t), u32_of(k), u32_of(h), with, sp, gp);
        self.try_run(call, LaunchConfig::elements(t * h))?;
        Ok(out)
    }
}
