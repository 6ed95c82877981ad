//! `check_architecture` on the fixture GGUFs (llama.cpp's own files: they must pass cleanly) and on
//! deliberately broken variants; expected GLM-5 full-size shapes from spec §2.3.

use mappings::arch_check::check_parts;
use mappings::table::{Env, MetaVal};
use mappings::{check_architecture, table};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A fixture GGUF by its name under `tests/fixtures/gguf`.
fn gguf_fixture(rel: &str) -> PathBuf {
    gguftool_tests::fixture(&format!("gguf/{rel}"))
}

#[test]
fn fixture_ggufs_have_the_glm_dsa_layout() {
    for f in [
        "tiny-glm5-BF16.gguf",
        "tiny-glm5-Q8_0.gguf",
        "tiny-glm5-Q6_K.gguf",
        "tiny-glm5-Q4_K_M.gguf",
        "split/tiny-glm5-Q4_K_M-00002-of-00003.gguf",
    ] {
        let p = gguf_fixture(f);
        let m = gguf::Model::open(&p).unwrap();
        let rep = check_architecture(&m).unwrap();
        assert!(rep.is_ok(), "{f}: {rep:#?}");
        assert_eq!(rep.checked_tensors, 94, "{f}");
    }
}

type Meta = BTreeMap<String, MetaVal>;
type Tensors = Vec<(String, Vec<u64>)>;

/// The BF16 fixture's metadata and tensor list, for mutation.
fn parts() -> (Meta, Tensors) {
    let p = gguf_fixture("tiny-glm5-BF16.gguf");
    let m = gguf::Model::open(&p).unwrap();
    let meta = m
        .metadata()
        .iter()
        .filter_map(|(k, _)| {
            mappings::table::MetaSource::meta(m.metadata(), k).map(|v| (k.to_string(), v))
        })
        .collect();
    let t = m
        .tensors()
        .map(|r| (r.info.name.clone(), r.info.dims.clone()))
        .collect();
    (meta, t)
}

fn run(meta: &BTreeMap<String, MetaVal>, t: &[(String, Vec<u64>)]) -> mappings::ArchReport {
    let v: Vec<(&str, &[u64])> = t.iter().map(|(n, d)| (n.as_str(), d.as_slice())).collect();
    check_parts(table("glm-dsa").unwrap(), meta, &v)
}

#[test]
fn broken_variants_are_reported() {
    let (meta, tensors) = parts();
    assert!(run(&meta, &tensors).is_ok());

    // a missing tensor
    let t: Vec<_> = tensors
        .iter()
        .filter(|(n, _)| n != "blk.2.attn_v_b.weight")
        .cloned()
        .collect();
    assert_eq!(run(&meta, &t).missing_tensors, ["blk.2.attn_v_b.weight"]);

    // a wrong shape
    let mut t = tensors.clone();
    let i = t
        .iter()
        .position(|(n, _)| n == "blk.1.ffn_up_exps.weight")
        .unwrap();
    t[i].1 = vec![256, 256, 5];
    let r = run(&meta, &t);
    assert_eq!(r.wrong_shapes.len(), 1);
    assert_eq!(r.wrong_shapes[0].expected, [256, 256, 6]);

    // experts in the dense block, an unknown name, a block past block_count
    let mut t = tensors.clone();
    t.push(("blk.0.ffn_gate_exps.weight".into(), vec![256, 256, 6]));
    t.push(("blk.1.mystery.weight".into(), vec![4]));
    t.push(("blk.4.attn_norm.weight".into(), vec![256]));
    let r = run(&meta, &t);
    let names: Vec<&str> = r
        .unexpected_tensors
        .iter()
        .map(|u| u.name.as_str())
        .collect();
    assert_eq!(
        names,
        [
            "blk.0.ffn_gate_exps.weight",
            "blk.1.mystery.weight",
            "blk.4.attn_norm.weight"
        ]
    );

    // missing and inconsistent metadata
    let mut m = meta.clone();
    m.remove("glm-dsa.attention.kv_lora_rank");
    m.insert("glm-dsa.attention.head_count_kv".into(), MetaVal::Int(4));
    m.insert(
        "glm-dsa.attention.layer_norm_rms_epsilon".into(),
        MetaVal::Str,
    );
    let r = run(&m, &tensors);
    let keys: Vec<&str> = r.metadata_issues.iter().map(|i| i.key.as_str()).collect();
    assert!(keys.contains(&"glm-dsa.attention.kv_lora_rank"), "{r:#?}");
    assert!(
        keys.contains(&"glm-dsa.attention.layer_norm_rms_epsilon"),
        "{r:#?}"
    );
    assert!(
        r.inconsistent_metadata
            .iter()
            .any(|s| s.contains("head_count_kv")),
        "{r:#?}"
    );
    // shapes that need kv_lora are not guessed at
    assert!(r.wrong_shapes.is_empty(), "{r:#?}");
}

#[test]
fn glm5_full_size_shapes() {
    // spec §2.2 metadata of GLM-5
    let ints = [
        ("block_count", 79),
        ("context_length", 202752),
        ("embedding_length", 6144),
        ("feed_forward_length", 12288),
        ("attention.head_count", 64),
        ("attention.head_count_kv", 1),
        ("expert_used_count", 8),
        ("expert_group_count", 1),
        ("expert_group_used_count", 1),
        ("attention.key_length", 576),
        ("attention.value_length", 512),
        ("leading_dense_block_count", 3),
        ("vocab_size", 154880),
        ("attention.q_lora_rank", 2048),
        ("attention.kv_lora_rank", 512),
        ("attention.key_length_mla", 256),
        ("attention.value_length_mla", 256),
        ("expert_feed_forward_length", 2048),
        ("expert_count", 256),
        ("expert_shared_count", 1),
        ("rope.dimension_count", 64),
        ("nextn_predict_layers", 1),
        ("attention.indexer.head_count", 32),
        ("attention.indexer.key_length", 128),
        ("attention.indexer.top_k", 2048),
    ];
    let mut meta: BTreeMap<String, MetaVal> = ints
        .iter()
        .map(|(k, v)| (format!("glm-dsa.{k}"), MetaVal::Int(*v)))
        .collect();
    meta.insert(
        "glm-dsa.attention.layer_norm_rms_epsilon".into(),
        MetaVal::Float(1e-5),
    );
    let t = table("glm-dsa").unwrap();
    let env = Env::new(t, &meta);
    let shape = |name: &str| {
        let h = t.match_gguf(name).unwrap();
        env.shape(h.entry, h.part, h.idx.bid).unwrap()
    };
    assert_eq!(shape("blk.5.attn_k_b.weight"), [192, 512, 64]);
    assert_eq!(shape("blk.5.attn_v_b.weight"), [512, 256, 64]);
    assert_eq!(shape("blk.5.ffn_gate_exps.weight"), [6144, 2048, 256]);
    assert_eq!(shape("blk.5.ffn_down_exps.weight"), [2048, 6144, 256]);
    assert_eq!(shape("blk.0.attn_q_b.weight"), [2048, 16384]);
    assert_eq!(shape("blk.0.attn_kv_a_mqa.weight"), [6144, 576]);
    assert_eq!(shape("blk.0.attn_output.weight"), [16384, 6144]);
    assert_eq!(shape("blk.78.nextn.eh_proj.weight"), [12288, 6144]);
    assert_eq!(shape("blk.0.indexer.attn_q_b.weight"), [2048, 4096]);
    assert_eq!(shape("token_embd.weight"), [6144, 154880]);
    // spec §2.3 tensor count: 3 + 3*18 + 75*23 + 27 = 1809 required tensors
    let mut names = vec![];
    for e in t
        .entries
        .iter()
        .filter(|e| !e.optional && !e.gguf.is_empty() && !e.reverse_only)
    {
        let bids: Vec<Option<u64>> = if e.layers.is_some() {
            (0..79).map(Some).collect()
        } else {
            vec![None]
        };
        for b in bids {
            if env.entry_applies(e, b).unwrap() {
                names.extend(e.gguf_names(b));
            }
        }
    }
    // the 5 indexer tensors per block are optional in llama.cpp: 79 * 5 = 395 of the 1809
    assert_eq!(names.len() + 79 * 5, 1809);
}
