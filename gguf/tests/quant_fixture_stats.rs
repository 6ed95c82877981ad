//! Every tensor of every fixture GGUF (BF16, Q8_0, Q6_K, Q4_K_M and the Q4_K_M split shards):
//! the raw bytes hash to the reference's sha256_raw, and the statistics of our dequantized values
//! equal the reference's (gguf-py `dequantize` to f32, numpy float64 statistics) in
//! stats-tiny-glm5.json. Tensor bytes are located with the JSON's absolute data_offset/n_bytes
//! and plain file reads, independent of the container reader.
//!
//! min and max must be exact: they are single dequantized f32 values. The JSON prints floats with
//! 16 significant digits (0.36505889892578125 appears as 0.3650588989257813), which pins down an
//! f32 uniquely (f32 needs 9), so they are compared as f32: the JSON value rounded to the nearest
//! f32 must be our value, bit for bit. mean, std and sum_sq are
//! f64 sums of the same f32 values taken in a different order; the error of any order of an
//! n-term f64 sum is at most (n-1)·eps·sum|x|, so each side is within n·eps·(rms·n) of the exact
//! sum, and the tolerance below is twice that, divided by n for the mean.

use gguf::quant::{dequantize_to_vec, reference};
use gguf::stats::tensor_stats;
use gguf::GgmlType;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// `tests/fixtures/<rel>`; a missing fixture fails the test (the repo carries them all).
fn fixture(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    assert!(p.exists(), "fixture {rel} is missing from tests/fixtures");
    p
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

struct Check {
    what: String,
    failures: Vec<String>,
}

impl Check {
    /// `got` is an f32 widened to f64; `want` the same value printed to 16 digits.
    fn same_f32(&mut self, field: &str, got: f64, want: f64) {
        if (got as f32).to_bits() != (want as f32).to_bits() || f64::from(got as f32) != got {
            self.failures
                .push(format!("{}: {field} {got:e} != {want:e}", self.what));
        }
    }

    fn exact(&mut self, field: &str, got: f64, want: f64) {
        if got != want {
            self.failures
                .push(format!("{}: {field} {got:e} != {want:e}", self.what));
        }
    }

    fn close(&mut self, field: &str, got: f64, want: f64, tol: f64) {
        if (got - want).abs() > tol {
            self.failures.push(format!(
                "{}: {field} {got:e} vs {want:e} (|diff| {:e} > tol {tol:e})",
                self.what,
                (got - want).abs()
            ));
        }
    }
}

#[test]
fn fixture_tensor_stats_match_gguf_py() {
    let json_path = fixture("stats-tiny-glm5.json");
    let json: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&json_path).unwrap_or_default())
            .unwrap_or_else(|e| panic!("{}: {e}", json_path.display()));
    let files = json["files"]
        .as_array()
        .unwrap_or_else(|| panic!("no files in stats json"));
    let mut check = Check {
        what: String::new(),
        failures: Vec::new(),
    };
    let mut n_tensors = 0;
    let mut types_seen = std::collections::BTreeSet::new();
    for f in files {
        let name = f["file"].as_str().unwrap_or_default();
        let rel = if name.contains("-of-") {
            format!("gguf/split/{name}")
        } else {
            format!("gguf/{name}")
        };
        let path = fixture(&rel);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        for t in f["tensors"]
            .as_array()
            .unwrap_or_else(|| panic!("{name}: no tensors"))
        {
            let tname = t["name"].as_str().unwrap_or_default();
            check.what = format!("{name} {tname}");
            let ty = GgmlType::from_name(t["type"].as_str().unwrap_or_default())
                .unwrap_or_else(|| panic!("{}: unknown type {}", check.what, t["type"]));
            let start = t["data_offset"].as_u64().unwrap_or(u64::MAX) as usize;
            let len = t["n_bytes"].as_u64().unwrap_or(u64::MAX) as usize;
            let data = bytes
                .get(start..start.saturating_add(len))
                .unwrap_or_else(|| panic!("{}: bytes out of file", check.what));
            assert_eq!(
                hex(&Sha256::digest(data)),
                t["sha256_raw"].as_str().unwrap_or(""),
                "{}",
                check.what
            );

            let s = tensor_stats(ty, data).unwrap_or_else(|e| panic!("{}: {e}", check.what));
            let r = &t["dequant_f32"];
            let n = t["n_elements"].as_u64().unwrap_or(0);
            assert_eq!(s.count, n, "{}", check.what);
            let field = |k: &str| r[k].as_f64().unwrap_or(f64::NAN);
            let rms = (field("sum_sq") / n as f64).sqrt();
            let tol = |v: f64| 2.0 * n as f64 * f64::EPSILON * (rms + v.abs());
            check.same_f32("min", s.min, field("min"));
            check.same_f32("max", s.max, field("max"));
            check.close("mean", s.mean, field("mean"), tol(field("mean")));
            check.close("std", s.std, field("std"), tol(field("std")));
            check.close("sum_sq", s.sum_sq, field("sum_sq"), tol(field("sum_sq")));
            check.exact("n_nan", s.n_nan as f64, field("n_nan"));
            check.exact("n_inf", s.n_inf as f64, field("n_inf"));

            // The scalar oracle on real model data, reduced by a plain two-pass loop here.
            let mut values = vec![0.0f32; n as usize];
            reference::dequantize(ty, data, &mut values)
                .unwrap_or_else(|e| panic!("{}: {e}", check.what));
            let mean = values.iter().map(|&v| f64::from(v)).sum::<f64>() / n as f64;
            let var = values
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n as f64;
            let min = values.iter().copied().fold(f32::INFINITY, f32::min);
            let max = values.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            check.same_f32("reference min", f64::from(min), field("min"));
            check.same_f32("reference max", f64::from(max), field("max"));
            check.close("reference mean", mean, field("mean"), tol(field("mean")));
            check.close("reference std", var.sqrt(), field("std"), tol(field("std")));
            // And the fast path gives the oracle's bits.
            let fast = dequantize_to_vec(ty, data).unwrap_or_default();
            if fast
                .iter()
                .zip(&values)
                .any(|(a, b)| a.to_bits() != b.to_bits())
            {
                check.failures.push(format!(
                    "{}: fast and reference dequantization differ",
                    check.what
                ));
            }
            n_tensors += 1;
            types_seen.insert(ty.name());
        }
    }
    assert!(check.failures.is_empty(), "{}", check.failures.join("\n"));
    println!("checked {n_tensors} tensors of types {types_seen:?}");
    if n_tensors > 0 {
        for ty in ["BF16", "F32", "Q4_K", "Q5_0", "Q6_K", "Q8_0"] {
            assert!(types_seen.contains(ty), "fixtures did not exercise {ty}");
        }
    }
}
