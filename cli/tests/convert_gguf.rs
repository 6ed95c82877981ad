//! `convert HF_DIR --to gguf` through the binary: split output that `merge` turns back into the
//! converter's single file, the --json summary, refusals (exit 2, nothing left behind, inputs
//! untouched), and the one-line summary of the GGUF -> safetensors direction.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fx(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    assert!(
        p.exists(),
        "fixture {} missing from tests/fixtures",
        p.display()
    );
    p
}

fn run(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .args(args)
        .output()
        .unwrap()
}

fn checkpoint(tmp: &Path) -> PathBuf {
    let dir = tmp.join("tiny-glm5");
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fx("hf")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".partial") || n.ends_with(".gguf"))
        .collect()
}

#[test]
fn split_conversion_merges_back_to_the_converters_file() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path());
    let out = tmp.path().join("out");
    std::fs::create_dir(&out).unwrap();
    let o = run(&[
        "convert",
        s(&dir),
        "--to",
        "gguf",
        s(&out.join("m.gguf")),
        "--outtype",
        "bf16",
        "--split-max-tensors",
        "32",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(j["schema"], "gguftool.convert-gguf/1");
    assert_eq!(j["shards"], 3);
    assert_eq!(j["tensors"], 94);
    assert_eq!(j["name"], "Tiny Glm5");
    assert_eq!(j["files"].as_array().unwrap().len(), 3);
    let mut names = leftovers(&out);
    names.sort();
    assert_eq!(
        names,
        [
            "m-00001-of-00003.gguf",
            "m-00002-of-00003.gguf",
            "m-00003-of-00003.gguf"
        ]
    );
    let merged = tmp.path().join("merged.gguf");
    let o = run(&[
        "merge",
        s(&out.join("m-00001-of-00003.gguf")),
        "-o",
        s(&merged),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let want = std::fs::read(fx("gguf/tiny-glm5-BF16.gguf")).unwrap();
    assert!(
        std::fs::read(&merged).unwrap() == want,
        "merge of the split conversion differs"
    );
}

#[test]
fn refusals_leave_nothing_behind() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path());
    let out = tmp.path().join("o.gguf");
    // existing output without --force
    std::fs::write(&out, b"keep me").unwrap();
    let o = run(&["convert", s(&dir), s(&out)]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(&out).unwrap(), b"keep me");
    // flags of the other direction
    let o = run(&["convert", s(&dir), s(&out), "--force", "--dtype", "f16"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--dtype"));
    // an input file as the output
    let shard = dir.join("model-00001-of-00004.safetensors");
    let before = std::fs::read(&shard).unwrap();
    let o = run(&["convert", s(&dir), s(&shard), "--force"]);
    assert_eq!(
        o.status.code(),
        Some(2),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    assert!(
        std::fs::read(&shard).unwrap() == before,
        "an input was overwritten"
    );
    // a broken checkpoint: the error names the file, no partial output stays
    std::fs::write(dir.join("config.json"), b"{ not json").unwrap();
    let o = run(&["convert", s(&dir), s(&tmp.path().join("x.gguf"))]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("config.json"));
    let mut left = leftovers(tmp.path());
    left.sort();
    assert_eq!(left, ["o.gguf"]);
}

#[test]
fn to_safetensors_summarizes_tensors_kept_wide_in_one_line() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("hf");
    let o = run(&[
        "convert",
        s(&fx("gguf/tiny-glm5-Q4_K_M.gguf")),
        "--to",
        "safetensors",
        s(&out),
        "--dtype",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = String::from_utf8_lossy(&o.stdout).to_string();
    let line = text
        .lines()
        .find(|l| l.starts_with("kept wider"))
        .expect("a kept-wide line");
    assert!(line.len() < 400, "one short line, got {} bytes", line.len());
    assert!(line.contains("bf16-round"));
    // the lossy option stores every tensor as bf16
    let out2 = tmp.path().join("hf2");
    let o = run(&[
        "convert",
        s(&fx("gguf/tiny-glm5-Q4_K_M.gguf")),
        "--to",
        "safetensors",
        s(&out2),
        "--dtype",
        "bf16-round",
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let j: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        j["dtypes"].as_object().unwrap().keys().collect::<Vec<_>>(),
        ["BF16"]
    );
    assert_eq!(j["kept_wide"].as_array().unwrap().len(), 0);
}
