//! `doctor` through the binary: the healthy fixtures pass (exit 0, warnings allowed); models
//! broken on purpose, byte by byte from the fixtures, are named by the right check with the right
//! tensor, layer or shard; checks 1-2 read no tensor data, even of a 400 GB model.
//!
//! Which check catches which fault (and why no earlier one can):
//! - truncated shard, shard of another split or another model: check 1 (headers);
//! - attn_k_b/attn_v_b swapped in the tensor table, kv_b stored transposed: check 2 (shapes)
//!   and check 4 (the kv_b diagnosis);
//! - NaN-filled tensor, zeroed norm, one corrupted quant block: check 3 (values);
//! - what only the numbers of a forward pass show (shapes and statistics intact): RoPE dims laid
//!   out half-split, experts stacked out of order, k_b/v_b data swapped or the key part left
//!   untransposed under the right shapes, a shard holding another model's weights: check 7
//!   against the saved transformers activations (`--activations`), and for the kv_b faults
//!   check 4 against the HF checkpoint (`--hf`).

use gguf::{GgmlType, GgufFile, Metadata, TensorInfo, Value, ValueType};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    assert!(p.exists(), "fixture {rel} missing from tests/fixtures");
    p
}

const DUMP: &str = "refs/activations-counting.safetensors";

fn gguftool(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .args(args)
        .output()
        .unwrap()
}

/// `doctor ARGS --json`: exit code and the parsed report.
fn doctor(args: &[&str]) -> (i32, Json) {
    doctor_env(args, None)
}

/// [`doctor`] with `GGUFTOOL_PYTHON` set.
fn doctor_env(args: &[&str], python: Option<&Path>) -> (i32, Json) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_gguftool"));
    cmd.arg("doctor").args(args).arg("--json");
    if let Some(p) = python {
        cmd.env("GGUFTOOL_PYTHON", p);
    }
    let o = cmd.output().unwrap();
    let code = o.status.code().unwrap();
    assert!(
        code == 0 || code == 1,
        "exit {code}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    let j: Json = serde_json::from_slice(&o.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&o.stdout)));
    check_shape(&j);
    (code, j)
}

const IDS: [&str; 7] = [
    "container",
    "mapping",
    "statistics",
    "kv_b",
    "gpu_dequant",
    "forward",
    "layers",
];

/// The JSON shape, exactly.
fn check_shape(j: &Json) {
    let keys: Vec<&str> = j.as_object().unwrap().keys().map(String::as_str).collect();
    assert_eq!(keys, ["checks", "first_finding"]);
    let checks = j["checks"].as_array().unwrap();
    let ids: Vec<&str> = checks.iter().map(|c| c["id"].as_str().unwrap()).collect();
    assert_eq!(ids, IDS);
    for c in checks {
        let keys: Vec<&str> = c.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["id", "status", "subject", "detail"]);
        assert!(["pass", "finding", "warning", "skipped"].contains(&c["status"].as_str().unwrap()));
        assert!(c["subject"].is_null() || c["subject"].is_string());
        assert!(c["detail"].is_string());
    }
    let ff = &j["first_finding"];
    if !ff.is_null() {
        let keys: Vec<&str> = ff.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(keys, ["check", "subject", "detail"]);
        let first = checks.iter().find(|c| c["status"] == "finding").unwrap();
        assert_eq!(
            ff["check"], first["id"],
            "first finding is the first finding check"
        );
    }
}

fn check<'a>(j: &'a Json, id: &str) -> &'a Json {
    j["checks"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["id"] == id)
        .unwrap()
}

fn status<'a>(j: &'a Json, id: &str) -> &'a str {
    check(j, id)["status"].as_str().unwrap()
}

fn detail<'a>(j: &'a Json, id: &str) -> &'a str {
    check(j, id)["detail"].as_str().unwrap()
}

fn subject<'a>(j: &'a Json, id: &str) -> &'a str {
    check(j, id)["subject"].as_str().unwrap_or("")
}

/// Asserts check `id` is a finding whose subject contains `subj` and whose detail contains
/// every string in `words`.
fn assert_finding(j: &Json, id: &str, subj: &str, words: &[&str]) {
    assert_eq!(status(j, id), "finding", "{id}: {}", detail(j, id));
    assert!(
        subject(j, id).contains(subj),
        "{id}: subject {:?}, want {subj:?}: {}",
        subject(j, id),
        detail(j, id)
    );
    for w in words {
        assert!(
            detail(j, id).contains(w),
            "{id}: no {w:?} in {}",
            detail(j, id)
        );
    }
}

fn assert_detail(j: &Json, id: &str, word: &str) {
    assert!(
        detail(j, id).contains(word),
        "{id}: no {word:?} in {}",
        detail(j, id)
    );
}

fn first_check(j: &Json) -> &str {
    j["first_finding"]["check"].as_str().unwrap_or("none")
}

/// A fixture copied into a temp dir, with its tensor table for patching.
struct Broken {
    _dir: Option<tempfile::TempDir>,
    path: PathBuf,
}

impl Broken {
    fn new(rel: &str) -> Broken {
        let dir = tempfile::tempdir().unwrap();
        let src = fx(rel);
        let path = dir.path().join(src.file_name().unwrap());
        std::fs::copy(&src, &path).unwrap();
        Broken {
            _dir: Some(dir),
            path,
        }
    }

    /// A file already in place (a shard of a set built by the test).
    fn at(path: PathBuf) -> Broken {
        Broken { _dir: None, path }
    }

    fn arg(&self) -> &str {
        self.path.to_str().unwrap()
    }

    /// (absolute data offset, byte count, dims, type) of a tensor, from the file's table.
    fn tensor(&self, name: &str) -> (u64, usize, Vec<u64>, GgmlType) {
        let f = GgufFile::open(&self.path).unwrap();
        let t = f
            .tensors()
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("{name} not in {}", self.path.display()))
            .clone();
        (
            f.data_offset() + t.offset,
            t.n_bytes() as usize,
            t.dims,
            t.ty,
        )
    }

    fn read(&self, at: u64, n: usize) -> Vec<u8> {
        let b = std::fs::read(&self.path).unwrap();
        b[at as usize..at as usize + n].to_vec()
    }

    fn write(&self, at: u64, bytes: &[u8]) {
        use std::os::unix::fs::FileExt;
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&self.path)
            .unwrap();
        f.write_all_at(bytes, at).unwrap();
    }

    fn data(&self, name: &str) -> Vec<u8> {
        let (at, n, _, _) = self.tensor(name);
        self.read(at, n)
    }

    fn set_data(&self, name: &str, bytes: &[u8]) {
        let (at, n, _, _) = self.tensor(name);
        assert_eq!(bytes.len(), n);
        self.write(at, bytes);
    }

    /// Offset of a tensor's info entry right after its name in the header (n_dims follows).
    fn info_entry(&self, name: &str) -> u64 {
        let b = std::fs::read(&self.path).unwrap();
        let mut pat = (name.len() as u64).to_le_bytes().to_vec();
        pat.extend_from_slice(name.as_bytes());
        let pos = b
            .windows(pat.len())
            .position(|w| w == pat.as_slice())
            .unwrap_or_else(|| panic!("{name} not in the header"));
        (pos + pat.len()) as u64
    }

    /// Overwrites a tensor's ggml dims in the header (same count of dims).
    fn set_dims(&self, name: &str, dims: &[u64]) {
        let at = self.info_entry(name);
        let n = u32::from_le_bytes(self.read(at, 4).try_into().unwrap());
        assert_eq!(n as usize, dims.len());
        let bytes: Vec<u8> = dims.iter().flat_map(|d| d.to_le_bytes()).collect();
        self.write(at + 4, &bytes);
    }

    /// Renames a tensor in the header (same name length).
    fn rename(&self, from: &str, to: &str) {
        assert_eq!(from.len(), to.len());
        let at = self.info_entry(from) - from.len() as u64;
        self.write(at, to.as_bytes());
    }
}

fn bf16_rows(bytes: &[u8], row_bytes: usize) -> Vec<Vec<u8>> {
    bytes.chunks_exact(row_bytes).map(<[u8]>::to_vec).collect()
}

fn hf_dir_of(gguf: &Path, dir: &Path) -> PathBuf {
    let out = dir.join("hf");
    let o = gguftool(&[
        "convert",
        gguf.to_str().unwrap(),
        out.to_str().unwrap(),
        "--to",
        "safetensors",
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    out
}

// ---- healthy ----

#[test]
fn healthy_fixtures_pass() {
    for rel in [
        "gguf/tiny-glm5-BF16.gguf",
        "gguf/tiny-glm5-Q8_0.gguf",
        "gguf/tiny-glm5-Q6_K.gguf",
        "gguf/tiny-glm5-Q4_K_M.gguf",
        "gguf/split/tiny-glm5-Q4_K_M-00002-of-00003.gguf",
    ] {
        let p = fx(rel);
        let (code, j) = doctor(&[
            p.to_str().unwrap(),
            "--activations",
            fx(DUMP).to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{rel}: {j:#}");
        assert!(j["first_finding"].is_null(), "{rel}");
        for id in ["container", "mapping", "kv_b", "forward", "layers"] {
            assert_eq!(status(&j, id), "pass", "{rel} {id}: {}", detail(&j, id));
        }
        // The fixture has an indexer norm bias 8x narrower than its siblings: a warning, never
        // a finding.
        assert_eq!(status(&j, "statistics"), "warning", "{rel}");
        assert!(detail(&j, "statistics").contains("blk.1.indexer.k_norm.bias"));
        assert!(detail(&j, "forward").contains("continues the count"));
        assert!(detail(&j, "layers").contains("activations of 19 tokens"));
        if kernels::device_count() == 0 {
            assert_eq!(status(&j, "gpu_dequant"), "skipped");
            assert!(detail(&j, "gpu_dequant").contains("no CUDA device"));
            assert!(detail(&j, "layers").contains("cuda side: no CUDA device"));
        }
    }
}

#[test]
fn healthy_with_hf_checkpoint_and_quick() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_dir_of(&fx("gguf/tiny-glm5-BF16.gguf"), dir.path());
    for rel in ["gguf/tiny-glm5-BF16.gguf", "gguf/tiny-glm5-Q4_K_M.gguf"] {
        let (code, j) = doctor(&[fx(rel).to_str().unwrap(), "--hf", hf.to_str().unwrap()]);
        assert_eq!(code, 0, "{rel}: {j:#}");
        assert!(detail(&j, "mapping").contains("compared with the --hf checkpoint"));
        assert!(
            detail(&j, "kv_b").contains("4 compared with the --hf kv_b_proj"),
            "{}",
            detail(&j, "kv_b")
        );
        let (code, j) = doctor(&[
            fx(rel).to_str().unwrap(),
            "--quick",
            "--activations",
            fx(DUMP).to_str().unwrap(),
        ]);
        assert_eq!(code, 0, "{rel} --quick: {j:#}");
        assert!(detail(&j, "statistics").contains("--quick"));
        assert_detail(&j, "layers", "the first 2 layers");
    }
}

/// `--hf` check 7 through a stand-in interpreter (`GGUFTOOL_PYTHON`): doctor passes the HF
/// directory and the count prompt's ids to the embedded script and compares what it writes
/// (here the fixture dump, which transformers made for the same prompt). Without a usable
/// Python the transformers side is skipped with the import error.
#[test]
fn hf_activations_come_from_the_python_side() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_dir_of(&fx("gguf/tiny-glm5-BF16.gguf"), dir.path());
    let args_log = dir.path().join("args");
    let fake = dir.path().join("python");
    std::fs::write(
        &fake,
        format!(
            "#!/bin/sh\n[ \"$1\" = -c ] && exit 0\necho \"$@\" > {}\nwhile [ $# -gt 0 ]; do [ \"$1\" = --out ] && out=$2; shift; done\ncp {} \"$out\"\n",
            args_log.display(),
            fx(DUMP).display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&fake, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let bf16 = fx("gguf/tiny-glm5-BF16.gguf");
    let args = [
        bf16.to_str().unwrap(),
        "--hf",
        hf.to_str().unwrap(),
        "--checks",
        "7",
    ];
    let (code, j) = doctor_env(&args, Some(&fake));
    assert_eq!(code, 0, "{j:#}");
    assert_eq!(status(&j, "layers"), "pass", "{}", detail(&j, "layers"));
    assert_detail(&j, "layers", "CPU reference vs transformers on");
    let logged = std::fs::read_to_string(&args_log).unwrap();
    // The count prompt "1 2 3 4 5 6 7 8 9 10" as the fixture's token_ids (transformers' ids).
    let ids = "--ids 16,220,17,220,18,220,19,220,20,220,21,220,22,220,23,220,24,220,271 ";
    assert!(
        logged.contains(&format!("--hf {} ", hf.display())),
        "{logged}"
    );
    assert!(logged.contains(ids), "{logged}");

    let (code, j) = doctor_env(&args, Some(&dir.path().join("no-python-here")));
    assert_eq!(code, 0);
    assert_eq!(status(&j, "layers"), "skipped");
    assert_detail(&j, "layers", "transformers side");
}

#[test]
fn human_report_names_the_first_finding_and_what_to_do() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    let (at, _, _, _) = b.tensor("blk.1.attn_q_b.weight");
    b.write(at, &[0xc0, 0x7f].repeat(2048));
    let o = gguftool(&["doctor", b.arg(), "-q"]);
    assert_eq!(o.status.code(), Some(1));
    let text = String::from_utf8(o.stdout).unwrap();
    assert!(
        text.contains(">>> first finding: check 3 (statistics): blk.1.attn_q_b.weight"),
        "{text}"
    );
    assert!(text.contains("to do: "), "{text}");
}

#[test]
fn errors_exit_2() {
    let o = gguftool(&["doctor", "/nonexistent/model.gguf"]);
    assert_eq!(o.status.code(), Some(2));
    let p = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let o = gguftool(&["doctor", p.to_str().unwrap(), "--tp", "0"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--tp"));
    let o = gguftool(&["doctor", p.to_str().unwrap(), "--checks", "9"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn machine_checks_without_a_model() {
    let o = gguftool(&["doctor", "--no-compile", "--json"]);
    let j: Json = serde_json::from_slice(&o.stdout).unwrap();
    let ids: Vec<&str> = j["checks"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["id"].as_str().unwrap())
        .collect();
    assert_eq!(ids[0], "cuda_devices");
    assert!(ids.contains(&"nvrtc"));
    assert_eq!(
        o.status.code(),
        Some(if j["first_finding"].is_null() { 0 } else { 1 })
    );
    if kernels::device_count() == 0 {
        // No GPU is not a fault of the machine.
        assert_eq!(o.status.code(), Some(0), "{j:#}");
        assert_eq!(j["checks"][0]["status"], "skipped");
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: machine_checks_without_a_model GPU part: no CUDA device\n",
        );
    }
}

// ---- check 1: container ----

const SHARD2: &str = "tiny-glm5-Q4_K_M-00002-of-00003.gguf";

/// What goes in place of the second shard of the Q4_K_M split.
enum Second<'a> {
    Original,
    Missing,
    /// Another file, renamed into the set.
    From(&'a Path),
}

/// The Q4_K_M split in `dir/set`, shard 2 as `second` says; returns the first shard's path.
fn split_set(dir: &Path, second: Second<'_>) -> PathBuf {
    let set = dir.join("set");
    std::fs::create_dir_all(&set).unwrap();
    for i in 1..=3 {
        let n = format!("tiny-glm5-Q4_K_M-0000{i}-of-00003.gguf");
        let src = match (&second, i) {
            (Second::Missing, 2) => continue,
            (Second::From(p), 2) => p.to_path_buf(),
            _ => fx(&format!("gguf/split/{n}")),
        };
        std::fs::copy(src, set.join(&n)).unwrap();
    }
    set.join("tiny-glm5-Q4_K_M-00001-of-00003.gguf")
}

/// Runs gguftool and requires success.
fn ok(args: &[&str]) {
    let o = gguftool(args);
    assert!(
        o.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&o.stderr)
    );
}

/// `doctor` on a broken split: exit 1, check 1 names shard 2 with `words`, and is first.
fn shard2_is_named(first: &Path, words: &[&str]) -> Json {
    let (code, j) = doctor(&[first.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_finding(&j, "container", SHARD2, words);
    assert_eq!(first_check(&j), "container");
    j
}

#[test]
fn truncated_shard_is_named_by_check_1() {
    let dir = tempfile::tempdir().unwrap();
    let first = split_set(dir.path(), Second::Original);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(first.with_file_name(SHARD2))
        .unwrap();
    f.set_len(f.metadata().unwrap().len() - 100_000).unwrap();
    let j = shard2_is_named(&first, &["truncated", "100000 bytes missing"]);
    assert!(detail(&j, "statistics").contains("cannot be opened"));
}

#[test]
fn missing_shard_is_named_by_check_1() {
    let dir = tempfile::tempdir().unwrap();
    shard2_is_named(&split_set(dir.path(), Second::Missing), &["missing"]);
}

/// Shard 2 taken from another split of the model (31 tensors per shard instead of 32).
#[test]
fn shard_of_another_split_is_named_by_check_1() {
    let dir = tempfile::tempdir().unwrap();
    let prefix = dir.path().join("other");
    let q8 = fx("gguf/tiny-glm5-Q8_0.gguf");
    let (q8, prefix_s) = (q8.to_str().unwrap(), prefix.to_str().unwrap());
    ok(&["split", q8, "-o", prefix_s, "--max-tensors", "31", "-q"]);
    // The other split has 4 shards; its second one, renamed into the 3-shard set.
    let other = dir.path().join("other-00002-of-00004.gguf");
    shard2_is_named(
        &split_set(dir.path(), Second::From(&other)),
        &["another split"],
    );
}

/// Shard 2 of another model (a GLM-5-shaped synthetic one, split the same way) renamed into
/// the set: its tensors have shapes the first shard's metadata does not imply.
#[test]
fn shard_of_another_model_is_named_by_check_1() {
    let dir = tempfile::tempdir().unwrap();
    let mini = dir.path().join("mini.gguf");
    let prefix = dir.path().join("mini");
    let (mini_s, prefix_s) = (mini.to_str().unwrap(), prefix.to_str().unwrap());
    ok(&[
        "synth",
        "--preset",
        "glm5-mini",
        "--layers",
        "3",
        "-o",
        mini_s,
        "-q",
    ]);
    ok(&["split", mini_s, "-o", prefix_s, "--max-tensors", "32", "-q"]);
    let other = dir.path().join("mini-00002-of-00003.gguf");
    shard2_is_named(
        &split_set(dir.path(), Second::From(&other)),
        &["a shard of another model"],
    );
}

// ---- check 2 / 4: kv_b layout in the table ----

#[test]
fn swapped_k_b_v_b_in_the_table_are_named_by_checks_2_and_4() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    // Same name length: exchange the two names, each entry keeps its dims and data.
    b.rename("blk.1.attn_k_b.weight", "blk.1.attn_X_b.weight");
    b.rename("blk.1.attn_v_b.weight", "blk.1.attn_k_b.weight");
    b.rename("blk.1.attn_X_b.weight", "blk.1.attn_v_b.weight");
    let (code, j) = doctor(&[b.arg()]);
    assert_eq!(code, 1);
    assert_finding(&j, "mapping", "blk.1.attn_", &["swapped"]);
    assert_finding(&j, "kv_b", "blk.1.attn_k_b.weight", &["swapped"]);
    assert_eq!(first_check(&j), "mapping");
    assert_eq!(
        status(&j, "container"),
        "pass",
        "one layer wrong is not a metadata fault"
    );
}

/// attn_k_b written as HF's key rows without the per-head transpose, its dims saying so.
#[test]
fn transposed_kv_b_is_named_by_checks_2_and_4() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    b.set_dims("blk.2.attn_k_b.weight", &[256, 64, 4]);
    let (code, j) = doctor(&[b.arg()]);
    assert_eq!(code, 1);
    assert_finding(&j, "mapping", "blk.2.attn_k_b.weight", &["transposed"]);
    assert_finding(
        &j,
        "kv_b",
        "blk.2.attn_k_b.weight",
        &["without the transpose"],
    );
}

/// Per head, k_b {64, 256} laid out [qk_nope][kv_lora] (the HF rows) under the right dims:
/// element (i, r) moved from i + 64 r to r + 256 i.
fn untranspose_k_b(b: &Broken, name: &str) {
    let src = b.data(name);
    let (nope, lora) = (64usize, 256usize);
    let slab = nope * lora * 2;
    let mut out = src.clone();
    for h in 0..4 {
        for i in 0..nope {
            for r in 0..lora {
                let from = h * slab + (i + nope * r) * 2;
                let to = h * slab + (r + lora * i) * 2;
                out[to..to + 2].copy_from_slice(&src[from..from + 2]);
            }
        }
    }
    b.set_data(name, &out);
}

#[test]
fn untransposed_kv_b_data_is_named_by_check_7_and_by_check_4_with_hf() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_dir_of(&fx("gguf/tiny-glm5-BF16.gguf"), dir.path());
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    untranspose_k_b(&b, "blk.1.attn_k_b.weight");
    let (code, j) = doctor(&[
        b.arg(),
        "--activations",
        fx(DUMP).to_str().unwrap(),
        "--hf",
        hf.to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    for id in ["container", "mapping"] {
        assert_eq!(status(&j, id), "pass", "{id}: shapes are intact");
    }
    assert_finding(
        &j,
        "kv_b",
        "blk.1.attn_k_b.weight",
        &["without the transpose", "with the transpose it matches"],
    );
    assert_finding(
        &j,
        "layers",
        "blk.1.attn_output.out",
        &["attn_k_b", "inputs in this layer match"],
    );
}

#[test]
fn swapped_k_b_v_b_data_is_named_by_check_7_and_by_check_4_with_hf() {
    let dir = tempfile::tempdir().unwrap();
    let hf = hf_dir_of(&fx("gguf/tiny-glm5-BF16.gguf"), dir.path());
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    // BF16 k_b {64, 256, 4} and v_b {256, 64, 4} have equal sizes: exchange the bytes, keep
    // the table, so every shape is right.
    let (k, v) = (
        b.data("blk.2.attn_k_b.weight"),
        b.data("blk.2.attn_v_b.weight"),
    );
    b.set_data("blk.2.attn_k_b.weight", &v);
    b.set_data("blk.2.attn_v_b.weight", &k);
    let (code, j) = doctor(&[b.arg(), "--activations", fx(DUMP).to_str().unwrap()]);
    assert_eq!(code, 1);
    assert_eq!(status(&j, "mapping"), "pass");
    assert_finding(&j, "layers", "blk.2.attn_output.out", &["attn_v_b"]);
    let (_, j) = doctor(&[b.arg(), "--hf", hf.to_str().unwrap()]);
    assert_finding(&j, "kv_b", "blk.2.attn_k_b.weight", &["swapped"]);
}

// ---- check 3: values ----

#[test]
fn nan_filled_tensor_is_the_first_finding_of_check_3() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    let (at, _, _, _) = b.tensor("blk.1.attn_q_b.weight");
    b.write(at, &[0xc0, 0x7f].repeat(2048));
    let (code, j) = doctor(&[b.arg()]);
    assert_eq!(code, 1);
    assert_finding(
        &j,
        "statistics",
        "blk.1.attn_q_b.weight",
        &["2048 NaN", "first bad group is 0"],
    );
    assert_eq!(first_check(&j), "statistics");
    assert!(j["first_finding"]["subject"]
        .as_str()
        .unwrap()
        .contains("blk.1.attn_q_b"));
}

#[test]
fn zeroed_norm_is_named_by_check_3() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    let (at, n, _, ty) = b.tensor("blk.2.ffn_norm.weight");
    assert_eq!(ty, GgmlType::F32);
    b.write(at, &vec![0u8; n]);
    let (code, j) = doctor(&[b.arg()]);
    assert_eq!(code, 1);
    assert_finding(
        &j,
        "statistics",
        "blk.2.ffn_norm.weight",
        &["every value is zero"],
    );
    assert_eq!(first_check(&j), "statistics");
}

#[test]
fn corrupted_quant_block_is_located_by_check_3() {
    let b = Broken::new("gguf/tiny-glm5-Q4_K_M.gguf");
    let (at, _, _, ty) = b.tensor("blk.1.ffn_up_exps.weight");
    assert_eq!(ty, GgmlType::Q4_K);
    // Garbage over block 100: its f16 scale reads as NaN.
    b.write(at + 100 * 144, &[0xff; 144]);
    let (code, j) = doctor(&[b.arg()]);
    assert_eq!(code, 1);
    assert_finding(
        &j,
        "statistics",
        "blk.1.ffn_up_exps.weight",
        &["first bad block is 100", "row 100"],
    );
    assert_eq!(first_check(&j), "statistics");

    // A finite but absurd super-block scale (65504) in block 7 of another tensor.
    let b = Broken::new("gguf/tiny-glm5-Q4_K_M.gguf");
    let (at, _, _, _) = b.tensor("blk.2.ffn_gate_exps.weight");
    b.write(at + 7 * 144, &0x7bffu16.to_le_bytes());
    let (code, j) = doctor(&[b.arg(), "--checks", "3"]);
    assert_eq!(code, 1);
    assert_finding(
        &j,
        "statistics",
        "blk.2.ffn_gate_exps.weight",
        &["block 7 ", "a damaged block"],
    );
}

// ---- check 7: what only a forward pass shows ----

/// Reorders the rotary rows (the last 32 of each 96-row head) from interleaved to half-split.
fn half_split_rope_rows(b: &Broken, name: &str, head_rows: usize, rope_at: usize, n_rot: usize) {
    let (_, _, dims, ty) = b.tensor(name);
    assert_eq!(ty, GgmlType::BF16);
    let row_bytes = dims[0] as usize * 2;
    let rows = bf16_rows(&b.data(name), row_bytes);
    let mut out = rows.clone();
    for h in 0..rows.len() / head_rows {
        for j in 0..n_rot {
            let src = if j < n_rot / 2 {
                2 * j
            } else {
                2 * (j - n_rot / 2) + 1
            };
            out[h * head_rows + rope_at + j] = rows[h * head_rows + rope_at + src].clone();
        }
    }
    b.set_data(name, &out.concat());
}

#[test]
fn rope_dims_laid_out_half_split_are_named_by_check_7() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    for l in 0..4 {
        half_split_rope_rows(&b, &format!("blk.{l}.attn_q_b.weight"), 96, 64, 32);
        half_split_rope_rows(&b, &format!("blk.{l}.attn_kv_a_mqa.weight"), 288, 256, 32);
    }
    let (code, j) = doctor(&[b.arg(), "--activations", fx(DUMP).to_str().unwrap()]);
    assert_eq!(code, 1);
    for id in ["container", "mapping", "kv_b"] {
        assert_eq!(
            status(&j, id),
            "pass",
            "{id}: the layout is invisible to {id}"
        );
    }
    assert_finding(
        &j,
        "layers",
        "blk.0.attn_q_b.out",
        &["half-split", "blk.0.attn_q_b.weight"],
    );
}

#[test]
fn experts_stacked_in_the_wrong_order_are_named_by_check_7() {
    let b = Broken::new("gguf/tiny-glm5-BF16.gguf");
    // Experts 0 and 3 of block 1 exchanged in all three stacked tensors (ne2 is the expert).
    for t in ["ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"] {
        let name = format!("blk.1.{t}.weight");
        let (_, n, dims, _) = b.tensor(&name);
        assert_eq!(dims[2], 6);
        let slab = n / 6;
        let mut d = b.data(&name);
        let e0 = d[..slab].to_vec();
        let e3 = d[3 * slab..4 * slab].to_vec();
        d[..slab].copy_from_slice(&e3);
        d[3 * slab..4 * slab].copy_from_slice(&e0);
        b.set_data(&name, &d);
    }
    let (code, j) = doctor(&[b.arg(), "--activations", fx(DUMP).to_str().unwrap()]);
    assert_eq!(code, 1);
    for id in ["container", "mapping", "kv_b"] {
        assert_eq!(status(&j, id), "pass", "{id}");
    }
    assert_finding(
        &j,
        "layers",
        "blk.1.ffn.out",
        &["same experts", "wrong order", "ffn_up_exps"],
    );
}

/// Shard 2 replaced by one with the same layout and another model's weights (the blocks of
/// every tensor shuffled: same types, shapes and statistics): only the forward pass shows it,
/// and check 7 names the shard holding the diverging layer's weights.
#[test]
fn shard_with_another_models_weights_is_named_by_check_7() {
    let dir = tempfile::tempdir().unwrap();
    let first = split_set(dir.path(), Second::Original);
    let s2 = Broken::at(first.with_file_name(SHARD2));
    let f = GgufFile::open(&s2.path).unwrap();
    let names: Vec<(String, GgmlType)> =
        f.tensors().iter().map(|t| (t.name.clone(), t.ty)).collect();
    drop(f);
    for (n, ty) in names {
        let bs = ty.type_size();
        let d = s2.data(&n);
        let blocks: Vec<&[u8]> = d.chunks_exact(bs).collect();
        // Reverse the block order: a deterministic "other" set of weights.
        let out: Vec<u8> = blocks
            .iter()
            .rev()
            .flat_map(|b| b.iter().copied())
            .collect();
        s2.set_data(&n, &out);
    }
    let (code, j) = doctor(&[
        first.to_str().unwrap(),
        "--activations",
        fx(DUMP).to_str().unwrap(),
    ]);
    assert_eq!(code, 1);
    assert_eq!(status(&j, "container"), "pass");
    assert_eq!(status(&j, "mapping"), "pass");
    assert_finding(&j, "layers", "blk.", &[SHARD2]);
}

// ---- checks 1-2 read headers only ----

/// A GLM-5-sized model (79 blocks, 256 experts, ~400 GB) that is all header: a sparse file. With
/// `--checks 1,2` doctor must pass without touching a page of tensor data: the kernel's page
/// cache residency (mincore) of the data region stays empty.
#[test]
fn checks_1_and_2_read_no_tensor_data_of_a_400_gb_model() {
    let src = GgufFile::open(fx("gguf/tiny-glm5-BF16.gguf")).unwrap();
    let mut meta = Metadata::new("glm5.gguf");
    for (k, v) in src.metadata().iter() {
        meta.set(k, v.clone());
    }
    let u = |v: u64| Value::U32(v as u32);
    for (k, v) in [
        ("block_count", 79),
        ("context_length", 202752),
        ("embedding_length", 6144),
        ("feed_forward_length", 12288),
        ("attention.head_count", 64),
        ("attention.key_length", 576),
        ("attention.value_length", 512),
        ("attention.q_lora_rank", 2048),
        ("attention.kv_lora_rank", 512),
        ("attention.key_length_mla", 256),
        ("attention.value_length_mla", 256),
        ("rope.dimension_count", 64),
        ("expert_count", 256),
        ("expert_used_count", 8),
        ("expert_group_count", 1),
        ("expert_group_used_count", 1),
        ("expert_feed_forward_length", 2048),
        ("leading_dense_block_count", 3),
        ("vocab_size", 154880),
        ("attention.indexer.head_count", 32),
        ("attention.indexer.key_length", 128),
        ("attention.indexer.top_k", 2048),
    ] {
        meta.set(&format!("glm-dsa.{k}"), u(v));
    }
    meta.set(
        "glm-dsa.attention.indexer.types",
        gguf::writer::array_of(ValueType::Bool, vec![Value::Bool(true); 78]),
    );
    let spec = runtime::spec::ModelSpec::from_metadata(&meta).unwrap();
    let tensors: Vec<TensorInfo> = spec
        .tensor_specs()
        .iter()
        .filter(|t| t.required || t.name.ends_with("exp_probs_b.bias"))
        .map(|t| {
            let dims: Vec<u64> = t.dims.iter().map(|&d| d as u64).collect();
            let ty = if dims.len() == 1 || t.name.contains("ffn_gate_inp") {
                GgmlType::F32
            } else if dims[0].is_multiple_of(256) {
                GgmlType::Q4_K
            } else {
                GgmlType::Q8_0
            };
            TensorInfo {
                name: t.name.clone(),
                dims,
                ty,
                offset: 0,
            }
        })
        .collect();
    let layout = gguf::writer::Layout::new(3, &meta, tensors).unwrap();
    let size = layout.file_size();
    assert!(size > 350_000_000_000, "{size}");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("glm5-sparse.gguf");
    {
        let mut f = std::fs::File::create(&path).unwrap();
        layout.write_header(&mut f).unwrap();
        if let Err(e) = f.set_len(size) {
            let _ = std::io::Write::write_all(
                &mut std::io::stderr(),
                format!("skipped: checks_1_and_2_read_no_tensor_data_of_a_400_gb_model: no sparse file of {size} bytes here ({e})\n").as_bytes(),
            );
            return;
        }
        f.sync_all().unwrap();
    }
    let (code, j) = doctor(&[path.to_str().unwrap(), "--checks", "1,2"]);
    assert_eq!(code, 0, "{j:#}");
    assert_eq!(
        status(&j, "container"),
        "pass",
        "{}",
        detail(&j, "container")
    );
    assert_eq!(status(&j, "mapping"), "pass", "{}", detail(&j, "mapping"));
    assert_eq!(status(&j, "statistics"), "skipped");
    // Pages of tensor data in the page cache after the run: the first MiB of every tensor
    // (whatever reads a tensor starts there), past the kernel's readahead of the header read
    // (read_ahead_kb, 128 KiB by default; 4 MiB leaves room for tuned devices).
    let page = 4096;
    let past_readahead = (layout.data_offset + (4 << 20)).next_multiple_of(page);
    let touched: usize = layout
        .tensors
        .iter()
        .map(|t| {
            let start = (layout.data_offset + t.offset) / page * page;
            let end =
                (layout.data_offset + t.offset + t.n_bytes().min(1 << 20)).next_multiple_of(page);
            resident_pages(&path, start.max(past_readahead), end.max(past_readahead))
        })
        .sum();
    // The probe must see reads for the count to mean anything: read one MiB in the middle.
    let mid = (size / 2) & !((1 << 20) - 1);
    {
        use std::os::unix::fs::FileExt;
        let mut buf = vec![0u8; 1 << 20];
        std::fs::File::open(&path)
            .unwrap()
            .read_exact_at(&mut buf, mid)
            .unwrap();
    }
    if resident_pages(&path, mid, mid + (1 << 20)) == 0 {
        let _ = std::io::Write::write_all(
            &mut std::io::stderr(),
            b"skipped: checks_1_and_2_read_no_tensor_data_of_a_400_gb_model: mincore does not see page-cache reads of sparse files on this filesystem\n",
        );
        return;
    }
    assert_eq!(touched, 0, "doctor read tensor data");
}

/// Resident pages of `path` in `[start, end)` (both page aligned), checked 1 GiB at a time.
fn resident_pages(path: &Path, start: u64, end: u64) -> usize {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    let page = 4096u64;
    let chunk = 1u64 << 30;
    let mut resident = 0;
    let mut vec = vec![0u8; (chunk / page) as usize];
    let mut at = start;
    while at < end {
        let len = chunk.min(end - at);
        // SAFETY: a read-only shared mapping of an open file, never dereferenced; unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len as usize,
                libc::PROT_READ,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                at as libc::off_t,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        let n = len.div_ceil(page) as usize;
        // SAFETY: `p` maps `len` bytes; `vec` holds one byte per page of it.
        let rc = unsafe { libc::mincore(p, len as usize, vec.as_mut_ptr()) };
        assert_eq!(rc, 0);
        resident += vec[..n].iter().filter(|&&b| b & 1 == 1).count();
        // SAFETY: unmapping exactly what was mapped.
        unsafe { libc::munmap(p, len as usize) };
        at += len;
    }
    resident
}

#[test]
fn tp_sharded_model_is_compared_with_the_whole_cpu_reference() {
    let m = fx("gguf/tiny-glm5-Q8_0.gguf");
    let m = m.to_str().unwrap();
    let (code, j) = doctor(&[m, "--device", "cpu", "--tp", "2", "--checks", "7"]);
    assert_eq!(code, 0, "{j}");
    assert_eq!(status(&j, "layers"), "pass");
    assert_detail(&j, "layers", "tp 2 on cpu vs CPU reference");
    // Layer by layer on rank 0: a non-empty set of whole (replicated or all-reduced)
    // activations was compared, block outputs among them.
    let d = detail(&j, "layers");
    let n: usize = d
        .split("rank 0: ")
        .nth(1)
        .and_then(|t| t.split(' ').next())
        .and_then(|t| t.parse().ok())
        .unwrap_or(0);
    assert!(
        n >= 3 * 4,
        "too few activations compared layer by layer: {d}"
    );
    // 4 heads do not split over 3 ranks: a finding naming the split, not a crash or exit 2.
    let (code, j) = doctor(&[m, "--device", "cpu", "--tp", "3", "--checks", "7"]);
    assert_eq!(code, 1, "{j}");
    assert_finding(&j, "layers", "tp 3 on cpu", &["heads", "3 ranks"]);
}
