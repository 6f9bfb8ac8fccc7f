//! The runner's integration tests in one binary (issue 34): KV pages and speculative decoding; on the
//! emulated device, faults and sampling (issue 51).

#[path = "../../../models/tests/common/mod.rs"]
mod common;

mod device_fault;
mod device_sampling;
mod pages;
mod speculative;
