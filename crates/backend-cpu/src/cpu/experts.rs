//! Routed experts on the CPU backend. A slot is the host expert itself (no copy): the pool keeps the
//! [`HostExpert`], lease included, until the slot is reused, so what a slot reads stays valid and counted
//! by the residency manager. The computation is the one the MoE block did before slots, in the same
//! order: each expert on all of its wave's tokens at once, weighted outputs summed per token from zero in
//! ascending expert id, so answers are the same bits whatever was resident.

use osprey_backend::{ExpertPool, HostExpert};

use super::*;

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
        for (slot, entries) in by_slot {
            let e = cpu.0.get(slot).and_then(Option::as_ref).ok_or_else(|| {
                BackendError::Slot(format!("slot {slot} of layer {}'s pool read while empty", pool.layer))
            })?;
            let rows: Vec<usize> = entries.iter().map(|&en| en / k).collect();
            let xs = self.gather_rows(x, &rows)?;
            let (gate, up, down) = (
                self.place_weight(e.gate.clone())?,
                self.place_weight(e.up.clone())?,
                self.place_weight(e.down.clone())?,
            );
            let (mut g, u) = self.linear_pair(&xs, &gate, &up)?;
            self.silu_mul(&mut g, &u);
            let d = self.linear(&g, &down)?;
            let (d, out) = (host(&d), host_mut(partials));
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
