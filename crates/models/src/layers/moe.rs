//! Sparse MoE block (Qwen3.5-MoE `mlp`): softmax router → top-k → renormalised weights → routed experts,
//! plus a shared expert scaled by `sigmoid(shared_expert_gate(x))`.
//!
//! Routed experts are reached only through [`ExpertSource`], one expert at a time, never stacked into one
//! tensor: the residency manager (`osprey-experts`) implements it to stream experts from disk. All experts
//! a layer needs for a step are asked for in one `request`, so an implementation can batch its misses, and
//! the shared expert and the already-resident experts are computed while the misses are read.

use std::fmt::Debug;
use std::sync::{Arc, Mutex};

use osprey_backend::{Backend, BackendError, DType, ExpertKey, ExpertPool, ExpertShape, HostExpert, HostVec, Tensor};

use super::load_linear;
use super::mlp::Mlp;
use super::predict::{Ahead, ExpertPredictor};
use super::slots::SlotTable;
use crate::checkpoint::{Checkpoint, Weight};
use crate::config::MoeConfig;
use crate::error::{Error, Result};
use osprey_protocol::runner::ExpertSlots;

/// The three projections of one routed expert.
#[derive(Clone, Debug)]
pub struct ExpertWeights {
    /// `[inter, hidden]`.
    pub gate: Weight,
    /// `[inter, hidden]`.
    pub up: Weight,
    /// `[hidden, inter]`.
    pub down: Weight,
}

/// A held expert: the weights stay valid (and, for a residency manager, resident) until it is dropped.
#[derive(Debug)]
pub struct ExpertHandle {
    key: ExpertKey,
    weights: Arc<ExpertWeights>,
    /// Whatever the source needs to release on drop (a lease); `None` for always-resident experts.
    _lease: Option<Box<dyn Debug + Send + Sync>>,
}

impl ExpertHandle {
    /// Wraps the weights of expert `key` with an optional release guard.
    pub fn new(key: ExpertKey, weights: Arc<ExpertWeights>, lease: Option<Box<dyn Debug + Send + Sync>>) -> Self {
        ExpertHandle { key, weights, _lease: lease }
    }

    /// Which expert.
    pub fn key(&self) -> ExpertKey {
        self.key
    }

    /// The expert's weights.
    pub fn weights(&self) -> &ExpertWeights {
        &self.weights
    }

    /// The host expert a backend uploads into a slot; the handle (and so its lease) goes with it.
    pub fn into_host(self) -> HostExpert {
        let w = self.weights.clone();
        HostExpert {
            key: self.key,
            gate: Arc::new(w.gate.clone()),
            up: Arc::new(w.up.clone()),
            down: Arc::new(w.down.clone()),
            lease: Some(Box::new(self)),
        }
    }
}

/// The experts of a request still being read: `wait` returns them in request order, skipping those
/// [`ExpertTicket::resident`] already gave.
pub struct PendingExperts(Box<dyn FnOnce() -> Result<Vec<ExpertHandle>> + Send>);

impl Debug for PendingExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PendingExperts")
    }
}

impl PendingExperts {
    /// Nothing pending.
    pub fn none() -> Self {
        PendingExperts(Box::new(|| Ok(Vec::new())))
    }

    /// Pending experts produced by `f` (blocks until the reads land).
    pub fn new(f: impl FnOnce() -> Result<Vec<ExpertHandle>> + Send + 'static) -> Self {
        PendingExperts(Box::new(f))
    }

    /// Blocks until the missing experts are read.
    pub fn wait(self) -> Result<Vec<ExpertHandle>> {
        (self.0)()
    }
}

type Resident = Result<(Vec<Option<ExpertHandle>>, PendingExperts)>;

/// Experts on their way, in two steps so the caller can work on the resident ones while the misses are
/// read: [`resident`](Self::resident) answers as soon as the source has looked its table up (no I/O).
pub struct ExpertTicket(Box<dyn FnOnce() -> Resident + Send>);

impl Debug for ExpertTicket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ExpertTicket")
    }
}

impl ExpertTicket {
    /// Every expert already available.
    pub fn ready(r: Result<Vec<ExpertHandle>>) -> Self {
        ExpertTicket(Box::new(move || Ok((r?.into_iter().map(Some).collect(), PendingExperts::none()))))
    }

    /// `f` returns, per requested expert, the handle if it is resident (`None` if it is being read), and
    /// the pending rest.
    pub fn new(f: impl FnOnce() -> Resident + Send + 'static) -> Self {
        ExpertTicket(Box::new(f))
    }

    /// The resident experts now, and the missing ones to wait for.
    pub fn resident(self) -> Resident {
        (self.0)()
    }

    /// Blocks until every expert is available (request order).
    pub fn wait(self) -> Result<Vec<ExpertHandle>> {
        let (mut have, pending) = self.resident()?;
        let mut rest = pending.wait()?.into_iter();
        have.iter_mut()
            .map(|h| {
                h.take()
                    .or_else(|| rest.next())
                    .ok_or_else(|| crate::error::Error::Engine("an expert source returned too few experts".into()))
            })
            .collect()
    }
}

/// One MoE layer's step as its expert source sees it: every expert the step routes to, by where it is.
#[derive(Clone, Copy, Debug)]
pub struct LayerStep<'a> {
    /// Experts to fetch (in no backend slot), ascending; handles come back in this order.
    pub need: &'a [ExpertKey],
    /// Experts the step found in the backend's slots, ascending: a source that counts uses (the
    /// residency manager's hit rate and recency) records them; nothing is leased.
    pub in_slots: &'a [ExpertKey],
}

/// A guess at a later layer's experts (most wanted first).
#[derive(Clone, Copy, Debug)]
pub struct Guess<'a> {
    /// Experts to read ahead: a source with a slower tier may start reading them; it must never change
    /// what [`ExpertSource::request`] returns.
    pub read: &'a [ExpertKey],
    /// Per expert of `read`, the measured chance that its layer routes to it
    /// ([`crate::layers::predict::Calibrated`]): a source reads the guesses above its break-even (the
    /// cost of a wrong read against the time a right one saves, on its tier).
    pub confidence: &'a [f32],
    /// Experts to hand back, leased, if held in RAM now (a device backend uploads them into slots ahead of
    /// their layer); nothing is read for them and no access is counted.
    pub lease: &'a [ExpertKey],
}

/// Where routed experts come from: two calls per MoE layer and step, both keyed by [`ExpertKey`].
pub trait ExpertSource: Debug + Send + Sync {
    /// One layer's step: starts fetching `step.need` and counts `step.in_slots`. Called once per layer
    /// per step, so misses can be read in one batch while the caller computes the shared expert. With
    /// nothing needed the caller may drop the ticket unread.
    fn request(&self, step: LayerStep<'_>) -> ExpertTicket;

    /// A guess for a later layer; the answer is the experts of `guess.lease` held now, leased, in the
    /// order asked (it may come later: it is waited for once the caller's own step is done). The default
    /// reads nothing ahead and holds none.
    fn guess(&self, _guess: Guess<'_>) -> PendingExperts {
        PendingExperts::none()
    }

    /// Expert slots per layer this source's budget allows on the backend (`None`: one per expert). On
    /// the CPU a slot is the source's expert itself, lease included, so a streaming source bounds them
    /// by its RAM budget.
    fn slots_per_layer(&self) -> Option<usize> {
        None
    }

    /// Bytes of one expert's weights, when the source knows them (benchmarks).
    fn expert_bytes(&self) -> Option<usize> {
        None
    }
}

/// Every expert mapped from the checkpoint (the page cache decides what is in RAM).
#[derive(Debug)]
pub struct ResidentExperts {
    /// `[layer][expert]`; layers without experts are empty.
    experts: Vec<Vec<Arc<ExpertWeights>>>,
}

impl ResidentExperts {
    /// Loads the experts of the given MoE layers from either layout: the Hub layout
    /// (`{prefix}.experts.{e}.{gate,up,down}_proj.weight`) or the fused runtime layout
    /// (`{prefix}.experts.gate_up_proj [E, 2I, H]` with gate rows first, `{prefix}.experts.down_proj [E, H, I]`).
    pub fn load(ck: &Checkpoint, layer_prefixes: &[Option<String>], hidden: usize, m: MoeConfig) -> Result<Self> {
        let (e_n, inter) = (m.num_experts, m.intermediate);
        let mut experts = Vec::with_capacity(layer_prefixes.len());
        for prefix in layer_prefixes {
            let Some(p) = prefix else {
                experts.push(Vec::new());
                continue;
            };
            let fused = format!("{p}.experts.gate_up_proj");
            let layer: Vec<Arc<ExpertWeights>> = if ck.contains(&fused) {
                let gu_shape = [e_n, 2 * inter, hidden];
                let down = format!("{p}.experts.down_proj");
                let d_shape = [e_n, hidden, inter];
                (0..e_n)
                    .map(|e| {
                        Ok(Arc::new(ExpertWeights {
                            gate: ck.weight_rows(&fused, &gu_shape, e * 2 * inter, inter, hidden)?,
                            up: ck.weight_rows(&fused, &gu_shape, e * 2 * inter + inter, inter, hidden)?,
                            down: ck.weight_rows(&down, &d_shape, e * hidden, hidden, inter)?,
                        }))
                    })
                    .collect::<Result<_>>()?
            } else {
                (0..e_n)
                    .map(|e| {
                        let w = |n: &str, out: usize, inp: usize| ck.linear(&format!("{p}.experts.{e}.{n}"), out, inp);
                        Ok(Arc::new(ExpertWeights {
                            gate: w("gate_proj", inter, hidden)?,
                            up: w("up_proj", inter, hidden)?,
                            down: w("down_proj", hidden, inter)?,
                        }))
                    })
                    .collect::<Result<_>>()?
            };
            experts.push(layer);
        }
        Ok(ResidentExperts { experts })
    }
}

impl ExpertSource for ResidentExperts {
    fn expert_bytes(&self) -> Option<usize> {
        let w = self.experts.iter().find_map(|l| l.first())?;
        Some(w.gate.bytes() + w.up.bytes() + w.down.bytes())
    }

    fn request(&self, step: LayerStep<'_>) -> ExpertTicket {
        ExpertTicket::ready(Ok(self.handles(step.need)))
    }

    fn guess(&self, guess: Guess<'_>) -> PendingExperts {
        let handles = self.handles(guess.lease);
        PendingExperts::new(move || Ok(handles))
    }
}

impl ResidentExperts {
    fn handles(&self, keys: &[ExpertKey]) -> Vec<ExpertHandle> {
        keys.iter().map(|&k| ExpertHandle::new(k, self.experts[k.layer()][k.expert()].clone(), None)).collect()
    }
}

/// The stored type of the routed experts under `{prefix}` (expert 0's gate, in either layout).
pub fn expert_dtype(ck: &Checkpoint, prefix: &str, hidden: usize, m: MoeConfig) -> Result<DType> {
    let fused = format!("{prefix}.experts.gate_up_proj");
    let w = if ck.contains(&fused) {
        ck.weight_rows(&fused, &[m.num_experts, 2 * m.intermediate, hidden], 0, m.intermediate, hidden)?
    } else {
        ck.linear(&format!("{prefix}.experts.0.gate_proj"), m.intermediate, hidden)?
    };
    Ok(w.dtype())
}

/// A layer's pool on the backend and its slot table (allocated at the first step, or at the first guess
/// the block before uploads into it).
#[derive(Debug, Default)]
struct Slots {
    pool: Option<ExpertPool>,
    table: Option<SlotTable>,
    /// Each expert's slot on the backend (`[experts]` i32), for routing that stays on the device; made
    /// again after the slots change.
    slot_of: Option<Tensor>,
}

/// A layer's expert slots, shared with the block before it when that one uploads its guesses here.
#[derive(Debug)]
struct LayerSlots {
    layer: usize,
    shape: ExpertShape,
    experts: usize,
    /// Slots per layer (`None`: the expert source's, else one per expert).
    per_layer: Option<usize>,
    inner: Mutex<Slots>,
}

impl LayerSlots {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slots> {
        self.inner.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The pool and table in `slots` (this layer's, locked), allocated on `b` if this is their first use.
    fn ready<'a>(
        &self,
        slots: &'a mut Slots,
        b: &dyn Backend,
        source: &dyn ExpertSource,
    ) -> Result<(&'a mut ExpertPool, &'a mut SlotTable)> {
        let Slots { pool, table, slot_of } = slots;
        // The caller may change the slots: the device's map is made again when next needed.
        *slot_of = None;
        let pool = match pool {
            Some(p) => p,
            None => pool.insert(b.alloc_expert_pool(self.layer as u32, self.count(source), self.shape)?),
        };
        let table = table.get_or_insert_with(|| SlotTable::new(pool.slots()));
        Ok((pool, table))
    }

    /// Slots in the pool.
    fn count(&self, source: &dyn ExpertSource) -> usize {
        self.per_layer.or_else(|| source.slots_per_layer()).unwrap_or(self.experts).clamp(1, self.experts)
    }

    /// The guess's first experts that fit in the pool (most wanted first), and of those, the ones of this
    /// layer no slot holds yet: those to ask the source for, leased if it holds them in RAM, and upload
    /// once the asking block's own step is done ([`Self::upload_guesses`]).
    fn to_lease(
        &self,
        source: &dyn ExpertSource,
        guess: &[ExpertKey],
        confidence: &[f32],
    ) -> (Vec<ExpertKey>, Vec<ExpertKey>) {
        let guess = &guess[..guess.len().min(self.count(source))];
        let slots = self.lock();
        let in_slot = |k: ExpertKey| slots.table.as_ref().is_some_and(|t| t.contains(k));
        // A wrong upload costs the slot it takes: the expert it evicts is uploaded again at its next use,
        // which comes at about the layer's slot hit rate `h`; a right one saves an upload on the step's
        // critical path. The copy itself runs beside the compute. Break-even: precision h / (1 + h).
        let h = slots.table.as_ref().map_or(0.0, |t| t.counters().hit_rate()) as f32;
        let break_even = h / (1.0 + h);
        let sure = |i: usize| confidence.get(i).is_none_or(|&p| p > break_even);
        let lease = guess
            .iter()
            .enumerate()
            .filter(|&(i, &k)| k.layer() == self.layer && k.expert() < self.experts && !in_slot(k) && sure(i));
        (guess.to_vec(), lease.map(|(_, &k)| k).collect())
    }

    /// Uploads guessed experts (most wanted first) into this layer's slots ahead of its step: free slots,
    /// else the least recently used ones, never a slot holding an expert of `guess` nor one whose guess
    /// still waits for its step ([`SlotTable::assign_guesses`]); the guesses that find no slot are given
    /// back.
    fn upload_guesses(
        &self,
        b: &dyn Backend,
        source: &dyn ExpertSource,
        guess: &[ExpertKey],
        held: Vec<ExpertHandle>,
    ) -> Result<()> {
        let mut guard = self.lock();
        let (pool, table) = self.ready(&mut guard, b, source)?;
        let mut seen = std::collections::BTreeSet::new();
        let fresh: Vec<ExpertHandle> =
            held.into_iter().filter(|h| !table.contains(h.key()) && seen.insert(h.key())).collect();
        let keys: Vec<ExpertKey> = fresh.iter().map(ExpertHandle::key).collect();
        let slots = table.assign_guesses(&keys, guess);
        for (handle, slot) in fresh.into_iter().zip(slots) {
            upload(b, (pool, table), slot, handle)?;
        }
        Ok(())
    }
}

/// Uploads an expert into `slot` of `pool`, ordered after the slot's last reader (on a device, by the
/// copy stream, not the host). Until a wave reads it, the slot's last use is this copy, which a later
/// copy into the slot follows in the copy stream's order (the backend keeps the host expert until its
/// copy is done).
fn upload(
    b: &dyn Backend,
    (pool, table): (&mut ExpertPool, &mut SlotTable),
    slot: usize,
    e: ExpertHandle,
) -> Result<()> {
    let copied = b.upload_expert(pool, slot, e.into_host(), table.reader(slot))?;
    table.read(slot, copied);
    Ok(())
}

/// A guess for a layer's slots, waiting for the source's answer: which of its experts the source holds.
struct HeldGuess {
    slots: Arc<LayerSlots>,
    guess: Vec<ExpertKey>,
    held: PendingExperts,
}

/// Reading the next MoE layers' experts ahead (see [`crate::layers::predict`]): the policy, the next
/// blocks' layers and routers, nearest first (`depth` of them, wrapping around to the first block at the
/// next step; none for a model with one block), and the next block's slots when guesses are uploaded into
/// them.
#[derive(Debug)]
struct ReadAhead {
    predictor: Arc<dyn ExpertPredictor>,
    next: Vec<(usize, Arc<Tensor>)>,
    next_slots: Option<Arc<LayerSlots>>,
}

/// The most rows a step may have for its routing to stay on the device: one 16-row tile per expert. The
/// grouped GEMM's grid is sized by the most rows a group may have, which without reading the routing
/// back is the step's rows; a prefill chunk routes on the host (one readback per layer and chunk) until
/// the expert kernels take their tiles from the device (the next CUDA issue).
pub const DEVICE_ROUTED_ROWS: usize = 16;

/// One MoE block.
#[derive(Debug)]
pub struct SparseMoe {
    layer: usize,
    router: Arc<Tensor>,
    shared: Mlp,
    shared_gate: Tensor,
    cfg: MoeConfig,
    slots: Arc<LayerSlots>,
    ahead: Option<ReadAhead>,
}

impl SparseMoe {
    /// Loads the router and shared expert of `{prefix}` onto `b` (routed experts come from an
    /// [`ExpertSource`] and are uploaded into the layer's slots when a step needs them); `dtype` is the
    /// routed experts' weight type, `slots` the slots per layer (`None`: see [`ExpertSource::slots_per_layer`]).
    #[allow(clippy::too_many_arguments)]
    pub fn load(
        b: &dyn Backend,
        ck: &Checkpoint,
        prefix: &str,
        layer: usize,
        hidden: usize,
        cfg: MoeConfig,
        dtype: DType,
        slots: Option<usize>,
    ) -> Result<Self> {
        Ok(SparseMoe {
            layer,
            router: Arc::new(load_linear(b, ck, &format!("{prefix}.gate"), cfg.num_experts, hidden)?),
            shared: Mlp::load(b, ck, &format!("{prefix}.shared_expert"), hidden, cfg.shared_intermediate)?,
            shared_gate: load_linear(b, ck, &format!("{prefix}.shared_expert_gate"), 1, hidden)?,
            cfg,
            slots: Arc::new(LayerSlots {
                layer,
                shape: ExpertShape { hidden, inter: cfg.intermediate, dtype },
                experts: cfg.num_experts,
                per_layer: slots,
                inner: Mutex::new(Slots::default()),
            }),
            ahead: None,
        })
    }

    /// Has each block report its routing to `predictor` and guess the next `depth` blocks' experts with it
    /// (1: the next block only; the last blocks guess the first ones' at the next step, so the first
    /// layers' reads overlap too). With `upload`, a block also uploads the guessed experts its source holds
    /// in RAM into the next block's slots once its own step is done (a device backend: the copies overlap
    /// the compute up to the next block's routing). `None`: no read-ahead.
    pub fn read_ahead(
        blocks: &mut [&mut SparseMoe],
        predictor: Option<Arc<dyn ExpertPredictor>>,
        upload: bool,
        depth: usize,
    ) {
        let Some(predictor) = predictor else { return };
        let n = blocks.len();
        // A block never guesses for itself: at most the other n - 1 (none in a model with one block).
        let depth = depth.max(1).min(n.saturating_sub(1));
        for i in 0..n {
            let next: Vec<(usize, Arc<Tensor>)> =
                (1..=depth).map(|d| (blocks[(i + d) % n].layer, blocks[(i + d) % n].router.clone())).collect();
            let next_slots = (depth > 0 && upload).then(|| blocks[(i + 1) % n].slots.clone());
            blocks[i].ahead = Some(ReadAhead { predictor: predictor.clone(), next, next_slots });
        }
    }

    /// Whether the routing may stay on the device: a device backend, a slot for every expert of the layer,
    /// no read-ahead (its predictor learns from the routing on the host), and a decode-shaped step of at
    /// most [`DEVICE_ROUTED_ROWS`] rows.
    fn routes_on_device(&self, b: &dyn Backend, experts: &dyn ExpertSource, rows: usize) -> bool {
        b.device() != osprey_backend::Device::Cpu
            && rows <= DEVICE_ROUTED_ROWS
            && self.ahead.is_none()
            && self.slots.count(experts) == self.cfg.num_experts
    }

    /// The layer's step with every expert in a slot (issue 51): the first step uploads the experts not in
    /// a slot yet (all of them, once); from then on the router's ids feed the grouped expert kernels on
    /// the device (`moe_routed_on_device`), so a decode token reads no routing back and uploads nothing.
    /// The slot table's hits are not counted per expert here (the ids never reach the host); its waves
    /// are.
    fn forward_on_device(
        &self,
        b: &dyn Backend,
        x: &Tensor,
        (routing, sgate): (&osprey_backend::Routing, &Tensor),
        experts: &dyn ExpertSource,
    ) -> Result<Tensor> {
        let (t, k, h) = (x.rows(), self.cfg.top_k, x.cols());
        let mut guard = self.slots.lock();
        let slot_of = match guard.slot_of.take() {
            Some(m) => m,
            None => {
                let (pool, table) = self.slots.ready(&mut guard, b, experts)?;
                self.fill(b, (pool, table), experts)?;
                let held = table.resident();
                let map: Vec<i32> = (0..self.cfg.num_experts)
                    .map(|e| held.get(&ExpertKey::new(self.layer, e)).map_or(-1, |&s| s as i32))
                    .collect();
                b.upload(osprey_backend::HostData::I32(&map), &[map.len()])?
            }
        };
        let shared = self.shared.forward(b, x)?;
        let mut partials = b.zeros_f32(&[t * k, h])?;
        let Slots { pool: Some(pool), table: Some(table), .. } = &mut *guard else {
            return Err(Error::Engine("a layer's slots were not allocated before its step".into()));
        };
        b.moe_routed_on_device(x, routing, &slot_of, pool, &mut partials)?;
        let fence = b.record_fence();
        (0..table.slots()).for_each(|s| table.read(s, fence));
        table.stats.waves += 1;
        guard.slot_of = Some(slot_of);
        drop(guard);
        Ok(b.moe_combine_shared(&partials, k, &shared, sgate)?)
    }

    /// Uploads every expert of the layer that no slot holds yet (one request, then one wave: the pool has
    /// a slot per expert).
    fn fill(
        &self,
        b: &dyn Backend,
        (pool, table): (&mut ExpertPool, &mut SlotTable),
        experts: &dyn ExpertSource,
    ) -> Result<()> {
        let all: Vec<ExpertKey> = (0..self.cfg.num_experts).map(|e| ExpertKey::new(self.layer, e)).collect();
        let (hits, misses) = table.lookup(&all);
        if misses.is_empty() {
            return Ok(());
        }
        let in_slots: Vec<ExpertKey> = hits.iter().map(|&(k, _)| k).collect();
        let handles = experts.request(LayerStep { need: &misses, in_slots: &in_slots }).wait()?;
        let keys: Vec<ExpertKey> = handles.iter().map(ExpertHandle::key).collect();
        let slots = table.assign(&keys);
        for (handle, slot) in handles.into_iter().zip(slots) {
            upload(b, (pool, table), slot, handle)?;
        }
        Ok(())
    }

    /// `x [T, hidden]` (already normed) → `[T, hidden]`.
    ///
    /// Per step: route on the backend and download the expert ids (the layer's one routing sync), each
    /// an [`ExpertKey`] from here to the disk read and the slot; look the touched experts up in the slot
    /// table; tell the source the step (one request: the misses to fetch, so a disk-backed source reads
    /// them in one batch, and the hits to count) and compute the shared expert and the hits while they
    /// are read; then upload the misses into slots in waves of at most the pool's size, each wave one
    /// `moe_routed`; finally sum every token's expert outputs in ascending expert id (`moe_combine`), so
    /// the answer does not depend on what was resident.
    pub fn forward(&self, b: &dyn Backend, x: &Tensor, experts: &dyn ExpertSource) -> Result<Tensor> {
        let (t, k, h) = (x.rows(), self.cfg.top_k, x.cols());
        // The router's logits and the shared expert's gate: one pass over x on a device.
        let [logits, sgate] = super::linears(b, x, [&self.router, &self.shared_gate])?;
        let routing = b.route(&logits, k, self.cfg.renorm)?;
        if self.routes_on_device(b, experts, t) {
            return self.forward_on_device(b, x, (&routing, &sgate), experts);
        }
        let ids = match b.download(&routing.ids)? {
            HostVec::I32(v) => v,
            _ => return Err(BackendError::DType { expected: DType::I32, got: routing.ids.dtype() }.into()),
        };
        // `[T, k]`: each token's experts, as keys from here on.
        let keys: Vec<ExpertKey> = ids.iter().map(|&e| ExpertKey::new(self.layer, e as usize)).collect();
        let mut touched = keys.clone();
        touched.sort_unstable();
        touched.dedup();
        if let Some(a) = &self.ahead {
            a.predictor.observe(self.layer, &touched);
        }

        let mut guard = self.slots.lock();
        let (pool, table) = self.slots.ready(&mut guard, b, experts)?;
        let (hits, misses) = table.lookup(&touched);
        let in_slots: Vec<ExpertKey> = hits.iter().map(|&(k, _)| k).collect();
        let ticket = experts.request(LayerStep { need: &misses, in_slots: &in_slots });
        // With nothing to fetch the ticket is dropped unread: the step was counted when it was sent.
        let (resident, pending) =
            if misses.is_empty() { (Vec::new(), PendingExperts::none()) } else { ticket.resident()? };
        // The guess goes out after this layer's own request, so its reads queue behind the misses.
        let held = self.guess_ahead(b, x, experts)?;

        let shared = self.shared.forward(b, x)?;
        let mut partials = b.zeros_f32(&[t * k, h])?;
        let run = |wave: &[(ExpertKey, usize)], table: &mut SlotTable, pool: &ExpertPool, partials: &mut Tensor| {
            let slot_of: std::collections::HashMap<ExpertKey, usize> = wave.iter().copied().collect();
            let slot_ids: Vec<i32> = keys.iter().map(|e| slot_of.get(e).map_or(-1, |&s| s as i32)).collect();
            b.moe_routed(x, &slot_ids, &routing.weights, pool, partials)?;
            let fence = b.record_fence();
            for &(_, s) in wave {
                table.read(s, fence);
            }
            table.stats.waves += 1;
            Ok::<(), Error>(())
        };
        if !hits.is_empty() {
            run(&hits, table, pool, &mut partials)?;
        }
        // Misses: those the source had in RAM first (no wait), then those read from disk.
        let mut ready: Vec<ExpertHandle> = resident.into_iter().flatten().collect();
        let mut pending = Some(pending);
        let mut uploaded = 0;
        while uploaded < misses.len() {
            if ready.is_empty() {
                ready = pending.take().map(PendingExperts::wait).transpose()?.unwrap_or_default();
                if ready.is_empty() {
                    return Err(Error::Engine("an expert source returned too few experts".into()));
                }
            }
            let wave_handles: Vec<ExpertHandle> = ready.drain(..ready.len().min(table.slots())).collect();
            uploaded += wave_handles.len();
            let wave_keys: Vec<ExpertKey> = wave_handles.iter().map(ExpertHandle::key).collect();
            let slots = table.assign(&wave_keys);
            for (handle, &slot) in wave_handles.into_iter().zip(&slots) {
                upload(b, (pool, table), slot, handle)?;
            }
            let wave: Vec<(ExpertKey, usize)> = wave_keys.into_iter().zip(slots).collect();
            run(&wave, table, pool, &mut partials)?;
        }
        let out = b.moe_combine_shared(&partials, k, &shared, &sgate)?;
        drop(guard);
        if let Some(HeldGuess { slots, guess, held }) = held {
            slots.upload_guesses(b, experts, &guess, held.wait()?)?;
        }
        Ok(out)
    }

    /// Guesses the next blocks' experts from this block's input `x` and asks `experts` to read them ahead
    /// (nearest first, so their reads queue in that order); with uploads into the next block's slots, the
    /// nearest guess also asks which of its experts the source holds in RAM (uploaded once this step is
    /// done).
    fn guess_ahead(&self, b: &dyn Backend, x: &Tensor, experts: &dyn ExpertSource) -> Result<Option<HeldGuess>> {
        let Some(ReadAhead { predictor, next, next_slots }) = &self.ahead else { return Ok(None) };
        let mut held = None;
        for (d, (next, router)) in next.iter().enumerate() {
            let ahead = Ahead::new(b, (self.layer, *next), self.cfg.top_k, x, router).at_distance(d + 1);
            let (guess, confidence): (Vec<ExpertKey>, Vec<f32>) = predictor.predict_scored(&ahead)?.into_iter().unzip();
            if guess.is_empty() {
                continue;
            }
            let slots = next_slots.as_ref().filter(|_| d == 0);
            let (fits, lease) = slots.map(|s| s.to_lease(experts, &guess, &confidence)).unwrap_or_default();
            let answer = experts.guess(Guess { read: &guess, confidence: &confidence, lease: &lease });
            if let (false, Some(slots)) = (lease.is_empty(), slots) {
                held = Some(HeldGuess { slots: slots.clone(), guess: fits, held: answer });
            }
        }
        Ok(held)
    }

    /// Bytes of the dense part (router + shared expert).
    pub fn bytes(&self) -> usize {
        self.router.bytes() + self.shared.bytes() + self.shared_gate.bytes()
    }

    /// This layer's slot counters (zero before its first step).
    pub fn slot_stats(&self) -> ExpertSlots {
        self.slots.lock().table.as_ref().map(|t| t.counters()).unwrap_or_default()
    }
}
