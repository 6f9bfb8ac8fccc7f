//! # osprey-backend — the compute-backend seam
//!
//! Brief overview: model families compute through a [`Backend`]: an object that owns device memory
//! ([`Tensor`]: shape, dtype, device and an opaque storage only its backend reads) and offers the
//! operation set a decoder forward is made of — linear over f32 / bf16 / f16 / NVFP4 weights, embedding
//! gather, RMSNorm variants, rope / mRoPE, attention over paged KV and bidirectional attention, causal
//! conv and the gated delta rule, activations, router top-k, expert gather / scatter, residual and
//! element-wise ops, and the `qwen4_exp` ops. Weights are placed by the backend at load
//! ([`MemoryOps::place_weight`]), activations and per-sequence state (KV pages, recurrent states) are the
//! backend's tensors, and host data crosses only through [`MemoryOps::upload`] / [`MemoryOps::download`], so
//! a device backend keeps a whole forward on its device: the host sees token ids going in, routed expert
//! ids (the one sync a MoE layer needs) and the logits of the rows it samples.
//!
//! The op set is one table (`ops.rs`) of group traits — [`MemoryOps`], [`CoreOps`], [`AttentionOps`],
//! [`RecurrentOps`], [`ExpertOps`], [`Qwen4Ops`] — from which `table.rs` generates the traits, [`Op`]
//! and [`Wrapper`] (a backend around another, forwarding what it does not override).
//!
//! This crate is the seam only: the trait, its tensors and its vocabulary ([`DType`], [`WeightView`],
//! [`Precision`], [`AttnShape`], [`GdnShape`], [`MRope`]). It depends on no kernel crate, so a device
//! backend depends on it alone. Every op is required: there are no silent host fallbacks, and a
//! backend says which ops it runs ([`Backend::supports`]), so a model refuses to load on a backend that
//! lacks one of its ops instead of running it slowly. The CPU backend is `osprey-backend-cpu`.

mod device;
pub mod experts;
#[macro_use]
mod table;
mod ops;
pub mod sampling;
mod tensor;
pub mod types;

pub use device::Device;
pub use experts::{ExpertKey, ExpertPool, ExpertShape, Fence, HostArena, HostExpert, Routing};
pub use ops::{
    AttentionOps, Backend, BackendRef, CoreOps, DeviceStats, ExpertOps, Flops, GraphStats, KernelCost, MemoryOps, Op,
    PagedRows, PagedView, Qwen4Ops, RecurrentOps, RopeTable, Wrapper,
};

/// What a backend op returns.
pub type Result<T> = std::result::Result<T, BackendError>;
pub use sampling::{LogitEdit, RowSampling};
pub use tensor::{HostMatrix, Storage, Tensor};
pub use types::{AttnShape, DType, GdnShape, HostData, HostTensor, HostVec, MRope, Precision, WeightView};

/// Why a backend could not be opened or an op could not run.
#[derive(Clone, Debug, thiserror::Error)]
pub enum BackendError {
    /// The device is not one this build can drive.
    #[error("{0}")]
    Unavailable(String),
    /// The device has no room for an allocation: the request that asked fails (503), the next runs.
    #[error("out of device memory: {requested} bytes asked, {available} available")]
    OutOfMemory {
        /// Bytes the allocation needed.
        requested: usize,
        /// Bytes the device had left under its cap.
        available: usize,
    },
    /// A tensor of one element type was used as another (a bug in the caller).
    #[error("expected a {expected:?} tensor, got {got:?}: this is a bug")]
    DType {
        /// The type the op reads.
        expected: DType,
        /// The tensor's type.
        got: DType,
    },
    /// An expert pool or slot used out of its bounds, or a pool of another backend (a bug in the caller).
    #[error("{0}: this is a bug")]
    Slot(String),
    /// The device failed an operation (a kernel fault, a lost device, a driver error).
    #[error("device error: {0}")]
    Device(String),
    /// The device faulted in `op` and is unusable from then on (a kernel fault leaves a CUDA context
    /// unusable): every later op fails, and the engine stops ([`crate::Backend::health`]).
    #[error("device fault in {op}: {message}; the device is unusable")]
    Fault {
        /// The op that faulted (a kernel's name, `allocation`, `download`, …).
        op: String,
        /// What went wrong.
        message: String,
    },
    /// The backend lacks ops a model needs.
    #[error("the {backend} backend lacks {ops:?}, which this model needs")]
    Unsupported {
        /// The backend's description.
        backend: String,
        /// The ops it lacks.
        ops: Vec<Op>,
    },
}

/// Refuses a backend that lacks any of `ops` (a model family's [`Op`]s), naming every missing one.
pub fn require(backend: &dyn Backend, ops: &[Op]) -> Result<()> {
    let missing: Vec<Op> = ops.iter().copied().filter(|&op| !backend.supports(op)).collect();
    if missing.is_empty() {
        Ok(())
    } else {
        Err(BackendError::Unsupported { backend: backend.describe(), ops: missing })
    }
}
