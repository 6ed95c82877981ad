//! `quantize` through the binary against llama-quantize: the three fixture files byte by byte,
//! every other file type by the sha256 of llama-quantize's output recorded in
//! `tests/fixtures/quantize/llama-quantize-tiny-glm5.json` (made by
//! `tests/dev/gen_quantize_golden.sh`), the types llama-quantize refuses refused too, and the
//! streaming/atomic-output behaviour (split output, no partial file left on failure).

use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn bf16() -> PathBuf {
    fx("gguf/tiny-glm5-BF16.gguf")
}

fn quantize(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("quantize")
        .args(args)
        .output()
        .expect("run gguftool")
}

fn run_ok(input: &Path, out: &Path, ty: &str, extra: &[&str]) {
    let mut a: Vec<&std::ffi::OsStr> = vec![input.as_os_str(), out.as_os_str(), ty.as_ref()];
    a.extend(extra.iter().map(|s| std::ffi::OsStr::new(*s)));
    a.push("-q".as_ref());
    let o = quantize(&a);
    assert!(
        o.status.success(),
        "quantize {ty}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

fn sha256_hex(p: &Path) -> String {
    let b = std::fs::read(p).expect("read output");
    Sha256::digest(&b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

fn golden() -> serde_json::Value {
    let p = fx("quantize/llama-quantize-tiny-glm5.json");
    serde_json::from_str(&std::fs::read_to_string(&p).expect("golden file")).expect("json")
}

#[test]
fn fixture_types_are_byte_identical() {
    let dir = tempfile::tempdir().unwrap();
    for ty in ["Q8_0", "Q6_K", "Q4_K_M"] {
        let out = dir.path().join(format!("{ty}.gguf"));
        run_ok(&bf16(), &out, ty, &[]);
        let want = std::fs::read(fx(&format!("gguf/tiny-glm5-{ty}.gguf"))).unwrap();
        let got = std::fs::read(&out).unwrap();
        assert!(got == want, "{ty}: output differs from llama-quantize's");
    }
}

#[test]
fn every_type_llama_quantize_makes_is_byte_identical() {
    let g = golden();
    let outputs = g["outputs"].as_object().unwrap();
    assert!(
        outputs.len() >= 24,
        "golden file lists {} types",
        outputs.len()
    );
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    for (ty, want) in outputs {
        let out = dir.path().join(format!("{ty}.gguf"));
        run_ok(&bf16(), &out, ty, &[]);
        let size = std::fs::metadata(&out).unwrap().len();
        if sha256_hex(&out) != want["sha256"].as_str().unwrap()
            || size != want["bytes"].as_u64().unwrap()
        {
            // Name the first tensor that differs, for the failure message.
            let r = Command::new(env!("CARGO_BIN_EXE_gguftool"))
                .args(["verify", "--hash", "--json", "-q"])
                .arg(&out)
                .output()
                .unwrap();
            let rep: serde_json::Value = serde_json::from_slice(&r.stdout).unwrap_or_default();
            let first = want["tensors"].as_array().unwrap().iter().find(|w| {
                !rep["tensors"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|t| t["name"] == w[0] && t["type"] == w[1] && t["sha256"] == w[2])
            });
            bad.push(format!("{ty} (first differing tensor {first:?})"));
        }
        std::fs::remove_file(&out).unwrap();
    }
    assert!(bad.is_empty(), "differ from llama-quantize: {bad:?}");
}

#[test]
fn types_llama_quantize_refuses_are_refused() {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    for (ty, why) in g["refused"].as_object().unwrap() {
        let out = dir.path().join("x.gguf");
        let o = quantize(&[bf16().as_os_str(), out.as_os_str(), ty.as_ref()]);
        assert_eq!(
            o.status.code(),
            Some(2),
            "{ty} should fail like llama-quantize ({why})"
        );
        let err = String::from_utf8_lossy(&o.stderr);
        if why.as_str().unwrap().contains("imatrix") {
            assert!(err.contains("importance matrix"), "{ty}: {err}");
        }
        assert!(!out.exists(), "{ty}: output left behind");
        assert!(!dir.path().join("x.gguf.partial").exists());
    }
}

#[test]
fn split_input_and_split_output() {
    // The split fixture is Q4_K_M: requantize it to Q8_0 with shards of at most 2 MB, then
    // merge and compare with quantizing the merged model directly.
    let dir = tempfile::tempdir().unwrap();
    let shard = fx("gguf/split/tiny-glm5-Q4_K_M-00001-of-00003.gguf");
    let whole = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let a = dir.path().join("a.gguf");
    run_ok(&whole, &a, "Q8_0", &["--allow-requantize"]);
    let prefix = dir.path().join("b");
    run_ok(
        &shard,
        &prefix,
        "Q8_0",
        &["--allow-requantize", "--split-max-size", "2M"],
    );
    let mut shards: Vec<PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("b-"))
        .collect();
    shards.sort();
    // 7.9 MB of tensor data in shards of at most 2 MB.
    assert!(shards.len() >= 4, "shards: {shards:?}");
    for s in &shards[..shards.len() - 1] {
        assert!(std::fs::metadata(s).unwrap().len() <= 2_100_000, "{s:?}");
    }
    let first = shards[0].clone();
    assert!(first
        .to_string_lossy()
        .ends_with(&format!("-00001-of-{:05}.gguf", shards.len())));
    let merged = dir.path().join("m.gguf");
    let o = Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .args(["merge", "-q"])
        .arg(&first)
        .arg("-o")
        .arg(&merged)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&a).unwrap() == std::fs::read(&merged).unwrap());
}

#[test]
fn requantizing_needs_the_flag_and_leaves_nothing_behind() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("r.gguf");
    let o = quantize(&[
        fx("gguf/tiny-glm5-Q8_0.gguf").as_os_str(),
        out.as_os_str(),
        "Q4_0".as_ref(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--allow-requantize"));
    assert!(!out.exists());
}

#[test]
fn overrides_and_dry_run() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("o.gguf");
    let o = quantize(&[
        bf16().as_os_str(),
        out.as_os_str(),
        "Q4_K_M".as_ref(),
        "--tensor-type".as_ref(),
        "ATTN_K_B=q8_0".as_ref(),
        "--output-tensor-type".as_ref(),
        "f16".as_ref(),
        "--token-embedding-type".as_ref(),
        "q8_0".as_ref(),
        "--dry-run".as_ref(),
        "--json".as_ref(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(!out.exists(), "dry run wrote a file");
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let ty = |n: &str| {
        v["tensors"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["name"] == n)
            .map(|t| t["new_type"].as_str().unwrap().to_string())
            .unwrap()
    };
    // The pattern is lower-cased like llama-quantize does; Q8_0 rows of 64 fit.
    assert_eq!(ty("blk.0.attn_k_b.weight"), "Q8_0");
    assert_eq!(ty("output.weight"), "F16");
    assert_eq!(ty("token_embd.weight"), "Q8_0");
    assert_eq!(ty("blk.0.attn_norm.weight"), "F32");
    // Without overrides attn_k_b (64 columns) falls back from Q4_K to Q5_0.
    let o = quantize(&[
        bf16().as_os_str(),
        out.as_os_str(),
        "Q4_K_M".as_ref(),
        "--dry-run".as_ref(),
        "--json".as_ref(),
    ]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let k_b = v["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == "blk.0.attn_k_b.weight")
        .unwrap()
        .clone();
    assert_eq!(k_b["new_type"], "Q5_0");
}

/// `quantize --imatrix tiny-glm5-imatrix.gguf [EXTRA] ../gguf/tiny-glm5-BF16.gguf OUT TYPE`
/// run from tests/fixtures/quantize: the same relative paths llama-quantize was given, since the
/// imatrix file name is recorded in quantize.imatrix.file.
fn quantize_with_imatrix(extra: &[&str], out: &Path, ty: &str) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .current_dir(fx("quantize"))
        .args(["quantize", "--imatrix", "tiny-glm5-imatrix.gguf"])
        .args(extra)
        .arg("../gguf/tiny-glm5-BF16.gguf")
        .arg(out)
        .args([ty, "-q"])
        .output()
        .unwrap()
}

/// Types of a golden section whose output's sha256 differs.
fn differing(section: &str, extra: &[&str]) -> Vec<String> {
    let g = golden();
    let dir = tempfile::tempdir().unwrap();
    let mut bad = Vec::new();
    for (ty, want) in g[section].as_object().unwrap() {
        let out = dir.path().join(format!("{ty}.gguf"));
        let o = quantize_with_imatrix(extra, &out, ty);
        assert!(
            o.status.success(),
            "{ty}: {}",
            String::from_utf8_lossy(&o.stderr)
        );
        if sha256_hex(&out) != want["sha256"].as_str().unwrap() {
            bad.push(ty.clone());
        }
        std::fs::remove_file(&out).unwrap();
    }
    bad
}

#[test]
fn with_an_importance_matrix_every_type_is_byte_identical() {
    assert_eq!(golden()["imatrix_outputs"].as_object().unwrap().len(), 18);
    let bad = differing("imatrix_outputs", &[]);
    assert!(
        bad.is_empty(),
        "differ from llama-quantize --imatrix: {bad:?}"
    );
}

#[test]
fn imatrix_that_misses_tensors_refuses_low_bit_types() {
    // The fixture imatrix has no entries for the MTP block (llama-imatrix never runs it), so
    // Q2_K_S fails exactly as in llama-quantize.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let o = quantize_with_imatrix(&[], &out, "Q2_K_S");
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("blk.3."));
    assert!(!out.exists());
}

#[test]
fn importance_matrix_types_are_byte_identical() {
    assert_eq!(
        golden()["imatrix_override_outputs"]
            .as_object()
            .unwrap()
            .len(),
        9
    );
    let bad = differing(
        "imatrix_override_outputs",
        &["--tensor-type", r"blk\.3\.=q8_0"],
    );
    assert!(bad.is_empty(), "differ from llama-quantize: {bad:?}");
}

#[test]
fn a_type_without_a_quantizer_is_refused_and_nothing_written() {
    // NVFP4 can be read but gguftool has no quantizer for it: a clear refusal, no output.
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("x.gguf");
    let input = bf16();
    let a: Vec<&std::ffi::OsStr> = vec![
        input.as_os_str(),
        out.as_os_str(),
        "Q8_0".as_ref(),
        "--tensor-type".as_ref(),
        r"output\.weight=nvfp4".as_ref(),
        "-q".as_ref(),
    ];
    let o = quantize(&a);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("NVFP4 is not implemented yet"), "{err}");
    assert!(!out.exists());
    assert!(!dir.path().join("x.gguf.partial").exists());
}
