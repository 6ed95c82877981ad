//! Every embedded table loads, is a bijection on its one-to-one entries, and covers every tensor
//! kind gguf-py lists for its architecture.

use mappings::table::{Indices, Kind};
use mappings::{architectures, table};

/// GGUF tensor kinds per architecture, transcribed from gguf-py 0.19 `MODEL_TENSORS` (constants.py)
/// with the `TENSOR_NAMES` spelling. Left out: `attn_rot_embd` (in `MODEL_TENSOR_SKIP`, never
/// written) and, for glm-dsa, `rope_freqs` / `attn_q` / `attn_kv_b` (listed but never produced for
/// GLM-5, spec §2.3). NextN kinds are per block (`blk.N.nextn.*`).
const KINDS: &[(&str, &[&str])] = &[
    (
        "glm-dsa",
        &[
            "token_embd",
            "output_norm",
            "output",
            "blk.attn_norm",
            "blk.attn_q_a",
            "blk.attn_q_a_norm",
            "blk.attn_q_b",
            "blk.attn_kv_a_mqa",
            "blk.attn_kv_a_norm",
            "blk.attn_k_b",
            "blk.attn_v_b",
            "blk.attn_output",
            "blk.ffn_norm",
            "blk.indexer.k_norm",
            "blk.indexer.proj",
            "blk.indexer.attn_k",
            "blk.indexer.attn_q_b",
            "blk.ffn_gate",
            "blk.ffn_up",
            "blk.ffn_down",
            "blk.ffn_gate_inp",
            "blk.exp_probs_b",
            "blk.ffn_gate_exps",
            "blk.ffn_up_exps",
            "blk.ffn_down_exps",
            "blk.ffn_gate_shexp",
            "blk.ffn_up_shexp",
            "blk.ffn_down_shexp",
            "blk.nextn.eh_proj",
            "blk.nextn.enorm",
            "blk.nextn.hnorm",
            "blk.nextn.shared_head_norm",
            "blk.nextn.embed_tokens",
            "blk.nextn.shared_head_head",
        ],
    ),
    (
        "deepseek2",
        &[
            "token_embd",
            "output_norm",
            "output",
            "rope_freqs",
            "blk.attn_norm",
            "blk.attn_q",
            "blk.attn_q_a",
            "blk.attn_q_b",
            "blk.attn_kv_a_mqa",
            "blk.attn_kv_b",
            "blk.attn_k_b",
            "blk.attn_v_b",
            "blk.attn_q_a_norm",
            "blk.attn_kv_a_norm",
            "blk.attn_output",
            "blk.ffn_gate_inp",
            "blk.ffn_norm",
            "blk.ffn_gate",
            "blk.ffn_down",
            "blk.ffn_up",
            "blk.ffn_gate_exps",
            "blk.ffn_down_exps",
            "blk.ffn_up_exps",
            "blk.ffn_gate_shexp",
            "blk.ffn_down_shexp",
            "blk.ffn_up_shexp",
            "blk.exp_probs_b",
        ],
    ),
    (
        "glm4moe",
        &[
            "token_embd",
            "output_norm",
            "output",
            "blk.attn_norm",
            "blk.post_attention_norm",
            "blk.attn_q",
            "blk.attn_k",
            "blk.attn_v",
            "blk.attn_output",
            "blk.attn_q_norm",
            "blk.attn_k_norm",
            "blk.ffn_gate",
            "blk.ffn_down",
            "blk.ffn_up",
            "blk.ffn_gate_inp",
            "blk.ffn_gate_exps",
            "blk.ffn_down_exps",
            "blk.ffn_up_exps",
            "blk.ffn_gate_shexp",
            "blk.ffn_down_shexp",
            "blk.ffn_up_shexp",
            "blk.exp_probs_b",
            "blk.nextn.eh_proj",
            "blk.nextn.embed_tokens",
            "blk.nextn.enorm",
            "blk.nextn.hnorm",
            "blk.nextn.shared_head_head",
            "blk.nextn.shared_head_norm",
        ],
    ),
    (
        "llama",
        &[
            "token_embd",
            "output_norm",
            "output",
            "rope_freqs",
            "blk.attn_norm",
            "blk.attn_q",
            "blk.attn_k",
            "blk.attn_v",
            "blk.attn_output",
            "blk.ffn_gate_inp",
            "blk.ffn_norm",
            "blk.ffn_gate",
            "blk.ffn_down",
            "blk.ffn_up",
            "blk.ffn_gate_exps",
            "blk.ffn_down_exps",
            "blk.ffn_up_exps",
        ],
    ),
    (
        "qwen2",
        &[
            "token_embd",
            "output_norm",
            "output",
            "rope_freqs",
            "blk.attn_norm",
            "blk.attn_q",
            "blk.attn_k",
            "blk.attn_v",
            "blk.attn_output",
            "blk.ffn_norm",
            "blk.ffn_gate",
            "blk.ffn_down",
            "blk.ffn_up",
        ],
    ),
    (
        "qwen3",
        &[
            "token_embd",
            "output_norm",
            "output",
            "rope_freqs",
            "blk.attn_norm",
            "blk.attn_q",
            "blk.attn_q_norm",
            "blk.attn_k",
            "blk.attn_k_norm",
            "blk.attn_v",
            "blk.attn_output",
            "blk.ffn_norm",
            "blk.ffn_gate",
            "blk.ffn_down",
            "blk.ffn_up",
        ],
    ),
    (
        "gemma3",
        &[
            "token_embd",
            "output",
            "output_norm",
            "blk.attn_q",
            "blk.attn_q_norm",
            "blk.attn_k",
            "blk.attn_k_norm",
            "blk.attn_v",
            "blk.attn_output",
            "blk.ffn_gate",
            "blk.ffn_down",
            "blk.ffn_up",
            "blk.attn_norm",
            "blk.post_attention_norm",
            "blk.ffn_norm",
            "blk.post_ffw_norm",
        ],
    ),
];

#[test]
fn every_table_loads() {
    assert_eq!(architectures().len(), KINDS.len());
    for arch in architectures() {
        let t = table(arch).unwrap_or_else(|e| panic!("{e}"));
        assert_eq!(t.arch, arch);
        assert!(!t.entries.is_empty());
    }
    assert!(table("no-such-arch").is_err());
}

#[test]
fn tables_cover_every_gguf_tensor_kind() {
    for (arch, kinds) in KINDS {
        let t = table(arch).unwrap();
        let stems: Vec<String> = t
            .entries
            .iter()
            .flat_map(|e| e.gguf.iter())
            .map(|p| {
                // "blk.{bid}.attn_q.weight" -> "blk.attn_q"
                let s = p.template.replace("{bid}.", "");
                let s = s
                    .strip_suffix(".weight")
                    .or(s.strip_suffix(".bias"))
                    .unwrap_or(&s);
                s.to_string()
            })
            .collect();
        for k in *kinds {
            assert!(
                stems.iter().any(|s| s == k),
                "{arch}: no entry for GGUF kind {k}"
            );
        }
        for s in &stems {
            assert!(
                kinds.contains(&s.as_str()),
                "{arch}: entry {s} is not a gguf-py kind"
            );
        }
    }
}

#[test]
fn each_table_is_a_bijection_on_its_entries() {
    for arch in architectures() {
        let t = table(arch).unwrap();
        for (ei, e) in t.entries.iter().enumerate() {
            let bid = e.layers.as_ref().map(|_| 7u64);
            let xid = (e.kind == Kind::Experts).then_some(5u64);
            let gguf = e.gguf_names(bid);
            // GGUF -> entry: every GGUF name belongs to exactly this entry and part.
            for (part, g) in gguf.iter().enumerate() {
                let hits: Vec<_> = t
                    .entries
                    .iter()
                    .filter(|o| o.gguf.iter().any(|p| p.matches(g).is_some()))
                    .collect();
                assert_eq!(hits.len(), 1, "{arch}: {g} matches {} entries", hits.len());
                let h = t.match_gguf(g).unwrap();
                assert_eq!(
                    (h.entry_index, h.part, h.idx.bid),
                    (ei, part, bid),
                    "{arch}: {g}"
                );
            }
            if e.reverse_only {
                continue;
            }
            let Some(hf) = e.hf_name(bid, xid) else {
                continue;
            };
            if e.hf.as_ref().is_some_and(|p| p.has_any) {
                continue;
            }
            // HF -> entry: unique, and it renders back the same GGUF names.
            let hits = t
                .entries
                .iter()
                .filter(|o| !o.reverse_only)
                .filter(|o| o.hf.as_ref().is_some_and(|p| p.matches(&hf).is_some()))
                .count();
            assert_eq!(hits, 1, "{arch}: {hf} matches {hits} entries");
            let h = t.match_hf(&hf).unwrap();
            assert_eq!(h.entry_index, ei, "{arch}: {hf}");
            assert_eq!(h.idx, Indices { bid, xid }, "{arch}: {hf}");
            if e.kind != Kind::HfOnly {
                assert_eq!(h.entry.gguf_names(h.idx.bid), gguf);
            }
            // and GGUF -> HF gives back the HF name
            if let Some(g) = gguf.first() {
                let back = t.match_gguf(g).unwrap();
                assert_eq!(
                    back.entry.hf_name(back.idx.bid, xid).as_deref(),
                    Some(hf.as_str())
                );
            }
        }
    }
}

#[test]
fn indices_have_one_spelling() {
    let t = table("glm-dsa").unwrap();
    assert!(t.match_gguf("blk.01.attn_norm.weight").is_none());
    assert!(t
        .match_hf("model.layers.3.mlp.experts.007.gate_proj.weight")
        .is_none());
    assert!(t
        .match_gguf("blk.99999999999999999999999.attn_norm.weight")
        .is_none());
    assert!(t.match_gguf("blk.3.attn_norm.weightx").is_none());
}

#[test]
fn prefix_aliases_of_multimodal_checkpoints() {
    let t = table("gemma3").unwrap();
    let h = t
        .match_hf("model.language_model.layers.2.self_attn.q_norm.weight")
        .unwrap();
    assert_eq!(h.entry.gguf_names(h.idx.bid), ["blk.2.attn_q_norm.weight"]);
    assert_eq!(
        t.match_hf("model.vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight")
            .map(|h| h.entry.kind),
        Some(Kind::HfOnly)
    );
}
