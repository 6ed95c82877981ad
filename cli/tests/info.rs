//! `info` through the binary: tables equal gguf-py's records, shards describe the whole model,
//! bad input gives exit 2 and a one-line error naming the file.

use std::path::PathBuf;
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn info(args: &[&str]) -> serde_json::Value {
    let o = Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("info")
        .args(args)
        .arg("--json")
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).unwrap()
}

#[test]
fn tensor_tables_and_metadata_equal_gguf_py() {
    let reference: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fx("stats-tiny-glm5.json")).unwrap())
            .unwrap();
    for rf in reference["files"].as_array().unwrap() {
        let name = rf["file"].as_str().unwrap();
        let path = if name.contains("-of-") {
            fx(&format!("gguf/split/{name}"))
        } else {
            fx(&format!("gguf/{name}"))
        };
        assert!(
            path.exists(),
            "fixture {} is missing from tests/fixtures",
            path.display()
        );
        let r = info(&[
            path.to_str().unwrap(),
            "--tensors",
            "--shard-only",
            "--full",
        ]);
        let ours = r["tensors"].as_array().unwrap();
        let theirs = rf["tensors"].as_array().unwrap();
        assert_eq!(ours.len(), theirs.len(), "{name}");
        for (t, e) in ours.iter().zip(theirs) {
            assert_eq!(t["name"], e["name"], "{name}");
            assert_eq!(t["type"], e["type"], "{name}");
            assert_eq!(t["ne"], e["ne"], "{name}");
            assert_eq!(t["shape"], e["shape_rowmajor"], "{name}");
            assert_eq!(t["n_bytes"], e["n_bytes"], "{name}");
            assert_eq!(t["offset"], e["data_offset"], "{name}");
        }
        let meta = r["metadata"].as_array().unwrap();
        let rmeta = rf["metadata"].as_object().unwrap();
        assert_eq!(meta.len(), rmeta.len(), "{name}");
        for (m, (k, v)) in meta.iter().zip(rmeta) {
            assert_eq!(m["key"].as_str().unwrap(), k, "{name}");
            assert_eq!(m["type"], v["type"], "{name} {k}");
        }
        assert_eq!(r["files"][0]["size"], rf["size"], "{name}");
    }
}

#[test]
fn a_shard_describes_the_whole_model() {
    let whole = info(&[fx("gguf/tiny-glm5-Q4_K_M.gguf").to_str().unwrap()]);
    let shard = info(&[fx("gguf/split/tiny-glm5-Q4_K_M-00002-of-00003.gguf")
        .to_str()
        .unwrap()]);
    assert_eq!(shard["n_tensors"], 94);
    assert_eq!(shard["parameters"], whole["parameters"]);
    assert_eq!(shard["architecture"], "glm-dsa");
    assert_eq!(shard["split"]["shards"], 3);
    assert_eq!(shard["file_type"]["name"], "Q4_K_M");
    let one = info(&[
        fx("gguf/split/tiny-glm5-Q4_K_M-00002-of-00003.gguf")
            .to_str()
            .unwrap(),
        "--shard-only",
    ]);
    assert_eq!(one["n_tensors"], 32);
}

#[test]
fn filter_selects_tensors() {
    let r = info(&[
        fx("gguf/tiny-glm5-Q4_K_M.gguf").to_str().unwrap(),
        "--filter",
        "blk.1.*_exps*",
    ]);
    let names: Vec<&str> = r["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["name"].as_str().unwrap())
        .collect();
    assert_eq!(names.len(), 3, "gate/up/down experts of block 1: {names:?}");
    assert!(names
        .iter()
        .all(|n| n.starts_with("blk.1.ffn_") && n.contains("_exps")));
}

#[test]
fn bad_input_is_exit_2_with_one_line() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("bad.gguf");
    std::fs::write(
        &p,
        b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff\xff\xff\xff\xff\x00\x00\x00\x00\x00\x00\x00\x00",
    )
    .unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .args(["info", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    assert!(err.contains("bad.gguf") && err.contains("at byte"), "{err}");
}
