//! Defects of issue 17 found while using the CLI as a new user: `map` on an HF directory whose
//! weight files are not there, a bad magic printed as bytes, and shell completions.

use std::path::PathBuf;
use std::process::Command;

fn fx(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn tool(args: &[&std::ffi::OsStr]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .args(args)
        .output()
        .expect("run gguftool")
}

fn json(o: &std::process::Output) -> serde_json::Value {
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    serde_json::from_slice(&o.stdout).expect("json")
}

#[test]
fn map_reads_names_from_the_index_without_weight_files() {
    // A directory with config.json and the index but no .safetensors files, as a user has
    // after downloading only the small files of a checkpoint.
    let dir = tempfile::tempdir().expect("tempdir");
    let hf = dir.path().to_path_buf();
    for f in ["config.json", "model.safetensors.index.json"] {
        std::fs::copy(fx("hf").join(f), hf.join(f)).expect("copy fixture");
    }
    assert!(!std::fs::read_dir(&hf).unwrap().any(|e| e
        .unwrap()
        .path()
        .extension()
        .is_some_and(|x| x == "safetensors")));
    let from_hf = json(&tool(&[
        "map".as_ref(),
        hf.as_os_str(),
        "--json".as_ref(),
        "--direction".as_ref(),
        "gguf-to-hf".as_ref(),
    ]));
    let from_gguf = json(&tool(&[
        "map".as_ref(),
        fx("gguf/tiny-glm5-BF16.gguf").as_os_str(),
        "--json".as_ref(),
    ]));
    // The same table from both sides: every GGUF tensor, none unmapped.
    let names = |v: &serde_json::Value| {
        let mut n: Vec<String> = v["rows"]
            .as_array()
            .unwrap()
            .iter()
            .map(|r| r.to_string())
            .collect();
        n.sort();
        n
    };
    assert!(!from_hf["rows"].as_array().unwrap().is_empty());
    assert_eq!(names(&from_hf), names(&from_gguf));
}

#[test]
fn bad_magic_is_shown_as_text() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("zip.gguf");
    std::fs::write(&p, b"PK\x03\x04 this is a zip file, not a model").unwrap();
    let o = tool(&["info".as_ref(), p.as_os_str()]);
    assert_eq!(o.status.code(), Some(2));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains(r#"starts with "PK\x03\x04""#), "{err}");
    assert!(!err.contains("[50, 4b"), "{err}");
}

#[test]
fn completions_for_each_shell() {
    for (shell, marker) in [
        ("bash", "_gguftool()"),
        ("zsh", "#compdef gguftool"),
        ("fish", "complete -c gguftool"),
    ] {
        let o = tool(&["completions".as_ref(), shell.as_ref()]);
        assert!(o.status.success(), "{shell}");
        let s = String::from_utf8_lossy(&o.stdout);
        assert!(s.contains(marker), "{shell}");
        // Subcommands, including the new ones, are completed.
        for sub in ["quantize", "edit", "verify"] {
            assert!(s.contains(sub), "{shell}: {sub}");
        }
    }
    let o = tool(&["completions".as_ref(), "tcsh".as_ref()]);
    assert_eq!(o.status.code(), Some(2));
}
