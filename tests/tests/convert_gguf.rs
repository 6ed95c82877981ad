//! HF -> GGUF (`mappings::import`) on the tiny-glm5 fixture, against files made by llama.cpp's own
//! tools: the converter's BF16 GGUF (byte for byte), llama-quantize's Q8_0 GGUF (ggml's
//! quantize_row_q8_0_ref, value for value), and the round trip through our safetensors export.

use mappings::import::{self, ImportOptions, OutType};
use std::path::{Path, PathBuf};

fn fixture(rel: &str) -> PathBuf {
    let p = gguftool_tests::fixtures_dir().join(rel);
    assert!(
        p.exists(),
        "fixture {} missing from tests/fixtures",
        p.display()
    );
    p
}

/// The fixture checkpoint in a directory named like the one llama.cpp's converter ran on.
fn checkpoint(tmp: &Path, name: &str) -> PathBuf {
    let dir = tmp.join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture("hf")).unwrap() {
        let p = e.unwrap().path();
        std::fs::copy(&p, dir.join(p.file_name().unwrap())).unwrap();
    }
    dir
}

fn convert(dir: &Path, opts: &ImportOptions) -> (import::Plan, Vec<Vec<u8>>) {
    let plan = import::plan(dir, opts).unwrap();
    let files = (0..plan.shards.len())
        .map(|i| {
            let mut out = vec![];
            plan.write_shard(i, &mut out, &mut |_| true).unwrap();
            out
        })
        .collect();
    (plan, files)
}

fn opts(outtype: OutType) -> ImportOptions {
    ImportOptions {
        outtype,
        ..ImportOptions::default()
    }
}

#[test]
fn bf16_is_byte_identical_to_llama_cpp_converter_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "tiny-glm5");
    let (plan, files) = convert(&dir, &opts(OutType::Bf16));
    let want = std::fs::read(fixture("gguf/tiny-glm5-BF16.gguf")).unwrap();
    assert_eq!(files.len(), 1);
    assert_eq!(files[0].len(), want.len());
    assert!(files[0] == want, "output differs from tiny-glm5-BF16.gguf");
    let s = &plan.summary;
    assert_eq!(s.name.as_deref(), Some("Tiny Glm5"));
    assert_eq!(s.size_label.as_deref(), Some("6x4.8M"));
    assert_eq!(s.pre_tokenizer, "glm4");
    // the converter's "Duplicated key name" warnings for this model (fixtures README)
    let mut d = s.duplicated_keys.clone();
    d.sort();
    assert_eq!(
        d,
        [
            "glm-dsa.attention.key_length",
            "glm-dsa.attention.value_length",
            "glm-dsa.expert_count",
            "glm-dsa.rope.dimension_count"
        ]
    );
    // auto picks bf16 from the checkpoint's first 2-D tensor
    let (_, auto) = convert(&dir, &opts(OutType::Auto));
    assert!(auto[0] == want);
}

#[test]
fn q8_0_equals_llama_quantize_on_every_q8_0_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "tiny-glm5");
    let (_, files) = convert(&dir, &opts(OutType::Q8_0));
    let path = tmp.path().join("q8.gguf");
    std::fs::write(&path, &files[0]).unwrap();
    let ours = gguf::Model::open(&path).unwrap();
    // llama-quantize tiny-glm5-BF16.gguf Q8_0: bf16 -> f32 (exact) -> ggml quantize_row_q8_0_ref
    let theirs = gguf::Model::open(fixture("gguf/tiny-glm5-Q8_0.gguf")).unwrap();
    let bf16 = gguf::Model::open(fixture("gguf/tiny-glm5-BF16.gguf")).unwrap();
    assert_eq!(ours.n_tensors(), 94);
    let (mut compared, mut f32s) = (0, 0);
    for t in ours.tensors() {
        let name = &t.info.name;
        let q = theirs.tensor(name).unwrap();
        assert_eq!(t.info.dims, q.info.dims, "{name}");
        match t.info.ty {
            gguf::GgmlType::Q8_0 if q.info.ty == gguf::GgmlType::Q8_0 => {
                assert!(
                    ours.data(&t) == theirs.data(&q),
                    "{name}: Q8_0 blocks differ"
                );
                compared += 1;
            }
            gguf::GgmlType::F32 => {
                // the converter's F32 rule (1-D, norms, router, indexer.proj): same values as
                // in its BF16 output
                let b = bf16.tensor(name).unwrap();
                assert_eq!(b.info.ty, gguf::GgmlType::F32, "{name}");
                assert!(ours.data(&t) == bf16.data(&b), "{name}");
                f32s += 1;
            }
            other => panic!(
                "{name}: unexpected {other:?} (llama-quantize: {:?})",
                q.info.ty
            ),
        }
    }
    // every 2-D/3-D weight but the F32-forced ones is Q8_0 (ne0 is a multiple of 32 everywhere)
    assert_eq!((compared, f32s), (56, 38));
    assert_eq!(
        ours.metadata()
            .get("general.file_type")
            .and_then(|v| v.as_u64()),
        Some(7)
    );
}

#[test]
fn gguf_to_safetensors_to_gguf_gives_back_the_original_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    let want = std::fs::read(fixture("gguf/tiny-glm5-BF16.gguf")).unwrap();
    let model = gguf::Model::open(fixture("gguf/tiny-glm5-BF16.gguf")).unwrap();
    for (dir_name, model_name) in [("tiny-glm5", None), ("exported", Some("Tiny Glm5"))] {
        let dir = tmp.path().join(dir_name);
        mappings::export::export_safetensors(
            &model,
            &dir,
            &mappings::export::ExportOptions::default(),
            &mut |_| true,
        )
        .unwrap();
        let o = ImportOptions {
            outtype: OutType::Bf16,
            model_name: model_name.map(String::from),
            ..ImportOptions::default()
        };
        let (_, files) = convert(&dir, &o);
        assert!(
            files[0] == want,
            "round trip through {dir_name} changed the file"
        );
    }
}

#[test]
fn split_output_follows_gguf_py_and_reassembles() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "tiny-glm5");
    let o = ImportOptions {
        outtype: OutType::Bf16,
        split_max_tensors: Some(32),
        ..ImportOptions::default()
    };
    let (plan, files) = convert(&dir, &o);
    assert_eq!(files.len(), 3);
    let counts: Vec<usize> = plan.shards.iter().map(|s| s.range.len()).collect();
    assert_eq!(counts, [32, 32, 30]);
    let paths = import::shard_paths(&tmp.path().join("out.gguf"), 3);
    assert!(paths[1].ends_with("out-00002-of-00003.gguf"));
    for (p, f) in paths.iter().zip(&files) {
        std::fs::write(p, f).unwrap();
    }
    let split = gguf::Model::open(&paths[0]).unwrap();
    let whole = gguf::Model::open(fixture("gguf/tiny-glm5-BF16.gguf")).unwrap();
    assert_eq!(split.shards().len(), 3);
    let s0 = split.shards()[0].metadata();
    assert_eq!(s0.get("split.count").and_then(|v| v.as_u64()), Some(3));
    assert_eq!(
        s0.get("split.tensors.count").and_then(|v| v.as_u64()),
        Some(94)
    );
    assert_eq!(
        split.shards()[1].metadata().len(),
        3,
        "later shards carry only split keys"
    );
    for (a, b) in whole.tensors().zip(split.tensors()) {
        assert_eq!(a.info.name, b.info.name);
        assert!(whole.data(&a) == split.data(&b), "{}", a.info.name);
    }
    // by size: gguf-py compares unpadded tensor bytes with the limit
    let o = ImportOptions {
        outtype: OutType::Bf16,
        split_max_bytes: Some(5_000_000),
        ..ImportOptions::default()
    };
    let plan = import::plan(&dir, &o).unwrap();
    for s in &plan.shards {
        let bytes: u64 = plan.tensors[s.range.clone()].iter().map(|t| t.bytes).sum();
        assert!(bytes <= 5_000_000 || s.range.len() == 1);
    }
    assert!(plan.shards.len() > 1);
}

#[test]
fn bad_checkpoints_are_refused_with_the_reason() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "tiny-glm5");
    // a pre-tokenizer the table does not know
    let tok_path = dir.join("tokenizer.json");
    let tok = std::fs::read_to_string(&tok_path).unwrap();
    std::fs::write(&tok_path, tok.replace(r"\\p{N}{1,3}", r"\\p{N}{1,2}")).unwrap();
    let e = import::plan(&dir, &opts(OutType::Bf16))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("unknown BPE pre-tokenizer"), "{e}");
    std::fs::write(&tok_path, tok).unwrap();
    // an architecture without a recipe
    let cfg_path = dir.join("config.json");
    let cfg = std::fs::read_to_string(&cfg_path).unwrap();
    std::fs::write(
        &cfg_path,
        cfg.replace("GlmMoeDsaForCausalLM", "FooForCausalLM"),
    )
    .unwrap();
    let e = import::plan(&dir, &opts(OutType::Bf16))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("FooForCausalLM is not supported"), "{e}");
    std::fs::write(&cfg_path, &cfg).unwrap();
    // a truncated shard: the header check names the file
    let shard = dir.join("model-00002-of-00004.safetensors");
    let b = std::fs::read(&shard).unwrap();
    std::fs::write(&shard, &b[..b.len() / 2]).unwrap();
    let e = import::plan(&dir, &opts(OutType::Bf16))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("model-00002-of-00004.safetensors"), "{e}");
    std::fs::write(&shard, &b).unwrap();
    // a shard missing from the index
    std::fs::remove_file(dir.join("model-00004-of-00004.safetensors")).unwrap();
    assert!(import::plan(&dir, &opts(OutType::Bf16)).is_err());
}

fn sha(b: &[u8]) -> String {
    use sha2::Digest;
    sha2::Sha256::digest(b)
        .iter()
        .map(|x| format!("{x:02x}"))
        .collect()
}

/// sha256 of the files llama.cpp's converter (source of 2026-10-01, torch 2.15 CPU, transformers
/// 5.24, with the fixtures' one-clause pre-tokenizer-hash patch) wrote from this checkpoint in a
/// directory named tiny-glm5: `convert_hf_to_gguf.py tiny-glm5 --outtype T --outfile x.gguf`
/// (and `--split-max-tensors 32` / `--split-max-size 5M` with bf16). Recorded once from the
/// converter's output, not from ours; docs/BENCHMARKS.md has the commands.
/// (outtype, --split-max-tensors, --split-max-size, sha256 per output file)
type Case = (
    &'static str,
    Option<usize>,
    Option<u64>,
    &'static [&'static str],
);

const CONVERTER_SHA256: [Case; 5] = [
    (
        "q8_0",
        None,
        None,
        &["9b3d96dcbb8bfa546135e288a556ab84b29f9fadd7797e4d6fdccd3761c49910"],
    ),
    (
        "f16",
        None,
        None,
        &["b0a0f0a5f64f7dfd86b5e25970758452e5df3e4ec5aefb50c77095a9cd44a063"],
    ),
    (
        "f32",
        None,
        None,
        &["6d4a1ff3372ca291d34c8c3f5715e79b5b44efddf5e5c23c656fece0b63a04a5"],
    ),
    (
        "bf16",
        Some(32),
        None,
        &[
            "a3a5a00f0f89221f3b702d2bbeed3a11967abc45cf564270228470c3cb44bab8",
            "3f2873b259a4e97fa69f556b53e18d7115fe88a12e80f43dd9119ac97e1fd112",
            "37cc0ef25e3bd0aed31dca8b850f8cf5f0824ca9c120e6c8719cd381249b1990",
        ],
    ),
    (
        "bf16",
        None,
        Some(5_000_000),
        &[
            "5ef571a82c2859663c9fa1e7a1b704ab69a1b98fc525214add3030f369daeaa0",
            "b973b472a8e3f1d7f35218b5f019eb9d4a5c9cd3739ab901ae577443b98fadda",
            "8826f94287babbf868a9836b45cfcb4fcbb7841c9413d48d6e5cb5611580676d",
            "8544b7ca9569a59eb97cfff2ed9a7e729fc2c8a1379c9eb0a89b57d5c5a4f1a8",
        ],
    ),
];

#[test]
fn every_outtype_and_split_equals_llama_cpp_converter_output() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = checkpoint(tmp.path(), "tiny-glm5");
    for (t, max_tensors, max_bytes, want) in CONVERTER_SHA256 {
        let outtype = match t {
            "q8_0" => OutType::Q8_0,
            "f16" => OutType::F16,
            "f32" => OutType::F32,
            _ => OutType::Bf16,
        };
        let o = ImportOptions {
            outtype,
            split_max_tensors: max_tensors,
            split_max_bytes: max_bytes,
            ..ImportOptions::default()
        };
        let (_, files) = convert(&dir, &o);
        let got: Vec<String> = files.iter().map(|f| sha(f)).collect();
        assert_eq!(got, want, "{t} {max_tensors:?} {max_bytes:?}");
    }
}
