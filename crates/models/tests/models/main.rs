//! The models crate's integration tests in one binary (issue 34: one per crate): parity with transformers,
//! NVFP4, vision, MTP, qwen4_exp, KV dtypes, the backend seam and fences, each file a module sharing
//! `common` (fixture paths, reference tensors, tolerances).

#[path = "../common/mod.rs"]
mod common;

mod backend_seam;
mod cuda_emu;
mod fences;
mod kv_dtype;
mod moe_overlap;
mod mtp;
mod nvfp4;
mod parity;
mod qwen4_exp;
mod vision;
