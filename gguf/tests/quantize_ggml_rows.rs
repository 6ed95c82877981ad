//! The low-bit grid quantizers against ggml's own `ggml_quantize_chunk` on synthetic rows,
//! including the paths llama-quantize never takes (IQ2_S and IQ1_M without an importance
//! matrix) and many exact ties (the IQ1 sorts). Golden sha256s in
//! `tests/fixtures/quantize/ggml-quantize-rows.json`, made by
//! `tests/dev/gen_ggml_rows_golden.sh`, which builds the same rows with the generator below.

use gguf::quant::quantize::quantize_rows;
use gguf::GgmlType;
use sha2::{Digest, Sha256};

const N: usize = 512;
const ROWS: usize = 8;

/// The script's 64-bit LCG: values in [-0.5, 0.5).
fn lcg(seed: u64) -> impl FnMut() -> f64 {
    let mut s = seed;
    move || {
        s = s
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        (s >> 40) as f64 / 16777216.0 - 0.5
    }
}

/// The rows exactly as the script computes them (in f64, rounded once to f32).
fn rows() -> Vec<f32> {
    let mut g = lcg(17);
    (0..N * ROWS)
        .map(|i| {
            let u = g();
            let mut v = u * u * u * 8.0 + u * 0.1;
            if i % 5 == 0 {
                v = (v * 16.0 + 0.5).floor() / 16.0;
            }
            let (r, c) = (i / N, i % N);
            if r == 3 && c >= 256 {
                v = 0.0;
            } else if r == 5 && c < 256 {
                v *= 1e-9;
            } else if r == 6 && c < 256 {
                v *= 1e-14;
            }
            if i % 97 == 0 {
                v = 0.0;
            } else if i % 89 == 0 {
                v = -0.0;
            }
            v as f32
        })
        .collect()
}

fn imatrix() -> Vec<f32> {
    let mut g = lcg(23);
    (0..N)
        .map(|_| {
            let u = g();
            (u * u + 0.01) as f32
        })
        .collect()
}

#[test]
fn grid_quantizers_equal_ggml_on_synthetic_rows() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../tests/fixtures/quantize/ggml-quantize-rows.json"
    );
    let golden: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(path).expect("golden file")).expect("json");
    let outputs = golden["outputs"].as_object().expect("outputs");
    assert_eq!(outputs.len(), 6);
    let x = rows();
    let w = imatrix();
    let mut bad = Vec::new();
    for (key, want) in outputs {
        let (name, with_w) = match key.strip_suffix("+imatrix") {
            Some(n) => (n, true),
            None => (key.as_str(), false),
        };
        let ty = GgmlType::from_name(name).expect("type name");
        let mut out = vec![0u8; ROWS * N / ty.block_size() * ty.type_size()];
        assert_eq!(Some(out.len() as u64), want["bytes"].as_u64(), "{key}");
        quantize_rows(ty, &x, N, with_w.then_some(w.as_slice()), &mut out)
            .unwrap_or_else(|e| panic!("{key}: {e}"));
        let got: String = Sha256::digest(&out)
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        if Some(got.as_str()) != want["sha256"].as_str() {
            bad.push(key.clone());
        }
    }
    assert!(bad.is_empty(), "differ from ggml: {bad:?}");
}
