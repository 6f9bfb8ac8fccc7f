//! libFuzzer entry of `osprey_fuzz::chat_template` (see crates/fuzz).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| osprey_fuzz::chat_template(data));
