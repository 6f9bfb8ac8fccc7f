//! # osprey-kernels — CPU kernels
//!
//! Brief overview: the arithmetic every model layer is made of, on plain `f32` slices. Owns no state and
//! talks to no actor; `osprey-models` composes these into layers.
//!
//! - [`matmul`]: `y = x · Wᵀ` over weights stored as f32, bf16 or f16 (`WeightView`); AVX2+FMA with runtime
//!   detection and a portable fallback; one-token rows take a GEMV path that converts weights in registers,
//!   batches take a GEMM path that converts each weight tile once (matrixmultiply's sgemm).
//! - [`bf16`]: bf16 × bf16 dot-product tiles (AVX512-BF16 `vdpbf16ps`), the fast precision's GEMM for bf16
//!   and NVFP4 weights and its GEMV for bf16 weights, on CPUs that have it.
//! - [`nvfp4`]: NVFP4 decoding and the dequantise-in-registers dot product.
//! - [`q8_gemm`]: the fast NVFP4 GEMM for many rows (prefill) on AVX-512 VNNI and AVX2: int8
//!   activations per 16-value block, weights decoded per call into an interleaved tile, `vpdpbusd`
//!   (`vpmaddubsw` on AVX2) with one lane per weight row; [`set_gemm_ceiling`] (`--gemm`) chooses below
//!   the best.
//! - [`q8`]: the fast NVFP4 path for few rows (decode; up to 2 rows where the int8 GEMM runs, else a
//!   prefill's routed experts up to 32 rows, or 8 where bf16 tiles take the rest): int8 activations,
//!   integer dot products (AVX-512 VNNI / AVX-VNNI / AVX2 / portable, picked once at run time), chosen
//!   by [`Precision::Int8`].
//! - [`norm`]: zero-centred RMSNorm `x̂·(1+w)`, gated RMSNorm `x̂·w·silu(z)`, L2 norm.
//! - [`pool`]: the persistent spinning pool every data-parallel loop here runs on.
//! - [`rope`]: partial NeoX rotary with interleaved mRoPE sections.
//! - [`attention`]: causal GQA attention of new queries over a sequence's cached K/V: flash-decoding for a
//!   few queries ([`attention_decode`]), flash attention for a prefill's ([`attention_prefill`]).
//! - [`gdn`]: the gated delta rule (chunked for prefill, recurrent for decode) and its causal conv.
//!
//! Every kernel computes in f32 with the reduction orders noted in its docs; parity with the reference is
//! asserted in the models crate's tests, not here.

mod act;
pub mod amx;
pub mod attention;
pub mod attention_bf16;
pub mod attention_decode;
pub mod attention_prefill;
pub mod bf16;
pub mod calibrate;
mod dispatch;
pub mod gdn;
mod matmul;
pub mod norm;
pub mod nvfp4;
pub mod pool;
pub mod q8;
pub mod q8_gemm;
pub mod q8_gemv;
pub mod rope;
mod simd;
#[cfg(test)]
mod timing;

pub use act::{gelu_erf, gelu_tanh, sigmoid, silu, softplus};
pub use dispatch::{prefill_kernel, prefill_kernels, set_gemm_ceiling, Gemm, Rows, WeightClass};
pub use matmul::{
    matmul, matmul_into_strided, matmul_pair_with, matmul_with, DType, Precision, WeightRows, WeightView,
    INT8_GEMV_BELOW_ROWS,
};
pub use simd::dot_f32;

/// Threads the kernels split work across ([`pool`]: the caller and its workers).
pub fn threads() -> usize {
    pool::threads()
}
