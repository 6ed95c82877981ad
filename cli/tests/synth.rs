//! `synth` through the binary: complete tokenizer metadata (llama.cpp's required keys, as many
//! tokens as the output head has rows, a tokenizer our serving crate builds and round-trips),
//! the JSON summary, `--sparse` full-size files that occupy no data blocks, `--layers`.

use std::os::unix::fs::MetadataExt;
use std::process::Command;

fn synth(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_gguftool"))
        .arg("synth")
        .args(args)
        .output()
        .expect("run gguftool")
}

#[test]
fn mini_has_complete_tokenizer_metadata() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("mini.gguf");
    let o = synth(&["-o", out.to_str().unwrap(), "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(
        doc["preset"], "glm5-mini",
        "the small preset is the default"
    );
    assert_eq!(doc["layers"], 4);
    assert!(
        doc["bytes"].as_u64().unwrap() < 64 << 20,
        "a small default file"
    );
    let model = gguf::Model::open(&out).unwrap();
    let meta = model.metadata();
    for k in ["model", "pre", "tokens", "token_type", "merges"] {
        assert!(
            meta.get(&format!("tokenizer.ggml.{k}")).is_some(),
            "tokenizer.ggml.{k}"
        );
    }
    assert_eq!(meta.get_str("tokenizer.ggml.model").unwrap(), "gpt2");
    assert_eq!(meta.get_str("tokenizer.ggml.pre").unwrap(), "glm4");
    let head_rows = model.tensor("output.weight").unwrap().info.dims[1] as usize;
    assert_eq!(
        meta.get_str_array("tokenizer.ggml.tokens").unwrap().len(),
        head_rows
    );
    assert_eq!(
        meta.get_i64_array("tokenizer.ggml.token_type")
            .unwrap()
            .len(),
        head_rows
    );
    assert!(!meta
        .get_str_array("tokenizer.ggml.merges")
        .unwrap()
        .is_empty());
    let tok = serving::tokenizer::Tokenizer::from_gguf(meta).expect("tokenizer builds");
    let ids = tok.encode("hello world\n", false).expect("encode");
    assert!(!ids.is_empty());
    assert_eq!(tok.decode(&ids, false).expect("decode"), "hello world\n");
    // The runtime accepts the file's hyper-parameters.
    runtime::spec::ModelSpec::from_model(&model).expect("spec");
}

#[test]
fn sparse_full_model_is_a_hole_and_layers_apply() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("full.gguf");
    let o = synth(&[
        "--preset",
        "glm5-full",
        "--sparse",
        "-o",
        out.to_str().unwrap(),
        "--json",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let doc: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let bytes = doc["bytes"].as_u64().unwrap();
    assert!(bytes > 300 << 30, "full-size GLM-5 layout: {bytes}");
    let md = std::fs::metadata(&out).unwrap();
    assert_eq!(md.len(), bytes);
    assert!(
        md.blocks() * 512 < 64 << 20,
        "data is a hole: {} blocks",
        md.blocks()
    );
    let model = gguf::Model::open(&out).unwrap();
    let spec = runtime::spec::ModelSpec::from_model(&model).expect("spec");
    assert_eq!(spec.n_layer, 78);
    assert_eq!(spec.n_nextn(), 1);
    // An existing output is refused without --force, replaced with it.
    let o = synth(&[
        "--preset",
        "glm5-mini",
        "--layers",
        "2",
        "-o",
        out.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(2));
    let o = synth(&[
        "--preset",
        "glm5-mini",
        "--layers",
        "2",
        "-o",
        out.to_str().unwrap(),
        "--force",
        "--json",
    ]);
    assert!(o.status.success());
    let spec = runtime::spec::ModelSpec::from_model(&gguf::Model::open(&out).unwrap()).unwrap();
    assert_eq!(spec.n_layer, 2);
}
