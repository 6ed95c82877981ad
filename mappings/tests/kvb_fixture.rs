//! kv_b split/reassembly on the real tiny-glm5 checkpoint. Ground truth: the HF safetensors (read
//! with the `safetensors` crate) and the sha256 of the converter's attn_k_b/attn_v_b bytes in the
//! BF16 GGUF as recorded by gguf-py (stats-tiny-glm5.json).

use mappings::kvb::{self, MlaDims};
use mappings::values;
use serde_json::Value;
use sha2::{Digest, Sha256};
use std::path::PathBuf;

/// A fixture under `tests/fixtures`; a missing one fails the test (the repo carries them all).
fn find(rel: &str) -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures")
        .join(rel);
    assert!(p.exists(), "fixture {rel} is missing from tests/fixtures");
    p
}

/// tiny-glm5 config.json: 4 heads, qk_nope 64, v_head 64, kv_lora 256.
const D: MlaDims = MlaDims {
    n_head: 4,
    qk_nope: 64,
    v_head: 64,
    kv_lora: 256,
};

fn gguf_sha(stats: &Value, name: &str) -> String {
    let f = stats["files"]
        .as_array()
        .unwrap()
        .iter()
        .find(|f| f["file"] == "tiny-glm5-BF16.gguf")
        .unwrap();
    let t = f["tensors"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["name"] == name)
        .unwrap();
    t["sha256_raw"].as_str().unwrap().to_string()
}

#[test]
fn split_of_hf_kv_b_is_the_converters_attn_k_b_and_attn_v_b() {
    let stats = find("stats-tiny-glm5.json");
    let stats: Value = serde_json::from_str(&std::fs::read_to_string(stats).unwrap()).unwrap();
    let mut checked = 0;
    for shard in 1..=4 {
        let p = find(&format!("hf/model-0000{shard}-of-00004.safetensors"));
        let bytes = std::fs::read(p).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, view) in st.tensors() {
            let Some(layer) = name
                .strip_prefix("model.layers.")
                .and_then(|r| r.strip_suffix(".self_attn.kv_b_proj.weight"))
            else {
                continue;
            };
            assert_eq!(view.dtype(), safetensors::Dtype::BF16);
            assert_eq!(view.shape(), D.kv_b_shape());
            let w = values::u16_words(view.data());
            let (k, v) = kvb::split(&w, D).unwrap();
            let sha = |x: &[u16]| format!("{:x}", Sha256::digest(values::u16_bytes(x)));
            assert_eq!(
                sha(&k),
                gguf_sha(&stats, &format!("blk.{layer}.attn_k_b.weight")),
                "{name}"
            );
            assert_eq!(
                sha(&v),
                gguf_sha(&stats, &format!("blk.{layer}.attn_v_b.weight")),
                "{name}"
            );
            // and back, bit for bit
            assert_eq!(kvb::reassemble(&k, &v, D).unwrap(), w);
            // TP=2 and TP=4: each rank's slice equals slicing the full tensor, and the ranks
            // together are the tensor
            for tp in [2, 4] {
                let mut all = vec![];
                for r in 0..tp {
                    let heads = kvb::tp_heads(D.n_head, tp, r).unwrap();
                    let part = kvb::reassemble_heads(&k, &v, D, heads).unwrap();
                    assert_eq!(part, kvb::tp_slice(&w, D, tp, r).unwrap());
                    all.extend(part);
                }
                assert_eq!(all, w);
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4, "kv_b_proj of layers 0-2 and the MTP layer 3");
}
