//! Dequantization against gguf-py 0.19.0: `tests/fixtures/quant-golden` holds random blocks and
//! `gguf.quants.dequantize`'s output for them (written by tests/dev/gen_quant_golden.py). Both
//! the reference and the fast dequantizer must reproduce every value bit for bit; NaNs only need
//! to be NaN (payload propagation is not part of any format).

use gguf::quant::{dequantize, dequantize_row, reference, QuantError};
use gguf::GgmlType;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

fn golden_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures/quant-golden")
}

fn read(name: &str) -> Vec<u8> {
    let p = golden_dir().join(name);
    std::fs::read(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

fn sha256_hex(b: &[u8]) -> String {
    Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// The signature shared by the reference, fast and row dequantizers.
type Dequantize = fn(GgmlType, &[u8], &mut [f32]) -> Result<(), QuantError>;

/// Index and values of the first element whose bits differ (NaN equals any NaN).
fn first_mismatch(got: &[f32], want: &[f32]) -> Option<(usize, f32, f32)> {
    got.iter()
        .zip(want)
        .enumerate()
        .find(|(_, (g, w))| !(g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan())))
        .map(|(i, (g, w))| (i, *g, *w))
}

#[test]
fn every_type_matches_gguf_py_bit_for_bit() {
    let manifest: serde_json::Value = serde_json::from_slice(&read("MANIFEST.json"))
        .unwrap_or_else(|e| panic!("MANIFEST.json: {e}"));
    let types = manifest["types"]
        .as_object()
        .unwrap_or_else(|| panic!("MANIFEST.json: no types"));
    // Everything gguf-py 0.19.0 can dequantize; the others (Q8_1, Q8_K, Q1_0, F64, I*) have
    // hand-computed tests in quant_handmade.rs.
    let expected_types = [
        "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K",
        "Q5_K", "Q6_K", "TQ1_0", "TQ2_0", "MXFP4", "NVFP4", "IQ2_XXS", "IQ2_XS", "IQ2_S",
        "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ1_M", "IQ4_NL", "IQ4_XS",
    ];
    let mut names: Vec<&str> = types.keys().map(String::as_str).collect();
    names.sort();
    let mut want_names = expected_types.to_vec();
    want_names.sort();
    assert_eq!(
        names, want_names,
        "golden data covers a different set of types"
    );

    let mut failures = Vec::new();
    for (name, entry) in types {
        let ty = GgmlType::from_name(name).unwrap_or_else(|| panic!("unknown type {name}"));
        let blocks = read(&format!("{name}.bin"));
        let expected_bytes = read(&format!("{name}.f32"));
        assert_eq!(
            sha256_hex(&blocks),
            entry["sha256_bin"].as_str().unwrap_or(""),
            "{name}.bin"
        );
        assert_eq!(
            sha256_hex(&expected_bytes),
            entry["sha256_f32"].as_str().unwrap_or(""),
            "{name}.f32"
        );
        let expected: Vec<f32> = expected_bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(
            expected.len() as u64,
            entry["n_elements"].as_u64().unwrap_or(0),
            "{name}"
        );

        // Every public path must agree with gguf-py; `got` is cleared before each so a path
        // that writes nothing cannot pass on the previous path's output.
        let paths: [(&str, Dequantize); 3] = [
            ("reference", reference::dequantize),
            ("fast", dequantize),
            ("row", dequantize_row),
        ];
        let mut got = vec![0.0f32; expected.len()];
        for (path, run) in paths {
            got.fill(0.0);
            run(ty, &blocks, &mut got).unwrap_or_else(|e| panic!("{name}: {e}"));
            if let Some(m) = first_mismatch(&got, &expected) {
                failures.push(format!(
                    "{name} {path}: element {} = {:e}, gguf-py {:e}",
                    m.0, m.1, m.2
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn length_errors_are_typed() {
    let mut out = vec![0.0f32; 256];
    assert_eq!(
        dequantize(GgmlType::Q4_K, &[0u8; 143], &mut out),
        Err(QuantError::PartialBlock {
            ty: GgmlType::Q4_K,
            len: 143,
            block_bytes: 144
        })
    );
    assert_eq!(
        reference::dequantize(GgmlType::Q4_K, &[0u8; 144], &mut out[..255]),
        Err(QuantError::OutputLength {
            ty: GgmlType::Q4_K,
            in_bytes: 144,
            expected: 256,
            got: 255
        })
    );
    assert!(dequantize_row(GgmlType::BF16, &[0u8; 3], &mut out[..1]).is_err());
    assert_eq!(
        gguf::quant::dequantize_to_vec(GgmlType::Q8_0, &[]),
        Ok(vec![])
    );
}
