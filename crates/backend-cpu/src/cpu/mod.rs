//! The CPU backend: host memory and `osprey-kernels`. Activations and states are `Vec<f32>`; a placed
//! weight is the host matrix itself (mapped from the checkpoint or the expert cache: placing copies
//! nothing). Every op calls the kernel the layers called before the seam, in the same order, so answers
//! are bit-identical to the pre-seam engine.
//!
//! One file per group of the seam's table (`osprey_backend::ops`): `memory.rs` (memory and fences),
//! `core.rs`, `attention.rs`, `recurrent.rs`, `experts.rs` (the router and expert slots) and
//! `qwen4.rs`; this file holds the tensors' storage and what identifies the backend.

mod attention;
mod core;
mod experts;
mod memory;
mod qwen4;
mod recurrent;

use std::borrow::Cow;
use std::ops::Range;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use osprey_backend::sampling;
use osprey_backend::{
    AttentionOps, AttnShape, Backend, BackendError, BackendRef, CoreOps, DType, Device, ExpertOps, ExpertShape, Fence,
    GdnShape, HostArena, HostData, HostMatrix, HostVec, MRope, MemoryOps, Op, PagedView, Precision, Qwen4Ops,
    RecurrentOps, Result, RopeTable, Routing, RowSampling, Storage, Tensor,
};
use osprey_kernels::attention::{bidirectional_attention, causal_attention_paged, PagedKv};
use osprey_kernels::attention_bf16::bidirectional_attention_fast;
use osprey_kernels::gdn::{causal_conv_silu, gated_delta_chunked, gated_delta_recurrent, DeltaInputs};
use osprey_kernels::norm::{l2_norm, layer_norm, rms_norm, rms_norm_1p, rms_norm_gated};
use osprey_kernels::q8::Isa;
use osprey_kernels::rope::rotate_half_pairs;
use osprey_kernels::{gelu_erf, gelu_tanh, matmul_pair_with, matmul_with, sigmoid, silu, softplus, WeightRows};

use crate::host as fb;

/// What a CPU tensor holds.
#[derive(Debug)]
pub enum CpuStorage {
    /// Typed host elements (f32 activations, states, norms and KV pages; bf16 KV; i32 slot and page
    /// ids; bytes), what they are charged to the memory cap (given back on drop), and the thread that
    /// made them.
    Data(HostVec, Meta),
    /// A placed weight: the host matrix, not copied (mapped memory is not charged).
    Matrix(Arc<dyn HostMatrix>),
}

/// Who a CPU tensor belongs to: its memory-cap charge and the thread that made it. The execution
/// contract (the trait's docs) gives each thread its own tensors; writes check it in debug builds, so a
/// tensor written by a thread that did not make it (the vision thread's activations on the runner's
/// queue, say) is caught by the tests. Weights and tensors only read are shared freely.
#[derive(Debug)]
pub struct Meta {
    charge: Option<Charge>,
    owner: std::thread::ThreadId,
}

impl Meta {
    fn new(charge: Option<Charge>) -> Self {
        Meta { charge, owner: std::thread::current().id() }
    }
}

/// Bytes of a tensor charged to a [`CpuBackend`]'s memory cap until the tensor drops.
#[derive(Debug)]
pub struct Charge {
    cap: Arc<MemoryCap>,
    bytes: usize,
}

impl Drop for Charge {
    fn drop(&mut self) {
        self.cap.live.fetch_sub(self.bytes, Ordering::Relaxed);
    }
}

/// A cap on the bytes of live tensors (`CpuBackend::with_memory_cap`): the CPU's stand-in for a
/// device's memory, so the path a device's out-of-memory takes is tested here.
#[derive(Debug)]
pub struct MemoryCap {
    cap: usize,
    live: AtomicUsize,
}

impl MemoryCap {
    /// Charges `bytes`, or refuses when the cap would be passed.
    fn charge(self: &Arc<Self>, bytes: usize) -> Result<Charge> {
        let live = self.live.fetch_add(bytes, Ordering::Relaxed);
        if live + bytes > self.cap {
            self.live.fetch_sub(bytes, Ordering::Relaxed);
            return Err(BackendError::OutOfMemory { requested: bytes, available: self.cap.saturating_sub(live) });
        }
        Ok(Charge { cap: self.clone(), bytes })
    }

    /// Bytes of live tensors.
    pub fn live(&self) -> usize {
        self.live.load(Ordering::Relaxed)
    }
}

impl Storage for CpuStorage {
    fn bytes(&self) -> usize {
        match self {
            CpuStorage::Data(v, _) => v.bytes(),
            CpuStorage::Matrix(m) => m.bytes(),
        }
    }

    fn clone_storage(&self) -> Box<dyn Storage> {
        Box::new(match self {
            // A clone is charged like the original (over the cap only by what is already live: a copy
            // of a tensor in use is never the allocation that matters).
            CpuStorage::Data(v, meta) => {
                let charge = meta.charge.as_ref().map(|c| {
                    c.cap.live.fetch_add(c.bytes, Ordering::Relaxed);
                    Charge { cap: c.cap.clone(), bytes: c.bytes }
                });
                // The copy belongs to the thread that made it.
                CpuStorage::Data(v.clone(), Meta::new(charge))
            }
            CpuStorage::Matrix(m) => CpuStorage::Matrix(m.clone()),
        })
    }
}

/// The CPU backend: the kernels pick their SIMD path once at run time; `precision` says whether NVFP4
/// decode rows take int8 activations (the fast default) or f32 ones (the exact path parity tests use).
#[derive(Debug, Default)]
pub struct CpuBackend {
    /// Activation precision of the matmuls.
    pub precision: Precision,
    /// Most bytes of live tensors (none: bounded by the machine).
    cap: Option<Arc<MemoryCap>>,
}

impl CpuBackend {
    /// The process-wide instance at the default (fast) precision.
    pub fn shared() -> BackendRef {
        static CPU: OnceLock<BackendRef> = OnceLock::new();
        CPU.get_or_init(|| Arc::new(CpuBackend::default())).clone()
    }

    /// The process-wide exact instance: f32 activations everywhere (the parity tests' backend).
    pub fn exact() -> BackendRef {
        static CPU: OnceLock<BackendRef> = OnceLock::new();
        CPU.get_or_init(|| Arc::new(CpuBackend { precision: Precision::Exact, cap: None })).clone()
    }

    /// A backend whose live tensors (activations, states, KV pages; not the mapped weights) may take
    /// at most `bytes`: an allocation past it is [`BackendError::OutOfMemory`], as on a device.
    pub fn with_memory_cap(precision: Precision, bytes: usize) -> BackendRef {
        Arc::new(CpuBackend { precision, cap: Some(Arc::new(MemoryCap { cap: bytes, live: AtomicUsize::new(0) })) })
    }

    /// The cap's account, when there is one.
    pub fn memory_cap(&self) -> Option<&MemoryCap> {
        self.cap.as_deref()
    }

    pub(crate) fn tensor(&self, shape: &[usize], data: Vec<f32>) -> Result<Tensor> {
        self.typed(shape, HostVec::F32(data))
    }

    fn typed(&self, shape: &[usize], data: HostVec) -> Result<Tensor> {
        let dtype = data.as_data().dtype();
        debug_assert_eq!(shape.iter().product::<usize>(), data.as_data().len());
        let charge = self.cap.as_ref().map(|c| c.charge(data.bytes())).transpose()?;
        Ok(Tensor::new(shape.to_vec(), dtype, Device::Cpu, Box::new(CpuStorage::Data(data, Meta::new(charge)))))
    }
}

/// A CPU tensor's typed elements.
pub fn host_data(t: &Tensor) -> &HostVec {
    match t.storage::<CpuStorage>() {
        Some(CpuStorage::Data(v, _)) => v,
        other => panic!("expected a CPU tensor with data, got {other:?}: this is a bug"),
    }
}

/// A CPU tensor's typed elements, mutably (by the thread that made it: the execution contract).
pub fn host_data_mut(t: &mut Tensor) -> &mut HostVec {
    match t.storage_mut::<CpuStorage>() {
        Some(CpuStorage::Data(v, meta)) => {
            debug_assert_eq!(
                meta.owner,
                std::thread::current().id(),
                "a tensor written by a thread that did not make it (the backend's execution contract): this is a bug"
            );
            v
        }
        _ => panic!("expected a CPU tensor with data: this is a bug"),
    }
}

/// An f32 CPU tensor's elements.
pub fn host(t: &Tensor) -> &[f32] {
    match host_data(t) {
        HostVec::F32(v) => v,
        other => panic!("expected an f32 CPU tensor, got {:?}: this is a bug", other.as_data().dtype()),
    }
}

/// An f32 CPU tensor's elements, mutably.
pub fn host_mut(t: &mut Tensor) -> &mut [f32] {
    match host_data_mut(t) {
        HostVec::F32(v) => v,
        _ => panic!("expected an f32 CPU tensor: this is a bug"),
    }
}

/// The i32 elements of a CPU tensor (slot ids, page tables, selected blocks).
fn host_i32(t: &Tensor) -> &[i32] {
    match host_data(t) {
        HostVec::I32(v) => v,
        other => panic!("expected an i32 CPU tensor, got {:?}: this is a bug", other.as_data().dtype()),
    }
}

/// One plane (K or V) per page, as f32.
type Planes<'a> = Vec<Cow<'a, [f32]>>;

/// The K and V planes of the first `pages` pages of a sequence's table, as f32 (borrowed from an f32
/// pool, widened from a bf16 one).
fn kv_planes<'a>(kv: &PagedView<'a>, pages: usize, row: usize) -> (Planes<'a>, Planes<'a>) {
    match host_data(kv.pool) {
        HostVec::F32(d) => {
            let (k, v) = typed_planes(d, kv, pages, row);
            (k.into_iter().map(Cow::Borrowed).collect(), v.into_iter().map(Cow::Borrowed).collect())
        }
        HostVec::Bf16(d) => {
            let widen = |p: &[u16]| Cow::Owned(p.iter().map(|&b| f32::from_bits(u32::from(b) << 16)).collect());
            let (k, v) = typed_planes(d, kv, pages, row);
            (k.into_iter().map(widen).collect(), v.into_iter().map(widen).collect())
        }
        other => panic!("a KV pool of {:?}: this is a bug", other.as_data().dtype()),
    }
}

/// The K and V planes of the first `pages` pages of a sequence's table, in the pool's own elements.
fn typed_planes<'a, T>(pool: &'a [T], kv: &PagedView<'_>, pages: usize, row: usize) -> (Vec<&'a [T]>, Vec<&'a [T]>) {
    let span = kv.page_size * row;
    let plane = |p: i32, v: bool| {
        let at = kv.k_row(p as usize, 0) * row + usize::from(v) * span;
        &pool[at..at + span]
    };
    host_i32(kv.table)[..pages].iter().map(|&p| (plane(p, false), plane(p, true))).unzip()
}

fn matrix(t: &Tensor) -> &dyn HostMatrix {
    match t.storage::<CpuStorage>() {
        Some(CpuStorage::Matrix(m)) => m.as_ref(),
        other => panic!("expected a placed CPU weight, got {other:?}: this is a bug"),
    }
}

/// Top-k routing of one token with the kept weights renormalised (see [`fb::route`]).
pub fn route(logits: &[f32], top_k: usize) -> (Vec<usize>, Vec<f32>) {
    fb::route(logits, top_k, true)
}

impl Backend for CpuBackend {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn supports(&self, _op: Op) -> bool {
        true // every op runs here, in place on host memory
    }

    fn describe(&self) -> String {
        // The f32 / bf16 kernels use AVX2+FMA where `Isa` finds it (the same detection, x86 or not).
        let simd = if Isa::available().contains(&Isa::Avx2) { "avx2+fma" } else { "portable" };
        let fast = match self.precision {
            Precision::Int8 => {
                format!("nvfp4 decode int8 {}, prefill {}", Isa::detected().name(), osprey_kernels::prefill_kernels())
            }
            Precision::Exact => "exact f32 activations".to_string(),
        };
        format!("cpu ({simd} kernels, {fast}, {} threads)", osprey_kernels::threads())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The sharing rule of the execution contract is enforced: a thread may read another's tensor, but
    /// writing one it did not make is a bug the debug build stops (mutation: without the check in
    /// `host_mut` the write goes through and this test fails).
    #[test]
    #[cfg(debug_assertions)]
    fn a_tensor_written_by_a_thread_that_did_not_make_it_is_refused() {
        let b = CpuBackend::default();
        let mut t = b.upload_f32(&[1.0, 2.0], &[1, 2]).expect("upload");
        host_mut(&mut t)[0] = 3.0;
        let read = std::thread::scope(|s| s.spawn(|| host(&t)[0]).join());
        assert_eq!(read.ok(), Some(3.0), "reads are shared");
        // A copy belongs to the thread that made it.
        let mut copy = std::thread::scope(|s| s.spawn(|| t.clone()).join().expect("clone"));
        let write = std::thread::spawn(move || host_mut(&mut t)[0] = 4.0).join();
        assert!(write.is_err(), "a write from another thread panics");
        assert!(std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| host_mut(&mut copy)[0] = 5.0)).is_err());
    }

    /// Gated activations large enough to split across the pool equal the same formula element by
    /// element (mutation: each chunk reading `up` from its start fails it).
    #[test]
    fn large_gated_activations_split_across_the_pool_equal_the_serial_formula() {
        let b = CpuBackend::default();
        let n = 70_000;
        let g: Vec<f32> = (0..n).map(|i| (i as f32 * 0.013).sin() * 4.0).collect();
        let u: Vec<f32> = (0..n).map(|i| (i as f32 * 0.007).cos()).collect();
        let (mut gt, ut) = (b.upload_f32(&g, &[n]).expect("upload"), b.upload_f32(&u, &[n]).expect("upload"));
        b.silu_mul(&mut gt, &ut);
        let want: Vec<f32> = g.iter().zip(&u).map(|(&a, &c)| silu(a) * c).collect();
        assert_eq!(host(&gt), &want[..]);
        let mut xt = b.upload_f32(&u, &[n]).expect("upload");
        b.sigmoid_mul(&mut xt, &b.upload_f32(&g, &[n]).expect("upload"));
        let want: Vec<f32> = u.iter().zip(&g).map(|(&a, &c)| a * sigmoid(c)).collect();
        assert_eq!(host(&xt), &want[..]);
    }

    #[test]
    fn route_picks_top_k_and_renormalises() {
        let (ids, w) = route(&[0.0, 2.0, 1.0, 2.0], 2);
        assert_eq!(ids, vec![1, 3]);
        assert!((w[0] - 0.5).abs() < 1e-6 && (w[1] - 0.5).abs() < 1e-6);
        let (ids, w) = route(&[3.0, 0.0, 1.0], 2);
        assert_eq!(ids, vec![0, 2]);
        let e = (2.0f32).exp();
        assert!((w[0] - e / (e + 1.0)).abs() < 1e-6);
    }

    #[test]
    fn split_gather_and_rows_move_the_right_elements() {
        let b = CpuBackend::default();
        let x = b.upload_f32(&(0..12).map(|v| v as f32).collect::<Vec<_>>(), &[2, 6]).expect("upload");
        // Two heads of [a a | g] per row.
        let parts = b.split_cols(&x, 2, &[2, 1]).expect("split");
        assert_eq!(host(&parts[0]), &[0.0, 1.0, 3.0, 4.0, 6.0, 7.0, 9.0, 10.0]);
        assert_eq!(host(&parts[1]), &[2.0, 5.0, 8.0, 11.0]);
        let g = b.gather_rows(&x, &[1, 0]).expect("gather");
        assert_eq!(&host(&g)[..6], &host(&x)[6..]);
        let mut dst = b.zeros_f32(&[3, 6]).expect("zeros");
        b.write_rows(&mut dst, 6, &x, 1..2);
        assert_eq!(&host(&dst)[6..12], &host(&x)[6..]);
    }

    #[test]
    fn memory_is_typed() {
        let b = CpuBackend::default();
        let ids = b.upload(HostData::I32(&[3, -1, 7]), &[3]).expect("upload");
        assert_eq!((ids.dtype(), ids.bytes()), (DType::I32, 12));
        assert_eq!(b.download(&ids).expect("download"), HostVec::I32(vec![3, -1, 7]));
        let half = b.zeros(DType::BF16, &[2, 2]).expect("zeros");
        assert_eq!((half.dtype(), half.bytes()), (DType::BF16, 8));
        assert!(b.download_f32(&half).is_err(), "a bf16 tensor is not read as f32");
    }
}
