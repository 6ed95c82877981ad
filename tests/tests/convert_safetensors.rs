//! GGUF -> safetensors export of the fixture GGUFs compared with the original HF checkpoint the
//! GGUF was converted from (read with the `safetensors` crate).

use mappings::export::{export_safetensors, ExportOptions, OutDtype};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

fn find(rel: &str) -> PathBuf {
    gguftool_tests::fixture(rel)
}

/// name -> (dtype, shape, f32 values)
fn load_dir(dir: &Path) -> BTreeMap<String, (safetensors::Dtype, Vec<usize>, Vec<f32>)> {
    let mut out = BTreeMap::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_none_or(|x| x != "safetensors") {
            continue;
        }
        let bytes = std::fs::read(&p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, v) in st.tensors() {
            let vals = mappings::values::to_f32(&format!("{:?}", v.dtype()), v.data()).unwrap();
            out.insert(name, (v.dtype(), v.shape().to_vec(), vals));
        }
    }
    out
}

fn json(p: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(p).unwrap()).unwrap()
}

#[test]
fn bf16_gguf_exports_the_original_checkpoint_bit_for_bit() {
    let (gguf, hf_dir) = (
        find("gguf/tiny-glm5-BF16.gguf"),
        find("hf/model-00001-of-00004.safetensors"),
    );
    let hf_dir = hf_dir.parent().unwrap().to_path_buf();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let model = gguf::Model::open(&gguf).unwrap();
    let opts = ExportOptions {
        max_shard_bytes: 4 << 20,
        ..ExportOptions::default()
    };
    let mut events = 0;
    let s = export_safetensors(&model, &out, &opts, &mut |_| {
        events += 1;
        true
    })
    .unwrap();
    assert!(!mappings::export::partial_path(&out).exists());
    assert_eq!(s.tensors, 135);
    assert!(s.shards > 1, "4 MiB shards force a sharded checkpoint");
    assert_eq!(events, 136);

    let want = load_dir(&hf_dir);
    let got = load_dir(&out);
    assert_eq!(got.len(), want.len());
    for (name, (dt, shape, vals)) in &want {
        let (gdt, gshape, gvals) = got.get(name).unwrap_or_else(|| panic!("{name} missing"));
        assert_eq!(gshape, shape, "{name}");
        let same = vals
            .iter()
            .zip(gvals)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same && vals.len() == gvals.len(), "{name}: values differ");
        // --dtype bf16 narrows only where exact: the original's BF16 tensors come back BF16, and
        // the MTP router and indexer weights (F32 in the original, not bf16-representable) stay F32
        assert_eq!(gdt, dt, "{name}");
    }
    // the index lists every tensor in a shard that exists
    let idx = json(&out.join("model.safetensors.index.json"));
    let wm = idx["weight_map"].as_object().unwrap();
    assert_eq!(wm.len(), 135);
    assert!(wm.values().all(|f| out.join(f.as_str().unwrap()).exists()));

    // config.json: the fixture's, key for key (transformers_version is not model data)
    let mut cfg = json(&hf_dir.join("config.json"));
    cfg.as_object_mut().unwrap().remove("transformers_version");
    assert_eq!(json(&out.join("config.json")), cfg);
    let tok_cfg = json(&hf_dir.join("tokenizer_config.json"));
    assert_eq!(json(&out.join("tokenizer_config.json")), tok_cfg);
    assert_eq!(
        std::fs::read_to_string(out.join("chat_template.jinja"))
            .unwrap()
            .trim_end(),
        std::fs::read_to_string(hf_dir.join("chat_template.jinja"))
            .unwrap()
            .trim_end()
    );
    let gen = json(&out.join("generation_config.json"));
    let want_gen = json(&hf_dir.join("generation_config.json"));
    assert_eq!(gen["eos_token_id"], want_gen["eos_token_id"]);
    assert_eq!(gen["pad_token_id"], want_gen["pad_token_id"]);
}

#[test]
fn tokenizer_json_is_the_original() {
    let (gguf, orig) = (find("gguf/tiny-glm5-Q8_0.gguf"), find("hf/tokenizer.json"));
    let model = gguf::Model::open(&gguf).unwrap();
    let (tok, _) = mappings::hfconfig::tokenizer_files(model.metadata(), "glm-dsa")
        .unwrap()
        .unwrap();
    let want = json(&orig);
    for key in [
        "added_tokens",
        "normalizer",
        "pre_tokenizer",
        "post_processor",
        "decoder",
        "model",
    ] {
        assert_eq!(tok[key], want[key], "{key}");
    }
}

#[test]
fn quantized_exports_are_close_and_f32_is_exact_widening() {
    let (q, bf) = (
        find("gguf/tiny-glm5-Q8_0.gguf"),
        find("gguf/tiny-glm5-BF16.gguf"),
    );
    let tmp = tempfile::tempdir().unwrap();
    // f32 export of the BF16 file: every value equal to the bf16 export's
    let m = gguf::Model::open(&bf).unwrap();
    let o32 = tmp.path().join("f32");
    let opts = ExportOptions {
        dtype: OutDtype::F32,
        ..ExportOptions::default()
    };
    export_safetensors(&m, &o32, &opts, &mut |_| true).unwrap();
    let ob = tmp.path().join("bf16");
    export_safetensors(&m, &ob, &ExportOptions::default(), &mut |_| true).unwrap();
    let (a, b) = (load_dir(&o32), load_dir(&ob));
    for (n, (dt, _, v)) in &a {
        assert_eq!(*dt, safetensors::Dtype::F32);
        assert!(
            v.iter()
                .zip(&b[n].2)
                .all(|(x, y)| x.to_bits() == y.to_bits()),
            "{n}"
        );
    }
    // Q8_0: per-block scale d (f16) times int8, so |error| <= d/2 <= max|w|/254 per block;
    // 1/100 of the tensor's max magnitude bounds it with margin
    let m = gguf::Model::open(&q).unwrap();
    let oq = tmp.path().join("q8");
    let s = export_safetensors(&m, &oq, &ExportOptions::default(), &mut |_| true).unwrap();
    assert_eq!(s.tensors, 135);
    let got = load_dir(&oq);
    for (n, (_, shape, v)) in &b {
        let (_, gs, g) = &got[n];
        assert_eq!(gs, shape, "{n}");
        let max = v.iter().fold(0f32, |m, x| m.max(x.abs()));
        let err = v.iter().zip(g).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
        assert!(
            err <= max / 100.0 + 1e-6,
            "{n}: max abs error {err} vs max {max}"
        );
    }
}

#[test]
fn failure_leaves_nothing_behind() {
    let gguf = find("gguf/tiny-glm5-BF16.gguf");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x");
    let m = gguf::Model::open(&gguf).unwrap();
    // 4 heads cannot split over 3 ranks
    let opts = ExportOptions {
        tp: Some((3, 0)),
        ..ExportOptions::default()
    };
    assert!(export_safetensors(&m, &out, &opts, &mut |_| true).is_err());
    assert!(!out.exists());
    assert!(!mappings::export::partial_path(&out).exists());
    // interrupted half-way (Ctrl-C): an error, and no partial directory
    let mut n = 0;
    let r = export_safetensors(&m, &out, &ExportOptions::default(), &mut |_| {
        n += 1;
        n < 40
    });
    assert!(
        matches!(r, Err(mappings::MappingError::Interrupted)),
        "{r:?}"
    );
    assert!(!out.exists());
    assert!(!mappings::export::partial_path(&out).exists());
    // an existing output is not replaced without `overwrite`
    std::fs::create_dir(&out).unwrap();
    assert!(export_safetensors(&m, &out, &ExportOptions::default(), &mut |_| true).is_err());
    assert!(out.exists());
}
