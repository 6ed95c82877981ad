//! libFuzzer target: any bytes through every GGUF reader, then a rewrite of what they accept.
//! The checks live in `gguf_fuzz::check` so the stable test suite runs them too.

#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| gguf_fuzz::check(data));
