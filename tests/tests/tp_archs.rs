//! Tensor parallelism on every architecture the runtime runs (glm-dsa, deepseek2, glm4moe). The
//! test models are built from the mapping tables themselves: `ModelSpec::from_metadata` lists every
//! tensor (name and shape from the table) and random F32 values fill them, so a table is all an
//! architecture needs. TP 2 equals TP 1 within the derived tolerance; a split that does not divide
//! (glm4moe's KV heads) is refused naming them.

use runtime::device::load_cpu_tp;
use runtime::spec::ModelSpec;
use runtime::tp::check::{compare_greedy, tp_tolerance, Summation};
use runtime::tp::MoeSplit;
use std::sync::Arc;

use gguf::{GgmlType, Metadata, Value};

fn md(arch: &str, keys: &[(&str, Value)]) -> Metadata {
    let mut m = Metadata::new("synthetic");
    m.set("general.architecture", Value::String(arch.into()));
    for (k, v) in keys {
        m.set(&format!("{arch}.{k}"), v.clone());
    }
    m
}

fn u(v: u32) -> Value {
    Value::U32(v)
}

/// A model with every tensor its table lists, random F32 contents (norms near 1).
fn build(meta: &Metadata, path: &std::path::Path) -> Arc<gguf::Model> {
    let spec = ModelSpec::from_metadata(meta).unwrap();
    let mut s = 0x9E37_79B9_7F4A_7C15u64;
    let mut data: Vec<(String, Vec<u64>, Vec<u8>)> = Vec::new();
    for t in &spec.tensors {
        let n: usize = t.dims.iter().product();
        let norm = t.role.contains("norm");
        let bytes = (0..n)
            .flat_map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let r = (s >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                let v = if norm { 1.0 + 0.2 * r } else { 0.4 * r };
                v.to_le_bytes()
            })
            .collect();
        data.push((
            t.name.clone(),
            t.dims.iter().map(|&d| d as u64).collect(),
            bytes,
        ));
    }
    let tensors: Vec<(&str, &[u64], GgmlType, &[u8])> = data
        .iter()
        .map(|(n, d, b)| (n.as_str(), d.as_slice(), GgmlType::F32, b.as_slice()))
        .collect();
    std::fs::write(path, gguf::writer::build(meta, &tensors).unwrap()).unwrap();
    Arc::new(gguf::Model::open(path).unwrap())
}

fn common(extra: &[(&'static str, Value)]) -> Vec<(&'static str, Value)> {
    let mut v = vec![
        ("block_count", u(3)),
        ("context_length", u(256)),
        ("embedding_length", u(64)),
        ("feed_forward_length", u(128)),
        ("attention.head_count", u(4)),
        ("attention.layer_norm_rms_epsilon", Value::F32(1e-5)),
        ("rope.freq_base", Value::F32(10000.0)),
        ("rope.dimension_count", u(8)),
        ("expert_count", u(4)),
        ("expert_used_count", u(2)),
        ("expert_feed_forward_length", u(32)),
        ("expert_shared_count", u(1)),
        ("expert_weights_scale", Value::F32(1.5)),
        ("expert_weights_norm", Value::Bool(true)),
        ("leading_dense_block_count", u(1)),
        ("vocab_size", u(96)),
    ];
    v.extend(extra.iter().cloned());
    v
}

fn check(name: &str, meta: Metadata, worlds: &[usize]) {
    let dir = tempfile::tempdir().unwrap();
    let m = build(&meta, &dir.path().join(format!("{name}.gguf")));
    let one = runtime::glm::load_cpu(Arc::clone(&m)).unwrap();
    let prompt: Vec<u32> = (0..12u32).map(|i| (i * 7 + 3) % 96).collect();
    for &world in worlds {
        for moe in [MoeSplit::Columns, MoeSplit::Experts] {
            let tp = load_cpu_tp(Arc::clone(&m), world, moe, None)
                .unwrap_or_else(|e| panic!("{name} TP {world}: {e}"));
            let c = compare_greedy(
                &one,
                &tp,
                &prompt,
                12,
                tp_tolerance(one.spec(), world, Summation::Blocked8),
            )
            .unwrap();
            println!(
                "{name} TP {world} {moe:?}: max rel diff {:.2e}, identical {}/13",
                c.max_rel_diff, c.greedy_identical
            );
            assert!(
                c.failure.is_none(),
                "{name} TP {world} {moe:?}: {:?}",
                c.failure
            );
        }
    }
}

#[test]
fn glm4moe_gqa_splits_by_kv_heads() {
    let meta = md(
        "glm4moe",
        &common(&[
            ("attention.head_count_kv", u(2)),
            ("attention.key_length", u(16)),
            ("attention.value_length", u(16)),
        ]),
    );
    let spec = ModelSpec::from_metadata(&meta).unwrap();
    // The pre-FFN norm has glm4moe's own GGUF name, from its table.
    assert!(spec
        .tensors
        .iter()
        .any(|t| t.role == "ffn_norm" && t.name == "blk.0.post_attention_norm.weight"));
    check("glm4moe", meta.clone(), &[2]);
    let dir = tempfile::tempdir().unwrap();
    let m = build(&meta, &dir.path().join("g.gguf"));
    let e = load_cpu_tp(m, 4, MoeSplit::Columns, None)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("2 key/value heads") && e.contains("over 4 ranks"),
        "{e}"
    );
}

#[test]
fn deepseek2_without_q_lora_and_with_the_legacy_unsplit_kv_b() {
    let meta = md(
        "deepseek2",
        &common(&[
            // head_count_kv = head_count: the legacy layout with one attn_kv_b per layer.
            ("attention.head_count_kv", u(4)),
            ("attention.kv_lora_rank", u(32)),
            ("attention.key_length", u(24)),
            ("attention.value_length", u(16)),
        ]),
    );
    let spec = ModelSpec::from_metadata(&meta).unwrap();
    assert!(spec.kv_b_unsplit && spec.tensors.iter().any(|t| t.role == "attn_q"));
    check("deepseek2", meta, &[2, 4]);
}

#[test]
fn glm_dsa_with_an_index_shared_layer() {
    let mut meta = md(
        "glm-dsa",
        &common(&[
            ("attention.head_count_kv", u(1)),
            ("attention.q_lora_rank", u(32)),
            ("attention.kv_lora_rank", u(32)),
            ("attention.key_length", u(40)),
            ("attention.value_length", u(32)),
            ("attention.key_length_mla", u(24)),
            ("attention.value_length_mla", u(16)),
            ("attention.indexer.head_count", u(2)),
            ("attention.indexer.key_length", u(16)),
            ("attention.indexer.top_k", u(4)),
        ]),
    );
    meta.set(
        "glm-dsa.attention.indexer.types",
        gguf::writer::array_of(
            gguf::ValueType::Bool,
            vec![Value::Bool(true), Value::Bool(false), Value::Bool(true)],
        ),
    );
    // top_k 4 on a 12-token prompt: the indexer's sparse selection is active.
    check("glm-dsa", meta, &[2, 4]);
}
