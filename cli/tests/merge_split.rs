//! `merge` and `split` through the binary: round trips on the fixture shards made by
//! llama-gguf-split, and one test per refused fault (nothing left at OUT afterwards).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
}

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn shard(k: u32) -> PathBuf {
    fx(&format!(
        "gguf/split/tiny-glm5-Q4_K_M-0000{k}-of-00003.gguf"
    ))
}

fn run(args: &[&dyn AsRef<std::ffi::OsStr>]) -> Output {
    let mut c = bin();
    for a in args {
        c.arg(a);
    }
    c.output().unwrap()
}

fn sha256_hex(p: &Path) -> String {
    use sha2::Digest;
    let d = sha2::Sha256::digest(std::fs::read(p).unwrap());
    d.iter().map(|b| format!("{b:02x}")).collect()
}

/// Copy the three fixture shards into a temp dir so tests can break them.
fn shard_copies(dir: &Path) -> Vec<PathBuf> {
    (1..=3)
        .map(|k| {
            let dst = dir.join(shard(k).file_name().unwrap());
            std::fs::copy(shard(k), &dst).unwrap();
            dst
        })
        .collect()
}

fn assert_refused(out: &Output, target: &Path, what: &str) {
    assert_eq!(
        out.status.code(),
        Some(2),
        "{what}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!target.exists(), "{what}: output left behind");
    let dir = target.parent().unwrap();
    let left: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains(".partial"))
        .collect();
    assert!(left.is_empty(), "{what}: temporary left behind: {left:?}");
}

#[test]
fn merge_gives_back_the_original_bytes() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &shard(1), &"-o", &out, &"--quiet", &"--verify"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(fx("gguf/tiny-glm5-Q4_K_M.gguf")).unwrap()
    );
}

#[test]
fn merge_keep_split_keys_matches_llama_gguf_split() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("k.gguf");
    // Given the last shard: siblings are found by name.
    let o = run(&[
        &"merge",
        &shard(3),
        &"-o",
        &out,
        &"--keep-split-keys",
        &"--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    // sha256 of llama-gguf-split --merge on these shards, recorded in shared/fixtures/README.md.
    assert_eq!(
        sha256_hex(&out),
        "9679f315b4b37dd2aa934581b1dc0a494f8a129d2cc709eb230331159dafd211"
    );
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 4881088);
}

#[test]
fn merge_explicit_list_in_any_order() {
    let d = tempfile::tempdir().unwrap();
    let out = d.path().join("m.gguf");
    let o = run(&[
        &"merge",
        &shard(2),
        &shard(3),
        &shard(1),
        &"-o",
        &out,
        &"--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(fx("gguf/tiny-glm5-Q4_K_M.gguf")).unwrap()
    );
}

#[test]
fn split_reproduces_llama_gguf_split_shards_and_merges_back() {
    let d = tempfile::tempdir().unwrap();
    let prefix = d.path().join("tiny-glm5-Q4_K_M");
    let o = run(&[
        &"split",
        &fx("gguf/tiny-glm5-Q4_K_M.gguf"),
        &"-o",
        &prefix,
        &"--max-tensors",
        &"32",
        &"--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for k in 1..=3 {
        let ours = d.path().join(shard(k).file_name().unwrap());
        assert!(
            std::fs::read(&ours).unwrap() == std::fs::read(shard(k)).unwrap(),
            "shard {k} differs from llama-gguf-split's"
        );
    }
    let out = d.path().join("back.gguf");
    let o = run(&[
        &"merge",
        &d.path().join(shard(1).file_name().unwrap()),
        &"-o",
        &out,
        &"--quiet",
    ]);
    assert!(o.status.success());
    assert!(
        std::fs::read(&out).unwrap() == std::fs::read(fx("gguf/tiny-glm5-Q4_K_M.gguf")).unwrap()
    );
}

#[test]
fn split_by_size_round_trips() {
    let d = tempfile::tempdir().unwrap();
    let prefix = d.path().join("bf16");
    let o = run(&[
        &"split",
        &fx("gguf/tiny-glm5-BF16.gguf"),
        &"-o",
        &prefix,
        &"--max-size",
        &"4M",
        &"--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let mut shards: Vec<PathBuf> = std::fs::read_dir(d.path())
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    shards.sort();
    assert!(
        shards.len() >= 4,
        "15.6 MB in shards of <= 4 MB of tensor data: {shards:?}"
    );
    for p in &shards {
        let f = gguf::GgufFile::open(p).unwrap();
        let data: u64 = f
            .tensors()
            .iter()
            .map(|t| t.n_bytes().div_ceil(32) * 32)
            .sum();
        assert!(
            data <= 4_000_000 || f.tensors().len() == 1,
            "{}: {data} bytes",
            p.display()
        );
    }
    let first = shards[0].clone();
    let out = d.path().join("back.gguf");
    let o = run(&[&"merge", &first, &"-o", &out, &"--quiet", &"--verify"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(std::fs::read(&out).unwrap() == std::fs::read(fx("gguf/tiny-glm5-BF16.gguf")).unwrap());
}

#[test]
fn refuses_missing_shard() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    std::fs::remove_file(&s[1]).unwrap();
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_refused(&o, &out, "missing shard");
    assert!(String::from_utf8_lossy(&o.stderr).contains("missing"));
}

#[test]
fn refuses_duplicate_shard() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &s[1], &s[1], &"-o", &out]);
    assert_refused(&o, &out, "duplicate shard");
}

#[test]
fn refuses_truncated_shard() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    let f = std::fs::OpenOptions::new().write(true).open(&s[2]).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len - 1000).unwrap();
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_refused(&o, &out, "truncated shard");
}

/// Rewrite one metadata value of a shard in place (same type and size), e.g. split.count.
/// `type_id` is the GGUF value type of the key (2 = UINT16, 5 = INT32).
fn patch_key(path: &Path, key: &str, type_id: u32, value: &[u8]) {
    let mut bytes = std::fs::read(path).unwrap();
    let mut needle = (key.len() as u64).to_le_bytes().to_vec();
    needle.extend_from_slice(key.as_bytes());
    needle.extend_from_slice(&type_id.to_le_bytes());
    let pos = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("key present");
    let at = pos + needle.len();
    bytes[at..at + value.len()].copy_from_slice(value);
    std::fs::write(path, bytes).unwrap();
}

fn patch_u16_key(path: &Path, key: &str, value: u16) {
    patch_key(path, key, 2, &value.to_le_bytes());
}

fn patch_i32_key(path: &Path, key: &str, value: i32) {
    patch_key(path, key, 5, &value.to_le_bytes());
}

#[test]
fn refuses_wrong_split_count() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    patch_u16_key(&s[2], "split.count", 4);
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_refused(&o, &out, "wrong split.count");
}

#[test]
fn refuses_wrong_split_tensors_count() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    patch_i32_key(&s[0], "split.tensors.count", 95);
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_refused(&o, &out, "wrong split.tensors.count");
}

#[test]
fn refuses_wrong_split_no() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    patch_u16_key(&s[2], "split.no", 1);
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &s[1], &s[2], &"-o", &out]);
    assert_refused(&o, &out, "split.no claimed twice");
}

#[test]
fn refuses_shard_of_another_model() {
    // Split the BF16 model into 3 shards of 32 tensors and slip its second shard into the
    // Q4_K_M set: same split.count and split.tensors.count, but unquantized matrices.
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    let other = tempfile::tempdir().unwrap();
    let prefix = other.path().join("x");
    let o = run(&[
        &"split",
        &fx("gguf/tiny-glm5-BF16.gguf"),
        &"-o",
        &prefix,
        &"--max-tensors",
        &"32",
        &"--quiet",
    ]);
    assert!(o.status.success());
    std::fs::copy(other.path().join("x-00002-of-00003.gguf"), &s[1]).unwrap();
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_refused(&o, &out, "foreign shard");
}

#[test]
fn refuses_existing_output_and_output_equal_to_input() {
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    let out = d.path().join("m.gguf");
    std::fs::write(&out, b"keep me").unwrap();
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        b"keep me",
        "existing output must be untouched"
    );
    let o = run(&[&"merge", &s[0], &"-o", &s[1], &"--force"]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(
        std::fs::read(&s[1]).unwrap(),
        std::fs::read(shard(2)).unwrap(),
        "input must be untouched"
    );
    // --force replaces an existing output.
    let o = run(&[&"merge", &s[0], &"-o", &out, &"--force", &"--quiet"]);
    assert!(o.status.success());
    assert_eq!(std::fs::metadata(&out).unwrap().len(), 4881024);
}

#[test]
fn split_aliases_of_gguf_split_give_the_same_shards() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    let src = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let o = run(&[&"split", &src, &"-o", &a, &"--max-tensors", &"32", &"-q"]);
    assert!(o.status.success());
    let o = run(&[
        &"split",
        &src,
        &"-o",
        &b,
        &"--split-max-tensors",
        &"32",
        &"-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    for k in 1..=3 {
        let name = |p: &Path| PathBuf::from(format!("{}-0000{k}-of-00003.gguf", p.display()));
        assert_eq!(sha256_hex(&name(&a)), sha256_hex(&name(&b)));
    }
    let o = run(&[
        &"split",
        &src,
        &"-o",
        &b,
        &"--split-max-size",
        &"2M",
        &"-q",
        &"--dry-run",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Split `src` with --set-id into `dir/prefix`; returns the shard paths.
fn split_with_set_id(src: &Path, dir: &Path, prefix: &str) -> Vec<PathBuf> {
    let p = dir.join(prefix);
    let o = run(&[
        &"split",
        &src,
        &"-o",
        &p,
        &"--max-tensors",
        &"32",
        &"--set-id",
        &"-q",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    (1..=3)
        .map(|k| PathBuf::from(format!("{}-0000{k}-of-00003.gguf", p.display())))
        .collect()
}

#[test]
fn set_id_is_checked_and_removed_by_merge() {
    let d = tempfile::tempdir().unwrap();
    let ours = split_with_set_id(&fx("gguf/tiny-glm5-Q4_K_M.gguf"), d.path(), "q4");
    let theirs = split_with_set_id(&fx("gguf/tiny-glm5-Q6_K.gguf"), d.path(), "q6");
    for s in &ours {
        let f = gguf::GgufFile::open(s).unwrap();
        let id = f.metadata().get("split.set_id").and_then(|v| v.as_str());
        assert_eq!(id.map(str::len), Some(32), "{}", s.display());
    }
    // The set merges back to the original bytes: the id is not carried over...
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &ours[0], &"-o", &out, &"-q"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        sha256_hex(&out),
        sha256_hex(&fx("gguf/tiny-glm5-Q4_K_M.gguf"))
    );
    // ...nor into llama-gguf-split's merged form.
    let k = d.path().join("k.gguf");
    let o = run(&[&"merge", &ours[0], &"-o", &k, &"--keep-split-keys", &"-q"]);
    assert!(o.status.success());
    assert_eq!(
        sha256_hex(&k),
        "9679f315b4b37dd2aa934581b1dc0a494f8a129d2cc709eb230331159dafd211"
    );
    // A shard of another set with the same layout is refused by merge and verify.
    std::fs::copy(&theirs[1], &ours[1]).unwrap();
    let bad = d.path().join("bad.gguf");
    let o = run(&[&"merge", &ours[0], &"-o", &bad]);
    assert_refused(&o, &bad, "foreign shard with another set id");
    assert!(String::from_utf8_lossy(&o.stderr).contains("split.set_id"));
    let o = run(&[&"verify", &ours[0]]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("split.set_id"));
}

#[test]
fn refuses_foreign_shard_whose_shapes_contradict_shard_one() {
    // Same types, same counts, same byte sizes: only the shape of one matrix tells that this
    // shard 2 does not belong to shard 1's hyper-parameters.
    let d = tempfile::tempdir().unwrap();
    let s = shard_copies(d.path());
    let f = gguf::GgufFile::open(&s[1]).unwrap();
    let mut swapped = false;
    let tensors: Vec<(String, Vec<u64>, gguf::GgmlType, Vec<u8>)> = f
        .tensors()
        .iter()
        .map(|t| {
            let mut dims = t.dims.clone();
            let bs = t.ty.block_size() as u64;
            if !swapped && dims.len() == 2 && dims[0] != dims[1] && dims[1] % bs == 0 {
                dims.swap(0, 1);
                swapped = true;
            }
            (t.name.clone(), dims, t.ty, f.tensor_data(t).to_vec())
        })
        .collect();
    assert!(swapped, "no matrix to reshape");
    let refs: Vec<(&str, &[u64], gguf::GgmlType, &[u8])> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.as_slice(), *t, b.as_slice()))
        .collect();
    let bytes = gguf::writer::build(f.metadata(), &refs).unwrap();
    drop(f);
    std::fs::write(&s[1], bytes).unwrap();
    let out = d.path().join("m.gguf");
    let o = run(&[&"merge", &s[0], &"-o", &out]);
    assert_refused(&o, &out, "reshaped foreign shard");
    assert!(
        String::from_utf8_lossy(&o.stderr).contains("hyper-parameters give"),
        "{}",
        String::from_utf8_lossy(&o.stderr)
    );
    // The escape hatch exists for architectures whose table lags behind.
    let o = run(&[&"merge", &s[0], &"-o", &out, &"--skip-arch-check", &"-q"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}
