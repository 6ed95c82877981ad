//! libFuzzer target: see `serving_checks::check_tokenizer` for the properties (the stable test suite
//! runs the same checks: `serving/tests/fuzz_smoke.rs`).

#![no_main]

#[path = "../src/serving_checks.rs"]
mod serving_checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| serving_checks::check_tokenizer(data));
