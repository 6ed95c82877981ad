//! `generate` on broken models (issue 14 items 7 and 8): a hostile chat template exits 2 with a
//! message instead of aborting, hyper-parameters outside their range are refused at load, and
//! NaN weights stop generation with the first bad layer named instead of printing garbage.

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

/// A copy of `src` with `edit` applied to its metadata and `patch` to its tensors' bytes.
fn rewrite(
    src: &Path,
    dst: &Path,
    edit: impl FnOnce(&mut gguf::Metadata),
    patch: impl Fn(&str, &mut Vec<u8>),
) {
    let m = gguf::GgufFile::open(src).unwrap();
    let mut meta = m.metadata().clone();
    edit(&mut meta);
    let tensors: Vec<(String, Vec<u64>, gguf::GgmlType, Vec<u8>)> = m
        .tensors()
        .iter()
        .map(|t| {
            let mut b = m.tensor_data(t).to_vec();
            patch(&t.name, &mut b);
            (t.name.clone(), t.dims.clone(), t.ty, b)
        })
        .collect();
    let refs: Vec<(&str, &[u64], gguf::GgmlType, &[u8])> = tensors
        .iter()
        .map(|(n, d, t, b)| (n.as_str(), d.as_slice(), *t, b.as_slice()))
        .collect();
    std::fs::write(dst, gguf::writer::build(&meta, &refs).unwrap()).unwrap();
}

fn generate(model: &Path, extra: &[&str]) -> Output {
    bin()
        .args([
            "generate",
            "-m",
            model.to_str().unwrap(),
            "-n",
            "4",
            "--temp",
            "0",
        ])
        .args(extra)
        .output()
        .unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn a_hostile_chat_template_is_an_error_not_an_abort() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("hostile.gguf");
    rewrite(
        &fx("gguf/tiny-glm5-Q4_K_M.gguf"),
        &m,
        |meta| {
            meta.set(
                "tokenizer.chat_template",
                gguf::Value::String(
                    "{% set s='x'*100000 %}{% for i in range(100000) %}{{s}}{% endfor %}".into(),
                ),
            )
        },
        |_, _| {},
    );
    let o = generate(&m, &["--chat", "-p", "hi"]);
    assert_eq!(o.status.code(), Some(2), "{}", stderr(&o));
    assert!(stderr(&o).contains("chat template"), "{}", stderr(&o));
    // Without --chat the same model still generates.
    let o = generate(&m, &["-p", "1 2 3"]);
    assert!(o.status.success(), "{}", stderr(&o));
}

#[test]
fn out_of_range_hyper_parameters_are_refused_at_load() {
    let d = tempfile::tempdir().unwrap();
    for (key, v) in [
        ("glm-dsa.rope.freq_base", gguf::Value::F32(0.0)),
        (
            "glm-dsa.attention.layer_norm_rms_epsilon",
            gguf::Value::F32(-1e-5),
        ),
    ] {
        let m = d.path().join("bad.gguf");
        rewrite(
            &fx("gguf/tiny-glm5-Q4_K_M.gguf"),
            &m,
            |meta| meta.set(key, v.clone()),
            |_, _| {},
        );
        let o = generate(&m, &["-p", "1 2 3", "--device", "cpu"]);
        assert_eq!(o.status.code(), Some(2), "{key}: {}", stderr(&o));
        assert!(stderr(&o).contains(key), "{key}: {}", stderr(&o));
        assert!(o.stdout.is_empty(), "{key}: printed {:?}", o.stdout);
    }
}

#[test]
fn nan_weights_stop_generation_naming_the_first_bad_layer() {
    let d = tempfile::tempdir().unwrap();
    let m = d.path().join("nan.gguf");
    // The doctor acceptance check's damage: BF16 quiet NaNs over attn_q_b of block 1.
    rewrite(
        &fx("gguf/tiny-glm5-BF16.gguf"),
        &m,
        |_| {},
        |name, b| {
            if name == "blk.1.attn_q_b.weight" {
                let n = b.len().min(4096);
                for pair in b[..n].chunks_exact_mut(2) {
                    pair.copy_from_slice(&[0xc0, 0x7f]);
                }
            }
        },
    );
    let o = generate(&m, &["-p", "1 2 3", "--device", "cpu", "--json"]);
    let e = stderr(&o);
    assert_eq!(o.status.code(), Some(2), "{e}");
    assert!(e.contains("non-finite logits"), "{e}");
    assert!(e.contains("layer 1 (blk.1.attn_q_b.out)"), "{e}");
    assert!(o.stdout.is_empty(), "garbage printed: {:?}", o.stdout);
}

#[test]
fn invalid_sampling_settings_are_refused_like_serve_refuses_them() {
    for args in [
        ["--temp", "-1"],
        ["--temp", "nan"],
        ["--temp", "inf"],
        ["--top-p", "5"],
        ["--min-p", "-0.5"],
    ] {
        let o = bin()
            .args(["generate", "-p", "1 2 3", "-n", "1"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(o.status.code(), Some(2), "{args:?}");
        assert!(
            stderr(&o).contains("must be between"),
            "{args:?}: {}",
            stderr(&o)
        );
    }
}
