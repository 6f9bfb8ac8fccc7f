//! # osprey-backend-cuda — the CUDA compute backend, proven without a GPU
//!
//! Brief overview: [`CudaBackend`] implements `osprey-backend`'s op set by launching kernels written as
//! header-free `.cu` sources (`kernels/`), over a thin [`DeviceLayer`]: the real device through cudarc
//! (feature `cuda`: NVRTC compiles the sources at startup for the card's architecture) or the emulated
//! device ([`EmuDevice`]: the same sources compiled for the host by `build.rs` and run thread by thread
//! on fibers, with `__syncthreads`, warp shuffles and shared memory as CUDA defines them). The emulated
//! device is a test device (`--device cuda-emu`): it is how every CI run checks, on machines without a
//! GPU, that each kernel computes what the CPU backend computes and that the backend around the kernels
//! serves the models. [`kernels`] lists every kernel with its register budget, which the NVRTC check
//! (`nvrtc`, feature `cuda`) enforces for every target architecture.
//!
//! Status: every op of the seam has a kernel (memory and fences, linears in f32, bf16, f16 and NVFP4,
//! embeddings, element-wise ops, norms, rotary, the router, paged and full attention, Gated DeltaNet,
//! expert slots, `qwen4_exp`'s ops), each checked on the emulated device against the CPU backend, and
//! `supports` answers yes to all; none has run on a GPU yet (docs/cuda.md). The emulated device runs
//! several blocks at once with per-block poisoned shared memory, and queues compute and copies on two
//! streams ([`emu`]); it meters each launch's global-memory bytes ([`traffic`]), which with each kernel's
//! declared arithmetic ([`cost`]) is what `osprey bench roofline` prices. With NVRTC at build time the
//! kernels' images are embedded ([`images`]), so a start needs only the driver. Decode steps run as CUDA
//! graphs ([`graph`]: recorded once per step shape, replayed with changed nodes updated in place), and
//! tokens are sampled where the logits are (`kernels/sample.cu`).

mod backend;
pub mod cost;
pub mod counted;
pub mod device;
#[cfg(feature = "cuda")]
pub mod driver;
pub mod emu;
pub mod graph;
pub mod images;
pub mod kernel_cache;
pub mod kernels;
pub mod launch;
#[cfg(feature = "cuda")]
pub mod nvrtc;
pub mod traffic;

use std::sync::Arc;

pub use backend::{CudaBackend, CudaStorage, BUF_CACHE, SCRATCH_CAP};
pub use counted::{Counted, DeviceCounts};
pub use device::{Arg, DevPtr, DeviceError, DeviceInfo, DeviceLayer, Event, GemmBf16, LaunchConfig};
pub use emu::{CopyOrder, EmuDevice};
pub use graph::{GraphCounts, Graphed};
pub use traffic::Traffic;

/// The CUDA backend on device `ordinal` at `precision`: a clear error without the `cuda` feature, a
/// driver, a device or NVRTC.
pub fn open(
    ordinal: usize,
    precision: osprey_backend::Precision,
) -> osprey_backend::Result<osprey_backend::BackendRef> {
    #[cfg(feature = "cuda")]
    {
        let dev = driver::CudaDevice::open(ordinal)
            .map_err(|e| osprey_backend::BackendError::Unavailable(format!("--device cuda:{ordinal}: {e}")))?;
        Ok(Arc::new(CudaBackend::new(Arc::new(dev), osprey_backend::Device::Cuda(ordinal)).with_precision(precision)))
    }
    #[cfg(not(feature = "cuda"))]
    let _ = precision;
    #[cfg(not(feature = "cuda"))]
    Err(osprey_backend::BackendError::Unavailable(format!(
        "--device cuda:{ordinal}: this build has no CUDA driver layer (build with --features cuda); \
         use --device cpu, or --device cuda-emu to test the CUDA kernels on the CPU"
    )))
}

/// Whether the CUDA driver library (`libcuda`) loads on this machine.
#[cfg(feature = "cuda")]
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The CUDA backend on the emulated device with `memory` bytes of device memory, exact (f32 linears).
pub fn open_emulated(memory: usize) -> osprey_backend::BackendRef {
    open_emulated_with(memory, osprey_backend::Precision::Exact)
}

/// [`open_emulated`] at `precision`.
pub fn open_emulated_with(memory: usize, precision: osprey_backend::Precision) -> osprey_backend::BackendRef {
    let dev = Arc::new(EmuDevice::new(memory));
    Arc::new(CudaBackend::new(dev, osprey_backend::Device::CudaEmu).with_precision(precision))
}

/// [`open_emulated_with`] on a device that meters every launch's global-memory bytes
/// ([`EmuDevice::measuring`]): what `osprey bench roofline` prices.
pub fn open_emulated_measuring(memory: usize, precision: osprey_backend::Precision) -> osprey_backend::BackendRef {
    let dev = Arc::new(EmuDevice::new(memory).measuring());
    Arc::new(CudaBackend::new(dev, osprey_backend::Device::CudaEmu).with_precision(precision))
}

/// The CUDA backend tests run on (exact): the emulated device with `memory` bytes, or the card named by
/// `OSPREY_CUDA_TEST_DEVICE=cuda:N` (how the GPU kit, `tools/gpu/run.sh`, runs the same tests on a GPU).
pub fn open_test_device(memory: usize) -> osprey_backend::BackendRef {
    let exact = osprey_backend::Precision::Exact;
    match std::env::var("OSPREY_CUDA_TEST_DEVICE").ok().and_then(|d| d.strip_prefix("cuda:")?.parse().ok()) {
        Some(n) => open(n, exact).unwrap_or_else(|e| panic!("OSPREY_CUDA_TEST_DEVICE=cuda:{n}: {e}")),
        None => open_emulated(memory),
    }
}
