//! # osprey-experts — the expert store and the expert residency manager
//!
//! Brief overview: routed experts live in a cache hierarchy, disk → host RAM → the backend's expert slots
//! (which the MoE block keeps, `osprey_models::layers::slots`, and reports to this crate as hits). This
//! crate owns the index of every expert's bytes on disk ([`ExpertIndex`]), the readers (io_uring with
//! O_DIRECT straight into a host arena of expert slots the compute backend allocates ([`Arena`]: pinned
//! on a device, registered with io_uring where the kernel allows), or a `pread` thread pool when
//! io_uring is refused — same results), and
//! the residency-manager actor ([`spawn`]) that keeps experts in RAM under a budget, leases the ones in
//! use and reads all misses of a layer in one batch. The runner sees it as an `ExpertSource`
//! ([`ResidentSet`]): a request returns a ticket, so the shared expert is computed while reads are in
//! flight. Outputs do not depend on the budget: only speed does.

mod arena;
mod buf;
mod reader;
mod residency;
mod store;

pub use arena::{Arena, ArenaSlot};
pub use buf::{AlignedBuf, ALIGN};
pub use reader::{open_reader, Dest, PreadReader, ReadDone, ReadReq, Reader, ReaderKind, UringReader};
pub use residency::{
    spawn, Budget, ExpertStats, LayerStats, Options, Policy, PrefetchStats, ResidencyStats, ResidencyTable, ResidentSet,
};
pub use store::{ExpertIndex, LinearLoc, Range};
