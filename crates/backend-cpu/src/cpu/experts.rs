//! Routed experts on the CPU backend. A slot is the host expert itself (no copy): the pool keeps the
//! [`HostExpert`], lease included, until the slot is reused, so what a slot reads stays valid and counted
//! by the residency manager. The computation is the one the MoE block did before slots, in the same
//! order: each expert on all of its wave's tokens at once, weighted outputs summed per token from zero in
//! ascending expert id, so answers are the same bits whatever was resident.

use osprey_backend::{ExpertPool, HostExpert};

use super::*;

/// Below this many rows per expert, a wave's experts run one per pool item ([`CpuBackend::routed`]): the
/// int8 GEMV's limit ([`osprey_kernels::INT8_GEMV_BELOW_ROWS`]), past which a matmul is a GEMM worth
/// splitting across threads on its own (and AMX tiles take over where granted).
const PARALLEL_EXPERT_ROWS: usize = osprey_kernels::INT8_GEMV_BELOW_ROWS;

/// The CPU backend's storage of an [`ExpertPool`]: per slot, the host expert it aliases.
#[derive(Debug, Default)]
pub(crate) struct CpuPool(pub(crate) Vec<Option<HostExpert>>);

impl CpuBackend {
    /// [`Backend::moe_routed`]: per referenced slot (ascending), its tokens gathered, SwiGLU through the
    /// expert's placed projections, and each output row scaled by its weight into `partials`.
    pub(crate) fn routed(
        &self,
        x: &Tensor,
        ids: &[i32],
        weights: &Tensor,
        pool: &ExpertPool,
        partials: &mut Tensor,
    ) -> Result<()> {
        let (w, k, h) = (host(weights), weights.cols(), x.cols());
        if ids.len() != weights.numel() {
            return Err(BackendError::Slot(format!("{} slot ids for {} weights", ids.len(), weights.numel())));
        }
        let cpu = pool.storage::<CpuPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        // Entries per slot, tokens ascending (an expert appears at most once per token).
        let mut by_slot: std::collections::BTreeMap<usize, Vec<usize>> = Default::default();
        for (entry, &s) in ids.iter().enumerate() {
            if s >= 0 {
                by_slot.entry(s as usize).or_default().push(entry);
            }
        }
        let waves: Vec<(&HostExpert, Vec<usize>)> = by_slot
            .into_iter()
            .map(|(slot, entries)| {
                let e = cpu.0.get(slot).and_then(Option::as_ref).ok_or_else(|| {
                    BackendError::Slot(format!("slot {slot} of layer {}'s pool read while empty", pool.layer))
                })?;
                Ok((e, entries))
            })
            .collect::<Result<_>>()?;
        let expert = |i: usize| -> Result<Tensor> {
            let (e, entries) = &waves[i];
            let rows: Vec<usize> = entries.iter().map(|&en| en / k).collect();
            let xs = self.gather_rows(x, &rows)?;
            let (gate, up, down) = (
                self.place_weight(e.gate.clone())?,
                self.place_weight(e.up.clone())?,
                self.place_weight(e.down.clone())?,
            );
            let (mut g, u) = self.linear_pair(&xs, &gate, &up)?;
            self.silu_mul(&mut g, &u);
            self.linear(&g, &down)
        };
        // A decode step's experts (a few rows each, ~58 a layer at 8 sequences): one expert per pool item,
        // its matmuls inline on that thread, so each thread streams whole experts (1.8 MB of NVFP4 at
        // Qwen3.5-35B-A3B) instead of every projection being split into 64-row blocks across threads
        // and waited for. Larger experts (a prefill chunk's) split their GEMMs as before. The bits are
        // the same either way: each output row is computed by the same kernel and instructions.
        let small = waves.iter().all(|(_, entries)| entries.len() < PARALLEL_EXPERT_ROWS);
        let outs: Vec<Result<Tensor>> = if small && waves.len() > 1 {
            osprey_kernels::pool::map(waves.len(), expert)
        } else {
            (0..waves.len()).map(expert).collect()
        };
        let out = host_mut(partials);
        for ((_, entries), d) in waves.iter().zip(outs) {
            let d = d?;
            let d = host(&d);
            for (i, &en) in entries.iter().enumerate() {
                let wt = w[en];
                for (o, v) in out[en * h..(en + 1) * h].iter_mut().zip(&d[i * h..(i + 1) * h]) {
                    *o = v * wt;
                }
            }
        }
        Ok(())
    }

    /// [`Backend::moe_combine`].
    pub(crate) fn combine(&self, partials: &Tensor, k: usize) -> Result<Tensor> {
        let (h, p) = (partials.cols(), host(partials));
        let t = partials.rows() / k;
        let mut out = vec![0f32; t * h];
        for (i, o) in out.chunks_mut(h).enumerate() {
            for j in 0..k {
                for (a, v) in o.iter_mut().zip(&p[(i * k + j) * h..(i * k + j + 1) * h]) {
                    *a += v;
                }
            }
        }
        self.tensor(&[t, h], out)
    }
}

/// [`Backend::alloc_host_arena`] on the CPU: plain memory (the slots alias it).
pub(crate) fn arena(bytes: usize) -> Result<HostArena> {
    HostArena::zeroed(bytes).ok_or(BackendError::OutOfMemory { requested: bytes, available: 0 })
}

impl ExpertOps for CpuBackend {
    fn route(&self, logits: &Tensor, k: usize, renorm: bool) -> Result<Routing> {
        let (ids, weights) = fb::route_sorted(host(logits), logits.cols(), k, renorm);
        let t = logits.rows();
        Ok(Routing { ids: self.typed(&[t, k], HostVec::I32(ids))?, weights: self.tensor(&[t, k], weights)? })
    }

    fn alloc_expert_pool(&self, layer: u32, slots: usize, shape: ExpertShape) -> Result<ExpertPool> {
        // Slots alias host experts: the pool itself holds no expert memory.
        let storage = CpuPool((0..slots).map(|_| None).collect());
        Ok(ExpertPool::new(layer, shape, slots, Box::new(storage)))
    }

    fn upload_expert(&self, pool: &mut ExpertPool, slot: usize, expert: HostExpert, _after: Fence) -> Result<Fence> {
        // Ops run as they are called: the slot's readers have run.
        let key = expert.key;
        let cpu =
            pool.storage_mut::<CpuPool>().ok_or_else(|| BackendError::Slot("a pool of another backend".into()))?;
        let at = cpu.0.get_mut(slot).ok_or_else(|| BackendError::Slot(format!("slot {slot} out of the pool")))?;
        *at = Some(expert); // the previous expert's lease ends here
        pool.set_key(slot, key);
        Ok(Fence::DONE)
    }

    fn moe_routed(
        &self,
        x: &Tensor,
        slots: &[i32],
        weights: &Tensor,
        pool: &ExpertPool,
        partials: &mut Tensor,
    ) -> Result<()> {
        self.routed(x, slots, weights, pool, partials)
    }

    fn moe_routed_on_device(
        &self,
        x: &Tensor,
        routing: &Routing,
        slot_of: &Tensor,
        pool: &ExpertPool,
        partials: &mut Tensor,
    ) -> Result<()> {
        // Host memory: the ids are here already, so this is `moe_routed` with each expert's slot.
        let i32s = |t: &Tensor| match self.download(t)? {
            HostVec::I32(v) => Ok(v),
            _ => Err(BackendError::DType { expected: DType::I32, got: t.dtype() }),
        };
        let (ids, map) = (i32s(&routing.ids)?, i32s(slot_of)?);
        let slots: Vec<i32> = ids.iter().map(|&e| map.get(e as usize).copied().unwrap_or(-1)).collect();
        self.routed(x, &slots, &routing.weights, pool, partials)
    }

    fn moe_combine(&self, partials: &Tensor, k: usize) -> Result<Tensor> {
        self.combine(partials, k)
    }
}

#[cfg(test)]
mod tests {
    use osprey_backend::{DType, ExpertKey, ExpertShape, HostMatrix, WeightView};
    use osprey_kernels::{matmul_pair_with, matmul_with, Precision};

    use super::*;

    /// Seeded NVFP4 `rows × cols` (e4m3 scales 2^-4 .. 2).
    #[derive(Debug)]
    struct Nvfp4(usize, usize, Vec<u8>, Vec<u8>);

    impl Nvfp4 {
        fn new(rows: usize, cols: usize, seed: usize) -> Arc<Self> {
            let packed = (0..rows * cols / 2).map(|i| ((i * 131 + seed * 71) % 256) as u8).collect();
            let scales = (0..rows * cols / 16).map(|i| 0x18 + ((i * 7 + seed) % 0x28) as u8).collect();
            Arc::new(Nvfp4(rows, cols, packed, scales))
        }
    }

    impl HostMatrix for Nvfp4 {
        fn rows(&self) -> usize {
            self.0
        }
        fn cols(&self) -> usize {
            self.1
        }
        fn dtype(&self) -> DType {
            DType::Nvfp4
        }
        fn bytes(&self) -> usize {
            self.2.len() + self.3.len()
        }
        fn view(&self) -> WeightView<'_> {
            WeightView::Nvfp4 { packed: &self.2, scales: &self.3, global: 0.75 }
        }
    }

    /// A decode step's wave (8 tokens over 11 experts of 1–3 rows: one expert per pool item, its
    /// matmuls inline on that thread) and a prefill-shaped wave (20 rows on one expert: its GEMMs split
    /// across the pool) give every entry the bits of its expert's rows run through the pooled kernels
    /// from this thread. Mutation-checked: giving the items each other's rows, or scaling an output
    /// row by another entry's weight, fails it.
    #[test]
    fn experts_run_one_per_item_equal_the_pooled_kernels() {
        let b = CpuBackend { precision: Precision::Int8, cap: None };
        let shape = ExpertShape { hidden: 256, inter: 128, dtype: DType::Nvfp4 };
        let (h, f) = (shape.hidden, shape.inter);
        let experts: Vec<[Arc<Nvfp4>; 3]> = (0..16)
            .map(|e| [Nvfp4::new(f, h, 3 * e), Nvfp4::new(f, h, 3 * e + 1), Nvfp4::new(h, f, 3 * e + 2)])
            .collect();
        let mut pool = b.alloc_expert_pool(0, experts.len(), shape).expect("pool");
        for (slot, e) in experts.iter().enumerate() {
            let expert = HostExpert {
                key: ExpertKey { layer: 0, expert: slot as u32 },
                gate: e[0].clone(),
                up: e[1].clone(),
                down: e[2].clone(),
                lease: None,
            };
            b.upload_expert(&mut pool, slot, expert, Fence::DONE).expect("upload");
        }
        let k = 2;
        for (t, ids) in [
            (8usize, vec![0, 1, 2, 3, 0, 4, 5, 6, 7, 0, 8, 9, 10, 1, 2, -1]),
            (20, (0..20).flat_map(|i| [5, if i % 2 == 0 { -1 } else { 9 }]).collect::<Vec<i32>>()),
        ] {
            let x: Vec<f32> = (0..t * h).map(|i| ((i * 37 % 101) as f32 / 50.0 - 1.0) * 0.5).collect();
            let w: Vec<f32> = (0..t * k).map(|i| 0.25 + (i % 7) as f32 / 10.0).collect();
            let xt = b.upload_f32(&x, &[t, h]).expect("x");
            let wt = b.upload_f32(&w, &[t, k]).expect("w");
            let mut partials = b.zeros_f32(&[t * k, h]).expect("partials");
            b.routed(&xt, &ids, &wt, &pool, &mut partials).expect("wave");
            let got = host(&partials);
            let mut want = vec![0f32; t * k * h];
            for (s, e) in experts.iter().enumerate() {
                let entries: Vec<usize> = (0..ids.len()).filter(|&en| ids[en] == s as i32).collect();
                let m = entries.len();
                if m == 0 {
                    continue;
                }
                let xs: Vec<f32> = entries.iter().flat_map(|&en| x[en / k * h..(en / k + 1) * h].to_vec()).collect();
                let (mut g, mut u, mut d) = (vec![0f32; m * f], vec![0f32; m * f], vec![0f32; m * h]);
                matmul_pair_with(&xs, m, (e[0].view(), e[1].view()), f, h, (&mut g, &mut u), Precision::Int8);
                g.iter_mut().zip(&u).for_each(|(a, b)| *a = silu(*a) * b);
                matmul_with(&g, m, e[2].view(), h, f, &mut d, Precision::Int8);
                for (i, &en) in entries.iter().enumerate() {
                    for (o, v) in want[en * h..(en + 1) * h].iter_mut().zip(&d[i * h..(i + 1) * h]) {
                        *o = v * w[en];
                    }
                }
            }
            for en in 0..t * k {
                assert_eq!(&got[en * h..(en + 1) * h], &want[en * h..(en + 1) * h], "t={t} entry {en}");
            }
        }
    }
}
