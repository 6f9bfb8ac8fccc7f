//! Routed experts on a backend: identity ([`ExpertKey`]), the host form the expert tiers hand over
//! ([`HostExpert`]), per-layer pools of fixed-stride slots ([`ExpertPool`]), router output that stays a
//! tensor ([`Routing`]), and the fences that order uploads against the ops reading a slot.
//!
//! The contract a MoE layer follows each step (`osprey_models::layers::moe`): route (one download of
//! the expert ids: the layer's one routing sync), look the touched experts up in a slot table, upload
//! each miss into a slot whose last reader's fence has completed, then one [`crate::Backend::moe_routed`]
//! per wave of resident experts and one [`crate::Backend::moe_combine`]. A hit costs no transfer.

use std::any::Any;
use std::fmt::Debug;
use std::sync::Arc;

use crate::{DType, HostMatrix, Tensor};

/// Which routed expert: it travels with every expert from the residency manager to a slot.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ExpertKey {
    /// Decoder layer.
    pub layer: u32,
    /// Expert index within the layer.
    pub expert: u32,
}

impl ExpertKey {
    /// Expert `expert` of decoder layer `layer`.
    pub fn new(layer: usize, expert: usize) -> Self {
        ExpertKey { layer: layer as u32, expert: expert as u32 }
    }

    /// The layer, as an index.
    pub fn layer(self) -> usize {
        self.layer as usize
    }

    /// The expert within its layer, as an index.
    pub fn expert(self) -> usize {
        self.expert as usize
    }
}

/// The geometry every expert of a layer shares (so a pool's slots have one stride).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertShape {
    /// Model width (`gate` / `up` take it in, `down` gives it out).
    pub hidden: usize,
    /// Expert intermediate width.
    pub inter: usize,
    /// Stored element type of the three projections.
    pub dtype: DType,
}

/// One routed expert as a host tier holds it: `gate`, `up` (`[inter, hidden]`) and `down`
/// (`[hidden, inter]`), and what keeps that host memory valid (a residency lease). A backend keeps the
/// lease for as long as it reads the host memory: a device until its copy's fence completes, the CPU
/// (whose slot is the host expert itself) until the slot is reused.
pub struct HostExpert {
    /// Which expert.
    pub key: ExpertKey,
    /// Gate projection.
    pub gate: Arc<dyn HostMatrix>,
    /// Up projection.
    pub up: Arc<dyn HostMatrix>,
    /// Down projection.
    pub down: Arc<dyn HostMatrix>,
    /// Released when dropped.
    pub lease: Option<Box<dyn Debug + Send + Sync>>,
}

impl Debug for HostExpert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HostExpert").field("key", &self.key).field("leased", &self.lease.is_some()).finish()
    }
}

impl HostExpert {
    /// Bytes of the three projections.
    pub fn bytes(&self) -> usize {
        self.gate.bytes() + self.up.bytes() + self.down.bytes()
    }
}

/// One layer's expert slots on a device. The pool records which expert each slot holds (so
/// [`crate::Backend::moe_routed`] knows the experts it reads); its storage is the backend's.
pub struct ExpertPool {
    /// Decoder layer.
    pub layer: u32,
    /// Geometry of every slot.
    pub shape: ExpertShape,
    keys: Vec<Option<ExpertKey>>,
    storage: Box<dyn Any + Send + Sync>,
}

impl Debug for ExpertPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ExpertPool").field("layer", &self.layer).field("slots", &self.keys.len()).finish()
    }
}

impl ExpertPool {
    /// A pool of `slots` empty slots over a backend's `storage`.
    pub fn new(layer: u32, shape: ExpertShape, slots: usize, storage: Box<dyn Any + Send + Sync>) -> Self {
        ExpertPool { layer, shape, keys: vec![None; slots], storage }
    }

    /// Slots.
    pub fn slots(&self) -> usize {
        self.keys.len()
    }

    /// The expert in `slot`.
    pub fn key(&self, slot: usize) -> Option<ExpertKey> {
        self.keys[slot]
    }

    /// Records that `slot` now holds `key` (a backend calls it from `upload_expert`).
    pub fn set_key(&mut self, slot: usize, key: ExpertKey) {
        self.keys[slot] = Some(key);
    }

    /// The backend's storage.
    pub fn storage<S: Any>(&self) -> Option<&S> {
        self.storage.downcast_ref()
    }

    /// The backend's storage, mutably.
    pub fn storage_mut<S: Any>(&mut self) -> Option<&mut S> {
        self.storage.downcast_mut()
    }
}

/// Router output, kept on the device: per token its `k` experts in ascending id order and their
/// weights in the same order (ascending order is the order outputs are summed in, so answers do not
/// depend on which experts were resident).
#[derive(Clone, Debug)]
pub struct Routing {
    /// `[T, k]` i32 expert ids, ascending along each row.
    pub ids: Tensor,
    /// `[T, k]` f32 weights of those experts.
    pub weights: Tensor,
}

/// A point in a backend's queue: complete once the work queued before it has run. Backends that run
/// ops synchronously (the CPU) hand out complete fences.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Fence(pub u64);

impl Fence {
    /// A fence with nothing before it.
    pub const DONE: Fence = Fence(0);
}

/// Host memory a backend allocates for the expert RAM tier ([`crate::Backend::alloc_host_arena`]):
/// page-locked on a device (so uploads from it overlap compute), 4 KiB-aligned on the CPU (so direct
/// reads land in it). Zeroed; valid until dropped.
pub struct HostArena {
    ptr: *mut u8,
    len: usize,
    /// Frees the memory when dropped.
    _owner: Box<dyn Any + Send + Sync>,
}

// SAFETY: the arena is plain memory owned by `_owner`; who writes where is its users' contract (each
// slot has one writer before it is shared read-only).
unsafe impl Send for HostArena {}
unsafe impl Sync for HostArena {}

impl Debug for HostArena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HostArena({} bytes)", self.len)
    }
}

/// Alignment of an arena (direct reads need 4 KiB).
const ARENA_ALIGN: usize = 4096;

/// A zeroed, 4 KiB-aligned heap allocation; the OS commits its pages as they are first written.
struct Aligned {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: uniquely owned heap memory, only freed on drop.
unsafe impl Send for Aligned {}
unsafe impl Sync for Aligned {}

impl Drop for Aligned {
    fn drop(&mut self) {
        // SAFETY: allocated in `HostArena::zeroed` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

impl HostArena {
    /// `bytes` (rounded up to 4 KiB) of plain zeroed host memory, 4 KiB-aligned: the host arena of a
    /// backend whose device reads host memory as it is (the CPU, the emulated CUDA device). `None` when
    /// the allocation fails.
    pub fn zeroed(bytes: usize) -> Option<Self> {
        let len = bytes.div_ceil(ARENA_ALIGN).max(1) * ARENA_ALIGN;
        let layout = std::alloc::Layout::from_size_align(len, ARENA_ALIGN).ok()?;
        // SAFETY: non-zero size, valid alignment.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        if ptr.is_null() {
            return None;
        }
        // SAFETY: `ptr` is valid for `len` bytes, aligned, and owned by the `Aligned` that frees it.
        Some(unsafe { HostArena::new(ptr, len, Box::new(Aligned { ptr, layout })) })
    }

    /// Wraps `len` bytes at `ptr`, freed when `owner` drops.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, aligned to 4 KiB, and stay so until
    /// `owner` is dropped.
    pub unsafe fn new(ptr: *mut u8, len: usize, owner: Box<dyn Any + Send + Sync>) -> Self {
        HostArena { ptr, len, _owner: owner }
    }

    /// Start of the memory.
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}
