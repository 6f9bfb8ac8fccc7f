//! # osprey-backend — the compute-backend seam
//!
//! Brief overview: model families compute through a [`Backend`]: an object that owns device memory
//! ([`Tensor`]: shape, dtype, device and an opaque storage only its backend reads) and offers the
//! operation set a decoder forward is made of — linear over f32 / bf16 / f16 / NVFP4 weights, embedding
//! gather, RMSNorm variants, rope / mRoPE, attention over paged KV and bidirectional attention, causal
//! conv and the gated delta rule, activations, router top-k, expert gather / scatter, residual and
//! element-wise ops. Weights are placed by the backend at load ([`Backend::place_weight`]), activations
//! and per-sequence state (KV pages, recurrent states) are the backend's tensors, and host data crosses
//! only through [`Backend::upload`] / [`Backend::download`], so a device backend keeps a whole forward on
//! its device: the host sees token ids going in, routed expert ids (the one sync a MoE layer needs) and
//! the logits of the rows it samples.
//!
//! [`cpu::CpuBackend`] is the first backend: it wraps `osprey-kernels`, keeps weights where the
//! checkpoint mapped them (no copy), and computes exactly what the kernels compute. A CUDA backend
//! implements the same trait beside it (`--device cuda:N`); [`open`] picks one from a [`Device`].

pub mod cpu;
mod device;
pub mod fallback;
mod ops;
mod tensor;

pub use device::Device;
pub use ops::{Backend, BackendRef, PagedView, RopeTable};
pub use osprey_kernels::attention::AttnShape;
pub use osprey_kernels::gdn::GdnShape;
pub use osprey_kernels::rope::MRope;
pub use osprey_kernels::{DType, Precision, WeightView};
pub use tensor::{HostMatrix, Storage, Tensor};

/// Why a backend could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The device is not one this build can drive.
    #[error("{0}")]
    Unavailable(String),
}

/// The backend for `device` at the default (fast) precision.
pub fn open(device: Device) -> Result<BackendRef, BackendError> {
    open_with(device, Precision::default())
}

/// The backend for `device`; `precision` picks int8 activations for NVFP4 decode rows (the default)
/// or f32 activations everywhere (exact).
pub fn open_with(device: Device, precision: Precision) -> Result<BackendRef, BackendError> {
    match device {
        Device::Cpu if precision == Precision::Exact => Ok(cpu::CpuBackend::exact()),
        Device::Cpu => Ok(cpu::CpuBackend::shared()),
        Device::Cuda(n) => Err(BackendError::Unavailable(format!(
            "--device cuda:{n}: this build has no CUDA backend yet; use --device cpu"
        ))),
    }
}
