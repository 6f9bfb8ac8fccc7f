//! libFuzzer entry of `osprey_fuzz::schema` (see crates/fuzz).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| osprey_fuzz::schema(data));
