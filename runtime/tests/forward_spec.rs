//! `ModelSpec` from the fixture GGUF against the HF config it was converted from
//! (`tests/fixtures/hf/config.json`), and the refusals for models that do not fit.

use gguf::{Metadata, Value};
use runtime::backend::{Gating, RopeStyle};
use runtime::glm::GlmModel;
use runtime::spec::{Arch, AttentionSpec, FfnKind, ModelSpec};
use std::path::PathBuf;
use std::sync::Arc;

fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel)
}

fn bf16() -> gguf::Model {
    gguf::Model::open(fixture("gguf/tiny-glm5-BF16.gguf")).unwrap()
}

fn dims_of(m: &gguf::Model) -> impl Fn(&str) -> Option<Vec<usize>> + '_ {
    |name| {
        m.tensor(name)
            .map(|t| t.info.dims.iter().map(|&d| d as usize).collect())
    }
}

#[test]
fn spec_of_the_fixture_matches_its_hf_config() {
    let cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("hf/config.json")).unwrap()).unwrap();
    let u = |k: &str| cfg[k].as_u64().unwrap() as usize;
    let s = ModelSpec::from_model(&bf16()).unwrap();
    assert_eq!(s.arch, Arch::GlmDsa);
    assert_eq!(s.n_vocab, u("vocab_size"));
    assert_eq!(s.n_embd, u("hidden_size"));
    assert_eq!(s.n_layer, u("num_hidden_layers"));
    assert_eq!(s.n_nextn(), u("num_nextn_predict_layers"));
    assert_eq!(s.n_ctx_train, u("max_position_embeddings"));
    assert_eq!(s.n_ff, u("intermediate_size"));
    assert_eq!(s.rms_eps, cfg["rms_norm_eps"].as_f64().unwrap() as f32);
    assert_eq!(
        s.rope.theta as f64,
        cfg["rope_parameters"]["rope_theta"].as_f64().unwrap()
    );
    assert_eq!(s.rope.n_rot, u("qk_rope_head_dim"));
    assert_eq!(s.rope.style, RopeStyle::Interleaved);
    let AttentionSpec::Mla(m) = s.attention else {
        panic!("not MLA")
    };
    assert_eq!(m.n_head, u("num_attention_heads"));
    assert_eq!(m.q_lora_rank, Some(u("q_lora_rank")));
    assert_eq!(m.kv_lora_rank, u("kv_lora_rank"));
    assert_eq!(m.qk_nope, u("qk_nope_head_dim"));
    assert_eq!(m.qk_rope, u("qk_rope_head_dim"));
    assert_eq!(m.v_head, u("v_head_dim"));
    assert_eq!(m.scale, (u("qk_head_dim") as f64).powf(-0.5) as f32);
    assert_eq!(m.lora_norm_eps, 1e-6);
    let ix = s.indexer.unwrap();
    assert_eq!(
        (ix.n_head, ix.head_dim, ix.top_k),
        (u("index_n_heads"), u("index_head_dim"), u("index_topk"))
    );
    let e = s.moe.unwrap();
    assert_eq!(e.n_expert, u("n_routed_experts"));
    assert_eq!(e.n_used, u("num_experts_per_tok"));
    assert_eq!(e.n_ff, u("moe_intermediate_size"));
    assert_eq!(e.n_shared, u("n_shared_experts"));
    assert_eq!((e.n_group, e.n_group_used), (u("n_group"), u("topk_group")));
    assert_eq!(e.gating, Gating::Sigmoid);
    assert_eq!(e.normalize, cfg["norm_topk_prob"].as_bool().unwrap());
    assert_eq!(
        e.scale as f64,
        cfg["routed_scaling_factor"].as_f64().unwrap()
    );
    let kinds: Vec<&str> = cfg["mlp_layer_types"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    for (l, k) in s.layers.iter().zip(&kinds) {
        assert_eq!(l.ffn == FfnKind::Dense, *k == "dense", "layer {}", l.index);
        assert!(l.own_indexer && !l.mtp);
    }
    assert!(s.layers[3].mtp);
    assert!(!s.tied_output && !s.kv_b_unsplit);
}

#[test]
fn wrong_or_missing_tensors_are_refused_by_name() {
    let m = bf16();
    let real = dims_of(&m);
    let mut s = ModelSpec::from_metadata(m.metadata()).unwrap();
    let e = s
        .check_tensors(|n| {
            if n == "blk.1.attn_q_b.weight" {
                Some(vec![256, 383])
            } else {
                real(n)
            }
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.1.attn_q_b.weight") && e.contains("[256, 383]") && e.contains("[256, 384]"),
        "{e}"
    );
    let e = s
        .check_tensors(|n| {
            if n == "blk.2.ffn_down_exps.weight" {
                None
            } else {
                real(n)
            }
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("blk.2.ffn_down_exps.weight") && e.contains("missing"),
        "{e}"
    );
    // The NextN block is optional as a whole, but checked when present.
    s.check_tensors(|n| {
        if n.starts_with("blk.3.") {
            None
        } else {
            real(n)
        }
    })
    .unwrap();
    let e = s
        .check_tensors(|n| {
            if n == "blk.3.nextn.hnorm.weight" {
                None
            } else {
                real(n)
            }
        })
        .unwrap_err()
        .to_string();
    assert!(e.contains("blk.3.nextn.hnorm.weight"), "{e}");
}

fn with(md: &Metadata, key: &str, v: Option<Value>) -> Metadata {
    let mut m = md.clone();
    match v {
        Some(v) => m.set(key, v),
        None => {
            m.remove(key);
        }
    }
    m
}

#[test]
fn bad_hyper_parameters_are_refused() {
    let m = bf16();
    let md = m.metadata();
    let e = ModelSpec::from_metadata(&with(
        md,
        "general.architecture",
        Some(Value::String("llama".into())),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("llama"), "{e}");
    let e = ModelSpec::from_metadata(&with(md, "glm-dsa.attention.kv_lora_rank", None))
        .unwrap_err()
        .to_string();
    assert!(e.contains("glm-dsa.attention.kv_lora_rank"), "{e}");
    let e = ModelSpec::from_metadata(&with(md, "glm-dsa.expert_used_count", Some(Value::U32(7))))
        .unwrap_err()
        .to_string();
    assert!(e.contains("experts"), "{e}");
    let e = ModelSpec::from_metadata(&with(
        md,
        "glm-dsa.nextn_predict_layers",
        Some(Value::U32(4)),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("nextn"), "{e}");
    let e = ModelSpec::from_metadata(&with(
        md,
        "glm-dsa.rope.scaling.type",
        Some(Value::String("yarn".into())),
    ))
    .unwrap_err()
    .to_string();
    assert!(e.contains("yarn"), "{e}");
    // A shared-indexer layer pattern is honoured (GLM-5.2 IndexShare).
    let types = Value::Array(gguf::Array {
        elem_type: gguf::ValueType::Bool,
        values: vec![Value::Bool(true), Value::Bool(false), Value::Bool(true)],
    });
    let s = ModelSpec::from_metadata(&with(md, "glm-dsa.attention.indexer.types", Some(types)))
        .unwrap();
    assert_eq!(
        s.layers.iter().map(|l| l.own_indexer).collect::<Vec<_>>(),
        vec![true, false, true, true]
    );
}

#[test]
fn the_nextn_block_is_loaded_for_later_use() {
    let lm = GlmModel::load(runtime::cpu::CpuBackend, Arc::new(bf16())).unwrap();
    assert_eq!(lm.mtp_layers().len(), 1);
    let mtp = &lm.mtp_layers()[0];
    assert_eq!(mtp.eh_proj.dims(), &[512, 256]);
    assert!(mtp.embed_tokens.is_none() && mtp.shared_head_head.is_none());
}
