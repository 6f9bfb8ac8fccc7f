//! The root package's integration tests in one binary (issue 34: one test binary per crate, so the suite
//! links once, not 20 times): each file is a module, sharing the HTTP harness and the fixtures' helpers.
//! `tests/tracing.rs` stays a binary of its own: it installs a process-wide log subscriber.

#[path = "../../crates/models/tests/common/mod.rs"]
mod common;
#[path = "../harness/mod.rs"]
mod harness;

mod apis;
mod bench_serve;
mod clients;
mod default_model;
mod device_memory;
mod docs_cite;
mod experts;
mod fake_hub;
mod hardening;
mod http_edge;
mod hub;
mod hub_hostile;
mod kv_pages;
mod layout;
mod multimodal;
mod ollama;
mod outside_input;
mod prefix_cache;
mod qwen4_exp_serve;
mod readme;
mod server;
mod shutdown;
mod soak;
mod speculative_serve;
mod webui;
