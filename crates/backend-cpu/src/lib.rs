//! # osprey-backend-cpu — the CPU compute backend
//!
//! Brief overview: [`CpuBackend`] implements `osprey-backend`'s op set over `osprey-kernels` (AVX-512 /
//! AVX2 / portable paths picked at run time): activations and states are host `Vec<f32>`s, a placed
//! weight is the mapped checkpoint matrix itself (no copy), and every op calls the kernel the layers
//! called before the seam, in the same order. [`open`] gives the process-wide instance of a precision.
//! [`testing::HostOps`] is the explicit host-fallback wrapper the seam's tests use.

mod cpu;
pub mod host;
pub mod testing;

pub use cpu::{host, host_mut, route, CpuBackend, CpuStorage, Meta};

/// The CPU backend at `precision` (the process-wide instance).
pub fn open(precision: osprey_backend::Precision) -> osprey_backend::BackendRef {
    match precision {
        osprey_backend::Precision::Exact => CpuBackend::exact(),
        osprey_backend::Precision::Int8 => CpuBackend::shared(),
    }
}
