//! The runner's integration tests in one binary (issue 34): KV pages and speculative decoding.

#[path = "../../../models/tests/common/mod.rs"]
mod common;

mod device_fault;
mod pages;
mod speculative;
