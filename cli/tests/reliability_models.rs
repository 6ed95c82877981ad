//! `generate` on broken models (issue 14 items 7 and 8): a hostile chat template exits 2 with a
//! message instead of aborting, hyper-parameters outside their range are refused at load, and
//! NaN weights stop generation with the first bad layer named instead of printing garbage.

use gguftool_tests::{fixture, hostile_template_model, nan_weights_model, rewrite_gguf};
use std::path::Path;
use std::process::{Command, Output};

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
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
    let m = hostile_template_model(d.path());
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
        rewrite_gguf(
            &fixture("gguf/tiny-glm5-Q4_K_M.gguf"),
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
    // The doctor acceptance check's damage: BF16 quiet NaNs over attn_q_b of block 1.
    let m = nan_weights_model(d.path());
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
