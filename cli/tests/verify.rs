//! `verify` through the binary: statistics and hashes against gguf-py's records, digests of shards
//! vs merged file, anomaly flags on hand-built models, reports and --against.

use gguf::{GgmlType, Metadata, Value};
use std::path::{Path, PathBuf};
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn verify(args: &[&str]) -> (i32, serde_json::Value) {
    let o = Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("verify")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    let code = o.status.code().unwrap();
    assert!(
        code == 0 || code == 1,
        "exit {code}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    (code, serde_json::from_slice(&o.stdout).unwrap())
}

fn tensors(r: &serde_json::Value) -> Vec<serde_json::Value> {
    r["tensors"].as_array().unwrap().clone()
}

/// The report's findings of one kind (e.g. "against", "layout").
fn findings_of_kind<'a>(r: &'a serde_json::Value, kind: &str) -> Vec<&'a serde_json::Value> {
    r["findings"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| f["kind"] == kind)
        .collect()
}

#[test]
fn stats_and_hashes_equal_gguf_py() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx("stats-tiny-glm5.json")).unwrap())
            .unwrap();
    for file in [
        "tiny-glm5-BF16.gguf",
        "tiny-glm5-Q4_K_M.gguf",
        "tiny-glm5-Q8_0.gguf",
        "tiny-glm5-Q6_K.gguf",
    ] {
        let path = fx(&format!("gguf/{file}"));
        assert!(
            path.exists(),
            "fixture {} is missing from tests/fixtures",
            path.display()
        );
        let (code, r) = verify(&[path.to_str().unwrap(), "--hash"]);
        assert_eq!(code, 0, "{file}: {:?}", r["findings"]);
        let rf = reference["files"]
            .as_array()
            .unwrap()
            .iter()
            .find(|f| f["file"] == file)
            .unwrap();
        let ours = tensors(&r);
        for (t, e) in ours.iter().zip(rf["tensors"].as_array().unwrap()) {
            assert_eq!(t["name"], e["name"]);
            assert_eq!(t["sha256"], e["sha256_raw"], "{file} {}", t["name"]);
            let d = &e["dequant_f32"];
            let s = &t["stats"];
            // min/max are single dequantized values: exact. mean/std are f64 sums of the same f32
            // values in a different order than numpy's pairwise sum: relative 1e-9 covers the
            // reordering error of ~1e6 f64 additions.
            assert_eq!(
                s["min"].as_f64(),
                d["min"].as_f64(),
                "{file} {} min",
                t["name"]
            );
            assert_eq!(
                s["max"].as_f64(),
                d["max"].as_f64(),
                "{file} {} max",
                t["name"]
            );
            for k in ["mean", "std"] {
                let (a, b) = (s[k].as_f64().unwrap(), d[k].as_f64().unwrap());
                assert!(
                    (a - b).abs() <= 1e-9 * b.abs().max(1e-6),
                    "{file} {} {k}: {a} vs {b}",
                    t["name"]
                );
            }
        }
    }
}

#[test]
fn shards_and_merged_file_have_the_same_digest() {
    let (_, merged) = verify(&[fx("gguf/tiny-glm5-Q4_K_M.gguf").to_str().unwrap(), "--hash"]);
    let (_, split) = verify(&[
        fx("gguf/split/tiny-glm5-Q4_K_M-00002-of-00003.gguf")
            .to_str()
            .unwrap(),
        "--hash",
    ]);
    assert_eq!(merged["digest"], split["digest"]);
    assert!(merged["digest"].as_str().unwrap().len() == 64);
    let (code, r) = verify(&[
        fx("gguf/split/tiny-glm5-Q4_K_M-00001-of-00003.gguf")
            .to_str()
            .unwrap(),
        "--against",
        fx("gguf/tiny-glm5-Q4_K_M.gguf").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{:?}", r["findings"]);
}

#[test]
fn against_a_different_model_lists_differences() {
    let (code, r) = verify(&[
        fx("gguf/tiny-glm5-Q4_K_M.gguf").to_str().unwrap(),
        "--against",
        fx("gguf/tiny-glm5-BF16.gguf").to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    let diffs = findings_of_kind(&r, "against");
    // Every quantized tensor differs in type; the F32 ones (norms, router) are identical.
    assert!(diffs.iter().any(|f| f["tensor"] == "blk.1.attn_q_a.weight"));
    assert!(!diffs
        .iter()
        .any(|f| f["tensor"] == "blk.1.attn_norm.weight"));
}

fn write_model(path: &Path, tensors: &[(&str, Vec<f32>)]) {
    let mut meta = Metadata::new(path);
    meta.set("general.architecture", Value::String("unknown-arch".into()));
    let bytes: Vec<Vec<u8>> = tensors
        .iter()
        .map(|(_, v)| v.iter().flat_map(|x| x.to_le_bytes()).collect())
        .collect();
    let dims: Vec<[u64; 1]> = tensors.iter().map(|(_, v)| [v.len() as u64]).collect();
    let parts: Vec<(&str, &[u64], GgmlType, &[u8])> = tensors
        .iter()
        .zip(&bytes)
        .zip(&dims)
        .map(|(((n, _), b), d)| (*n, &d[..], GgmlType::F32, &b[..]))
        .collect();
    std::fs::write(path, gguf::writer::build(&meta, &parts).unwrap()).unwrap();
}

/// Deterministic pseudo-normal-ish values with a given scale (no RNG crate needed).
fn values(n: usize, scale: f32, seed: u32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2654435761).wrapping_add(1);
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            ((s as f32 / u32::MAX as f32) - 0.5) * 2.0 * scale
        })
        .collect()
}

#[test]
fn flags_nan_zero_and_outliers() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.gguf");
    let mut ts: Vec<(String, Vec<f32>)> = Vec::new();
    for b in 0..8 {
        let scale = if b == 5 { 2.0 } else { 0.02 };
        ts.push((format!("blk.{b}.ffn_up.weight"), values(1024, scale, b)));
        let norm = if b == 3 {
            vec![40.0; 64]
        } else {
            vec![1.0 + b as f32 * 0.01; 64]
        };
        ts.push((format!("blk.{b}.attn_norm.weight"), norm));
    }
    let mut nan = values(64, 1.0, 99);
    nan[7] = f32::NAN;
    ts.push(("with_nan".into(), nan));
    ts.push(("zeros".into(), vec![0.0; 64]));
    let refs: Vec<(&str, Vec<f32>)> = ts.iter().map(|(n, v)| (n.as_str(), v.clone())).collect();
    write_model(&p, &refs);
    let (code, r) = verify(&[p.to_str().unwrap()]);
    assert_eq!(code, 1);
    let f = r["findings"].as_array().unwrap();
    let has = |kind: &str, t: &str| f.iter().any(|x| x["kind"] == kind && x["tensor"] == t);
    assert!(has("nan_inf", "with_nan"), "{f:?}");
    assert!(has("all_zero", "zeros"), "{f:?}");
    assert!(has("std_outlier", "blk.5.ffn_up.weight"), "{f:?}");
    assert!(has("norm_outlier", "blk.3.attn_norm.weight"), "{f:?}");
    // Siblings inside the normal spread are not flagged.
    assert!(
        !f.iter().any(|x| x["tensor"] == "blk.4.ffn_up.weight"),
        "{f:?}"
    );
}

#[test]
fn saved_report_round_trips_through_against() {
    let d = tempfile::tempdir().unwrap();
    let model = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let rep = d.path().join("r.json");
    let (code, _) = verify(&[
        model.to_str().unwrap(),
        "--hash",
        "--report",
        rep.to_str().unwrap(),
    ]);
    assert_eq!(code, 0);
    let (code, r) = verify(&[model.to_str().unwrap(), "--against", rep.to_str().unwrap()]);
    assert_eq!(code, 0, "{:?}", r["findings"]);
    // Flip one byte of one tensor in a copy: exactly that tensor differs.
    let copy = d.path().join("c.gguf");
    let mut bytes = std::fs::read(&model).unwrap();
    let f = gguf::GgufFile::open(&model).unwrap();
    let t = f
        .tensors()
        .iter()
        .find(|t| t.name == "blk.2.ffn_up_exps.weight")
        .unwrap();
    let at = (f.data_offset() + t.offset + 100) as usize;
    bytes[at] ^= 0x10;
    std::fs::write(&copy, bytes).unwrap();
    let (code, r) = verify(&[copy.to_str().unwrap(), "--against", rep.to_str().unwrap()]);
    assert_eq!(code, 1);
    let diffs = findings_of_kind(&r, "against");
    assert_eq!(diffs.len(), 1, "{diffs:?}");
    assert_eq!(diffs[0]["tensor"], "blk.2.ffn_up_exps.weight");
}

#[test]
fn architecture_check_runs_on_fixture() {
    let (_, r) = verify(&[fx("gguf/tiny-glm5-BF16.gguf").to_str().unwrap()]);
    let a = &r["arch_check"];
    assert!(a["missing_tensors"].as_array().unwrap().is_empty(), "{a}");
    assert!(a["wrong_shapes"].as_array().unwrap().is_empty(), "{a}");
}

#[test]
fn gap_between_tensors_is_reported() {
    // Hand-place tensor b 64 bytes after where the canonical layout puts it.
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("gap.gguf");
    let meta = Metadata::new(&p);
    let a = vec![1u8; 32];
    let b = vec![2u8; 32];
    let infos = vec![
        gguf::TensorInfo {
            name: "a".into(),
            dims: vec![8],
            ty: GgmlType::F32,
            offset: 0,
        },
        gguf::TensorInfo {
            name: "b".into(),
            dims: vec![8],
            ty: GgmlType::F32,
            offset: 96,
        },
    ];
    let layout = gguf::writer::Layout::with_offsets(3, &meta, infos).unwrap();
    let mut out = Vec::new();
    gguf::writer::write_file(&mut out, &layout, |i| if i == 0 { &a } else { &b }).unwrap();
    std::fs::write(&p, out).unwrap();
    let (code, r) = verify(&[p.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        !findings_of_kind(&r, "layout").is_empty(),
        "{}",
        r["findings"]
    );
}

#[test]
fn report_without_hashes_round_trips_exactly() {
    // Issue 17: statistics were compared after a lossy f64 -> JSON -> f64 round trip, giving
    // false "statistics differ" for the very same file.
    let d = tempfile::tempdir().unwrap();
    let rep = d.path().join("r.json");
    for file in ["gguf/tiny-glm5-Q4_K_M.gguf", "gguf/tiny-glm5-BF16.gguf"] {
        let model = fx(file);
        let (code, _) = verify(&[model.to_str().unwrap(), "--report", rep.to_str().unwrap()]);
        assert_eq!(code, 0);
        // The saved report has statistics, no hashes: the comparison is on the f64 values.
        let saved: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&rep).unwrap()).unwrap();
        assert!(saved["tensors"][0]["sha256"].is_null());
        let (code, r) = verify(&[model.to_str().unwrap(), "--against", rep.to_str().unwrap()]);
        assert_eq!(code, 0, "{file}: {:?}", r["findings"]);
    }
}

#[test]
fn metadata_changes_are_differences() {
    // Issue 17: --against ignored metadata (a chat template or name edited elsewhere).
    let d = tempfile::tempdir().unwrap();
    let model = fx("gguf/tiny-glm5-Q8_0.gguf");
    let rep = d.path().join("r.json");
    verify(&[model.to_str().unwrap(), "--report", rep.to_str().unwrap()]);
    // Rewrite the metadata with the gguf crate directly (an independent writer from `edit`).
    let f = gguf::GgufFile::open(&model).unwrap();
    let mut m = f.metadata().clone();
    m.set("general.name", Value::String("renamed".into()));
    m.remove("general.size_label");
    m.set("general.url", Value::String("https://example.org".into()));
    let layout = gguf::writer::Layout::with_offsets(3, &m, f.tensors().to_vec()).unwrap();
    let mut out = Vec::new();
    layout.write_header(&mut out).unwrap();
    out.extend_from_slice(&f.bytes()[f.data_offset() as usize..]);
    let edited = d.path().join("e.gguf");
    std::fs::write(&edited, out).unwrap();
    for against in [rep.to_str().unwrap(), model.to_str().unwrap()] {
        let (code, r) = verify(&[edited.to_str().unwrap(), "--against", against]);
        assert_eq!(code, 1, "against {against}");
        let m = findings_of_kind(&r, "against.metadata");
        let msgs: Vec<&str> = m.iter().map(|f| f["message"].as_str().unwrap()).collect();
        assert_eq!(msgs.len(), 3, "{msgs:?}");
        assert!(
            msgs.iter()
                .any(|s| s.starts_with("key general.name changed")),
            "{msgs:?}"
        );
        assert!(
            msgs.iter().any(|s| s.starts_with("key general.size_label")),
            "{msgs:?}"
        );
        assert!(
            msgs.iter().any(|s| s.starts_with("key general.url")),
            "{msgs:?}"
        );
        // No tensor differs.
        assert!(findings_of_kind(&r, "against").is_empty());
    }
}

#[test]
fn value_level_comparison_of_two_models() {
    // Q8_0 against its BF16 source: per tensor max abs error, RMSE and cosine similarity.
    let (code, r) = verify(&[
        fx("gguf/tiny-glm5-Q8_0.gguf").to_str().unwrap(),
        "--against",
        fx("gguf/tiny-glm5-BF16.gguf").to_str().unwrap(),
    ]);
    assert_eq!(code, 1); // types differ
    let cmp = r["comparison"].as_array().unwrap();
    assert_eq!(cmp.len(), 94);
    let bf16 = gguf::Model::open(fx("gguf/tiny-glm5-BF16.gguf")).unwrap();
    for c in cmp {
        let name = c["name"].as_str().unwrap();
        let (max, rmse, cos) = (
            c["max_abs_error"].as_f64().unwrap(),
            c["rmse"].as_f64().unwrap(),
            c["cosine"].as_f64().unwrap(),
        );
        if c["type"] == c["other_type"] {
            assert_eq!((max, rmse, cos), (0.0, 0.0, 1.0), "{name}");
            continue;
        }
        // Q8_0 error per value is at most half a step d/2 (d = block amax / 127) plus the f16
        // rounding of d times |q| <= 127 (relative 2^-11): < d <= tensor absmax / 127.
        let t = bf16.tensor(name).unwrap();
        let x = gguf::quant::dequantize_to_vec(t.info.ty, bf16.data(&t)).unwrap();
        let absmax = x.iter().fold(0f32, |m, v| m.max(v.abs())) as f64;
        assert!(
            max > 0.0 && max <= absmax / 127.0,
            "{name}: {max} vs {absmax}"
        );
        assert!(rmse <= max, "{name}");
        assert!(cos > 0.999 && cos <= 1.0 + 1e-12, "{name}: {cos}");
    }
}
