//! `edit` through the binary: typed sets, deletes, chat templates and renames on one file and on
//! a split set, tensor bytes untouched, in-place only when the header fits, refusals, and
//! nothing left behind on failure.

use gguf::{GgufFile, Model, Value};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn edit(args: &[&std::ffi::OsStr]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("edit")
        .args(args)
        .arg("-q")
        .output()
        .expect("run gguftool")
}

fn os(s: &str) -> &std::ffi::OsStr {
    s.as_ref()
}

fn ok(o: &Output) {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// Every tensor's bytes of two models are equal (by name, after `renames`).
fn same_tensor_bytes(a: &Path, b: &Path, renames: &[(&str, &str)]) {
    let (a, b) = (Model::open(a).unwrap(), Model::open(b).unwrap());
    assert_eq!(a.n_tensors(), b.n_tensors());
    for t in a.tensors() {
        let name = renames
            .iter()
            .find(|(x, _)| *x == t.info.name)
            .map_or(t.info.name.as_str(), |r| r.1);
        let o = b.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
        assert!(a.data(&t) == b.data(&o), "{name}");
    }
}

#[test]
fn set_delete_template_rename_on_one_file() {
    let dir = tempfile::tempdir().unwrap();
    let src = fx("gguf/tiny-glm5-Q4_K_M.gguf");
    let out = dir.path().join("e.gguf");
    let tpl = dir.path().join("t.jinja");
    std::fs::write(&tpl, "{{ messages }}").unwrap();
    ok(&edit(&[
        src.as_os_str(),
        os("-o"),
        out.as_os_str(),
        os("--set"),
        os("general.name=edited"),
        os("--set"),
        os("tokenizer.ggml.eos_token_id=1982"),
        os("--set"),
        os("my.float=0.25:f32"),
        os("--delete"),
        os("general.size_label"),
        os("--chat-template"),
        tpl.as_os_str(),
        os("--rename-tensor"),
        os("output_norm.weight=output_norm2.weight"),
    ]));
    let f = GgufFile::open(&out).unwrap();
    let m = f.metadata();
    assert_eq!(m.get("general.name"), Some(&Value::String("edited".into())));
    // The existing key's type (UINT32) is kept.
    assert_eq!(
        m.get("tokenizer.ggml.eos_token_id"),
        Some(&Value::U32(1982))
    );
    assert_eq!(m.get("my.float"), Some(&Value::F32(0.25)));
    assert!(m.get("general.size_label").is_none());
    assert_eq!(
        m.get("tokenizer.chat_template"),
        Some(&Value::String("{{ messages }}".into()))
    );
    same_tensor_bytes(&src, &out, &[("output_norm.weight", "output_norm2.weight")]);
}

#[test]
fn the_url_with_a_colon_stays_a_string() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("e.gguf");
    ok(&edit(&[
        fx("gguf/tiny-glm5-Q8_0.gguf").as_os_str(),
        os("-o"),
        out.as_os_str(),
        os("--set"),
        os("general.url=https://example.org:8080/x"),
    ]));
    let f = GgufFile::open(&out).unwrap();
    assert_eq!(
        f.metadata().get("general.url"),
        Some(&Value::String("https://example.org:8080/x".into()))
    );
}

#[test]
fn split_models_are_edited_shard_by_shard() {
    let dir = tempfile::tempdir().unwrap();
    let first = fx("gguf/split/tiny-glm5-Q4_K_M-00001-of-00003.gguf");
    let m = Model::open(&first).unwrap();
    // A tensor of the last shard.
    let t3 = m.shards()[2].tensors()[0].name.clone();
    let new_name = format!("{t3}.renamed");
    let out = dir.path().join("s.gguf");
    ok(&edit(&[
        first.as_os_str(),
        os("-o"),
        out.as_os_str(),
        os("--set"),
        os("general.name=split-edited"),
        os("--rename-tensor"),
        os(&format!("{t3}={new_name}")),
    ]));
    let outs: Vec<PathBuf> = (1..=3)
        .map(|i| dir.path().join(format!("s-{i:05}-of-00003.gguf")))
        .collect();
    let e = Model::open(&outs[0]).expect("edited set opens as one model");
    assert_eq!(
        e.metadata().get_str("general.name").unwrap(),
        "split-edited"
    );
    // Shard 2 was not touched: byte-identical copy.
    let orig2 = fx("gguf/split/tiny-glm5-Q4_K_M-00002-of-00003.gguf");
    assert!(std::fs::read(&orig2).unwrap() == std::fs::read(&outs[1]).unwrap());
    // The rename went to shard 3, whose split keys are unchanged.
    assert!(e.shards()[2].tensors().iter().any(|t| t.name == new_name));
    for (a, b) in m.shards().iter().zip(e.shards()) {
        assert_eq!(a.split_info().unwrap(), b.split_info().unwrap());
    }
    same_tensor_bytes(&first, &outs[0], &[(t3.as_str(), new_name.as_str())]);
}

#[test]
fn in_place_only_when_the_header_fits() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::copy(fx("gguf/tiny-glm5-Q8_0.gguf"), &p).unwrap();
    let before = std::fs::read(&p).unwrap();
    let data_offset = GgufFile::open(&p).unwrap().data_offset() as usize;
    // A few bytes more fit the alignment padding (or not): either way the data must not move.
    ok(&edit(&[
        p.as_os_str(),
        os("--in-place"),
        os("--set"),
        os("general.name=Tiny"),
    ]));
    let after = std::fs::read(&p).unwrap();
    assert_eq!(after.len(), before.len());
    assert!(
        after[data_offset..] == before[data_offset..],
        "tensor data moved"
    );
    assert_eq!(
        GgufFile::open(&p)
            .unwrap()
            .metadata()
            .get_str("general.name")
            .unwrap(),
        "Tiny"
    );
    // 10 KB more does not fit: refused, file unchanged.
    let big = format!("general.name={}", "x".repeat(10_000));
    let o = edit(&[p.as_os_str(), os("--in-place"), os("--set"), os(&big)]);
    assert_eq!(o.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&o.stderr).contains("does not fit"));
    assert!(std::fs::read(&p).unwrap() == after);
}

#[test]
fn inconsistent_edits_are_refused_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let src = fx("gguf/tiny-glm5-Q8_0.gguf");
    let out = dir.path().join("r.gguf");
    for (flag, arg) in [
        ("--set", "split.count=2"),
        ("--set", "glm-dsa.block_count=3"),
        ("--delete", "general.architecture"),
        ("--set", "general.alignment=64"),
        ("--set", "tokenizer.ggml.eos_token_id=1:i32"),
        ("--set", "tokenizer.ggml.eos_token_id=-5"),
        ("--set", "tokenizer.ggml.tokens=a"),
        ("--delete", "no.such.key"),
        ("--rename-tensor", "output.weight=token_embd.weight"),
        ("--rename-tensor", "nope=x"),
    ] {
        let o = edit(&[
            src.as_os_str(),
            os("-o"),
            out.as_os_str(),
            os(flag),
            os(arg),
        ]);
        assert_eq!(o.status.code(), Some(2), "{flag} {arg}");
        assert!(!out.exists(), "{flag} {arg}: output written");
        assert!(!dir.path().join("r.gguf.partial").exists());
    }
    // Forced, a type change is allowed.
    ok(&edit(&[
        src.as_os_str(),
        os("-o"),
        out.as_os_str(),
        os("--force"),
        os("--set"),
        os("tokenizer.ggml.eos_token_id=1:i32"),
    ]));
    assert_eq!(
        GgufFile::open(&out)
            .unwrap()
            .metadata()
            .get("tokenizer.ggml.eos_token_id"),
        Some(&Value::I32(1))
    );
}

#[test]
fn output_must_not_be_the_input_and_existing_outputs_need_force() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::copy(fx("gguf/tiny-glm5-Q8_0.gguf"), &p).unwrap();
    let o = edit(&[
        p.as_os_str(),
        os("-o"),
        p.as_os_str(),
        os("--set"),
        os("general.name=x"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let other = dir.path().join("o.gguf");
    std::fs::write(&other, b"keep me").unwrap();
    let o = edit(&[
        p.as_os_str(),
        os("-o"),
        other.as_os_str(),
        os("--set"),
        os("general.name=x"),
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert_eq!(std::fs::read(&other).unwrap(), b"keep me");
}
