//! The emulated device's two streams, as a GPU runs them: work is queued when issued and runs later, so a
//! missing fence shows. The compute stream runs only when the host waits (a synchronise, a download, a
//! free) or its queue is long; a kernel's fault is reported then, at the next fence, as a GPU reports it.
//! Each copy on the copy stream runs either as early as its order allows (at once, after the compute work
//! it was ordered behind with `copies_after`) or as late (when something waits for it), chosen by a seeded
//! draw per copy (or fixed, [`CopyOrder`]): an early copy overwrites memory that queued compute still
//! reads unless ordered after it; a late one leaves a reader that did not wait for it the old bytes.

use std::collections::VecDeque;

use crate::device::{DevPtr, DeviceError, GemmBf16, LaunchConfig};
use crate::kernels::EmuEntry;

/// When the copy stream's copies run (tests pick one to make a missing fence show deterministically).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyOrder {
    /// A seeded draw per copy (`OSPREY_EMU_SEED`): the default.
    Seeded,
    /// As early as the copy's order allows.
    Early,
    /// When something waits for it.
    Late,
}

/// Compute work queued, in stream order.
pub(super) enum Work {
    Launch {
        name: &'static str,
        entry: EmuEntry,
        cfg: LaunchConfig,
        args: Vec<u64>,
    },
    /// An upload from pageable memory: the driver staged the bytes when it was issued.
    Write {
        dst: DevPtr,
        bytes: Vec<u8>,
    },
    Copy {
        dst: DevPtr,
        src: DevPtr,
        len: usize,
    },
    /// A graph's upload: from its staging memory (an address), read when it runs.
    Stage {
        dst: DevPtr,
        src: usize,
        len: usize,
    },
    Zero {
        dst: DevPtr,
        len: usize,
    },
    Gemm(GemmBf16),
    /// The compute stream waits for the copy stream up to this id (`wait_event`).
    WaitCopy(u64),
}

/// A copy on the copy stream: from host memory that its caller keeps valid until the copy has run.
pub(super) struct CopyItem {
    pub(super) id: u64,
    pub(super) dst: DevPtr,
    pub(super) src: usize,
    pub(super) len: usize,
    /// The compute work (by id) the copy runs after (`copies_after`).
    pub(super) after: u64,
}

/// Both queues; the device holds them under one lock.
#[derive(Default)]
pub(super) struct Streams {
    pub(super) compute: VecDeque<(u64, Work)>,
    /// Compute work has run up to this id.
    pub(super) ran: u64,
    pub(super) copies: VecDeque<CopyItem>,
    /// The compute id later copies run after.
    pub(super) copy_after: u64,
    /// Bytes staged by queued uploads.
    pub(super) staged: usize,
    /// The first fault of queued work, reported at the next fence.
    pub(super) fault: Option<DeviceError>,
    /// The draws of [`CopyOrder::Seeded`].
    pub(super) seed: u64,
}

/// The compute queue runs when it holds this much (a GPU's queue is bounded too: the host then blocks).
pub(super) const MAX_QUEUED: usize = 4096;
/// ... or its staged uploads hold this many bytes.
pub(super) const MAX_STAGED: usize = 64 << 20;

impl Streams {
    pub(super) fn new() -> Self {
        // As the fiber runtime reads it (`strtoull` base 0: decimal or 0x hex).
        let parse = |s: String| match s.strip_prefix("0x") {
            Some(h) => u64::from_str_radix(h, 16).ok(),
            None => s.parse().ok(),
        };
        let seed = std::env::var("OSPREY_EMU_SEED").ok().and_then(parse).unwrap_or(0x0005_B7E7);
        Streams { seed, ..Streams::default() }
    }

    /// Whether the next copy runs early (a splitmix64 draw under [`CopyOrder::Seeded`]).
    pub(super) fn early(&mut self, order: CopyOrder) -> bool {
        match order {
            CopyOrder::Early => true,
            CopyOrder::Late => false,
            CopyOrder::Seeded => {
                self.seed = self.seed.wrapping_add(0x9E37_79B9_7F4A_7C15);
                let mut z = self.seed;
                z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
                z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
                (z ^ (z >> 31)) & 1 == 1
            }
        }
    }

    /// The first fault since the last fence, if any.
    pub(super) fn take_fault(&mut self) -> Result<(), DeviceError> {
        self.fault.take().map_or(Ok(()), Err)
    }
}

impl std::fmt::Debug for Streams {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streams")
            .field("compute", &self.compute.len())
            .field("ran", &self.ran)
            .field("copies", &self.copies.len())
            .finish_non_exhaustive()
    }
}
