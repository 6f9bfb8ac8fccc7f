//! libFuzzer entry of `osprey_fuzz::request` (see crates/fuzz).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| osprey_fuzz::request(data));
