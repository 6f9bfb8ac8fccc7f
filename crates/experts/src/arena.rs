//! The expert RAM tier's memory: one arena of fixed-stride slots, allocated by the compute backend at
//! start (page-locked on a device, so an upload from it is one asynchronous copy; 4 KiB-aligned memory
//! on the CPU) and, where the kernel allows, registered with io_uring. A resident expert is one slot:
//! its tensors' aligned read windows back to back, `[gate | up | down]`, read straight into place (no
//! staging buffer, no copy), and its weights borrow the slot. A slot goes back to the free list when the
//! last weight borrowing it drops, which for an expert in a device slot is after its upload's fence
//! (the backend keeps the lease until then).

use std::sync::{Arc, Mutex};

use osprey_models::backend::HostArena;

use crate::buf::ALIGN;

/// The arena and its free slots.
#[derive(Debug)]
pub struct Arena {
    mem: HostArena,
    stride: usize,
    slots: usize,
    free: Mutex<Vec<usize>>,
}

impl Arena {
    /// `mem` cut into slots of `stride` bytes (a multiple of 4 KiB).
    pub fn new(mem: HostArena, stride: usize) -> Arc<Self> {
        assert!(stride > 0 && stride.is_multiple_of(ALIGN), "arena stride {stride}: this is a bug");
        let slots = mem.len() / stride;
        Arc::new(Arena { mem, stride, slots, free: Mutex::new((0..slots).rev().collect()) })
    }

    /// Bytes of one slot.
    pub fn stride(&self) -> usize {
        self.stride
    }

    /// Slots in all.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// Slots not holding an expert.
    pub fn free(&self) -> usize {
        self.free.lock().map(|f| f.len()).unwrap_or(0)
    }

    /// Start of the arena (io_uring registration).
    pub fn base(&self) -> *mut u8 {
        self.mem.as_ptr()
    }

    /// A free slot, owned by the caller until it drops (`None` when every slot holds an expert).
    pub fn take(self: &Arc<Self>) -> Option<ArenaSlot> {
        let index = self.free.lock().ok()?.pop()?;
        Some(ArenaSlot { arena: self.clone(), index })
    }
}

/// One slot: written once by the reader while uniquely owned, then shared read-only by the weights
/// that borrow it.
#[derive(Debug)]
pub struct ArenaSlot {
    arena: Arc<Arena>,
    index: usize,
}

impl ArenaSlot {
    /// Slot index (its io_uring registered-buffer index when the arena is registered).
    pub fn index(&self) -> usize {
        self.index
    }

    /// Start of the slot's memory, for the reader to write into while the slot is uniquely owned.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        // SAFETY: `index < slots`, so the slot lies inside the arena.
        unsafe { self.arena.mem.as_ptr().add(self.index * self.arena.stride) }
    }

    /// Bytes of the slot.
    pub fn len(&self) -> usize {
        self.arena.stride
    }

    /// Whether the slot has no bytes (never).
    pub fn is_empty(&self) -> bool {
        self.arena.stride == 0
    }
}

impl AsRef<[u8]> for ArenaSlot {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: the slot is inside the arena, which lives as long as this handle; it is only written
        // through `as_mut_ptr` while uniquely owned (`&mut self`), never while shared.
        unsafe { std::slice::from_raw_parts(self.arena.mem.as_ptr().add(self.index * self.arena.stride), self.len()) }
    }
}

impl osprey_models::ByteSource for ArenaSlot {}

impl Drop for ArenaSlot {
    fn drop(&mut self) {
        if let Ok(mut f) = self.arena.free.lock() {
            f.push(self.index);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_disjoint_aligned_and_come_back_when_dropped() {
        let mem = osprey_backend_cpu::CpuBackend::shared().alloc_host_arena(3 * ALIGN).expect("arena");
        let arena = Arena::new(mem, ALIGN);
        let (mut a, mut b) = (arena.take().expect("a"), arena.take().expect("b"));
        let c = arena.take().expect("c");
        assert!(arena.take().is_none(), "three slots");
        assert_eq!(arena.free(), 0);
        // SAFETY: each slot is uniquely owned here and ALIGN bytes long.
        unsafe {
            a.as_mut_ptr().write_bytes(1, ALIGN);
            b.as_mut_ptr().write_bytes(2, ALIGN);
        }
        assert!(a.as_ref().iter().all(|&x| x == 1) && b.as_ref().iter().all(|&x| x == 2));
        assert!(c.as_ref().iter().all(|&x| x == 0), "untouched and zeroed");
        assert_eq!(a.as_ref().as_ptr() as usize % ALIGN, 0);
        drop(b);
        assert_eq!(arena.free(), 1);
        assert!(arena.take().is_some());
    }
}
