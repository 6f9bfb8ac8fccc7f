//! Reading experts: the host arena they land in, and one batch of reads straight into it (buffers of
//! their own past it), shared by the manager's misses and the read-ahead thread.

use std::sync::Arc;
use std::time::Instant;

use osprey_models::{ByteSource, ExpertKey, ExpertWeights};
use osprey_protocol::RequestError;

use super::{engine_error, Budget, ResidencyTable};
use crate::arena::{Arena, ArenaSlot};
use crate::buf::AlignedBuf;
use crate::reader::{window, Dest, ReadReq, Reader};
use crate::store::ExpertIndex;

/// The RAM tier's arena: slots of the largest expert's read footprint, as many as the budget holds plus
/// `extra` bytes' worth (the guesses' cap: guesses land in the arena too, in memory faulted in once),
/// never more than there are experts, registered with `reader` when it can be.
pub(super) fn host_tier(
    index: &ExpertIndex,
    (budget, extra): (Budget, usize),
    backend: &dyn osprey_models::backend::Backend,
    reader: &mut dyn Reader,
) -> Option<HostTier> {
    let stride = index.largest_footprint()?;
    let all = index.experts.iter().map(Vec::len).sum();
    let layers = index.experts.iter().filter(|l| !l.is_empty()).count();
    let slots = match budget {
        Budget::PerLayer(n) => n.max(1) * layers,
        Budget::Bytes(b) => (b / stride).max(1),
    };
    let slots = (slots + extra.div_ceil(stride)).min(all);
    let mem = match backend.alloc_host_arena(slots * stride) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, slots, stride, "no host arena for experts; reading into buffers of their own");
            return None;
        }
    };
    let arena = Arena::new(mem, stride);
    // SAFETY: the arena outlives the reader's use of it: both move into the manager thread, where the
    // reader is dropped first (and every slot handle keeps the arena alive besides).
    let registered = unsafe { reader.register(arena.base(), stride, arena.slots()) };
    tracing::info!(slots = arena.slots(), stride, registered, "expert host arena");
    Some(HostTier { arena, registered })
}

/// The arena resident experts are read into, and whether the reader registered it.
#[derive(Debug)]
pub(super) struct HostTier {
    pub(super) arena: Arc<Arena>,
    pub(super) registered: bool,
}

/// Where one expert's reads land: an arena slot (its ranges' windows back to back, at these offsets),
/// or buffers of their own.
enum Landing {
    Slot(ArenaSlot, Vec<usize>),
    Bufs(Vec<AlignedBuf>),
}

/// Reads `experts` of `layer` in one batch straight into arena slots (buffers of their own when the arena
/// is full), inserts them leased; on any failure releases what it inserted.
pub(super) fn read_missing(
    index: &ExpertIndex,
    (reader, tier): (&mut dyn Reader, Option<&HostTier>),
    table: &mut ResidencyTable,
    layer: usize,
    experts: &[ExpertKey],
) -> Result<Vec<Arc<ExpertWeights>>, RequestError> {
    let (read, secs) = read_experts(index, reader, tier, experts);
    let st = &mut table.stats[layer];
    st.read_secs += secs;
    st.batches += 1;
    let mut out = Vec::with_capacity(experts.len());
    let mut first_err = None;
    for (&e, r) in experts.iter().zip(read) {
        match r {
            Ok((w, need)) => {
                table.stats[layer].bytes_read += need as u64;
                out.push((e, table.insert(e, Arc::new(w), need)));
            }
            Err(err) => first_err = first_err.or(Some(err)),
        }
    }
    if let Some(err) = first_err {
        out.iter().for_each(|&(e, _)| table.release(e));
        return Err(engine_error(err));
    }
    Ok(out.into_iter().map(|(_, w)| w).collect())
}

/// Reads the experts `items` names in one batch, into arena slots where `tier`
/// has free ones, else buffers of their own: per item its weights and the bytes it takes, or why not;
/// and the batch's seconds.
#[allow(clippy::type_complexity)]
pub(super) fn read_experts(
    index: &ExpertIndex,
    reader: &mut dyn Reader,
    tier: Option<&HostTier>,
    items: &[ExpertKey],
) -> (Vec<Result<(ExpertWeights, usize), String>>, f64) {
    // SAFETY: `read_experts_with` hands the reader destinations valid as `read_into` requires.
    read_experts_with(index, tier, items, |reqs, dests| unsafe { reader.read_into(reqs, dests) })
}

/// [`read_experts`] with the reads done by `read`, which must fill each destination with its request's
/// aligned window as [`Reader::read_into`] does (the read-ahead thread reads in pieces it can pause).
#[allow(clippy::type_complexity)]
pub(super) fn read_experts_with(
    index: &ExpertIndex,
    tier: Option<&HostTier>,
    items: &[ExpertKey],
    read: impl FnOnce(&[ReadReq], &[Dest]) -> Vec<std::io::Result<usize>>,
) -> (Vec<Result<(ExpertWeights, usize), String>>, f64) {
    let (mut reqs, mut dests, mut landings, mut counts) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for &key in items {
        let r = index.reads(key);
        let windows: Vec<usize> = r.iter().map(|q| window(q.offset, q.len).2).collect();
        let need: usize = windows.iter().sum();
        let slot = tier.filter(|t| need <= t.arena.stride()).and_then(|t| t.arena.take().map(|s| (s, t.registered)));
        let landing = match slot {
            Some((mut slot, registered)) => {
                let (base, fixed) = (slot.as_mut_ptr(), registered.then_some(slot.index() as u16));
                let mut offsets = Vec::with_capacity(windows.len());
                let mut off = 0;
                for &w in &windows {
                    // SAFETY: `off + w <= need <= stride`: inside the slot.
                    dests.push(Dest { ptr: unsafe { base.add(off) }, cap: w, fixed });
                    offsets.push(off);
                    off += w;
                }
                Landing::Slot(slot, offsets)
            }
            None => {
                let mut bufs: Vec<AlignedBuf> = windows.iter().map(|&w| AlignedBuf::new(w)).collect();
                dests.extend(bufs.iter_mut().map(|b| Dest { ptr: b.as_mut_ptr(), cap: b.len(), fixed: None }));
                Landing::Bufs(bufs)
            }
        };
        counts.push((r.len(), need));
        reqs.extend(r);
        landings.push(landing);
    }
    let t0 = Instant::now();
    // Every destination is a slot or buffer owned by `landings`, each window inside its own, untouched by
    // anyone else until the reads complete.
    let results = read(&reqs, &dests);
    let secs = t0.elapsed().as_secs_f64();
    let mut results = results.into_iter();
    let mut out = Vec::with_capacity(items.len());
    for ((&key, (n, need)), landing) in items.iter().zip(counts).zip(landings) {
        let ats: Result<Vec<usize>, _> = (&mut results).take(n).collect();
        out.push(match ats {
            Ok(ats) => {
                let parts: Vec<(Arc<dyn ByteSource>, usize)> = match landing {
                    Landing::Slot(slot, offsets) => {
                        let buf: Arc<dyn ByteSource> = Arc::new(slot);
                        offsets.into_iter().zip(ats).map(|(o, at)| (buf.clone(), o + at)).collect()
                    }
                    Landing::Bufs(bufs) => {
                        bufs.into_iter().zip(ats).map(|(b, at)| (Arc::new(b) as Arc<dyn ByteSource>, at)).collect()
                    }
                };
                Ok((index.assemble_parts(key, parts), need))
            }
            Err(err) => Err(err.to_string()),
        });
    }
    (out, secs)
}
