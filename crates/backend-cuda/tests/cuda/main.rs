//! The CUDA backend's tests, one binary: the emulation itself, every op on the emulated device against
//! the CPU backend, and (feature `cuda`) every kernel through NVRTC for every target architecture.

mod asan;
mod batched;
mod common;
mod coverage;
mod emulator;
mod graphs;
#[cfg(feature = "cuda")]
mod nvrtc;
mod ops;
mod q8;
mod sample;
mod sequence;
mod traffic;
