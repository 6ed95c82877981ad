//! The `kv_b` the naive attention path reassembles from the GGUF's `attn_k_b` / `attn_v_b`
//! (`mappings::kvb`, with the MLA dims the runtime's spec reads) equals transformers' `kv_b_proj`
//! in the HF checkpoint the GGUF was converted from, bit for bit (both hold the same bf16 values;
//! the reassembly only moves them).

mod forward_util;

use gguftool_tests::fixture;
use mappings::kvb::{reassemble, MlaDims};
use runtime::spec::{AttentionSpec, ModelSpec};
use runtime::weights::HostWeight;
use std::sync::Arc;

#[test]
fn reassembled_kv_b_equals_the_hf_checkpoint() {
    let index = fixture("hf/model.safetensors.index.json");
    let gguf_path = fixture("gguf/tiny-glm5-BF16.gguf");
    let index = forward_util::json(&index);
    let model = Arc::new(gguf::Model::open(&gguf_path).unwrap());
    let spec = ModelSpec::from_model(&model).unwrap();
    let AttentionSpec::Mla(m) = spec.attention else {
        panic!("not MLA")
    };
    for l in spec.layers.iter().filter(|l| !l.mtp) {
        let hf_name = format!("model.layers.{}.self_attn.kv_b_proj.weight", l.index);
        let shard = index["weight_map"][&hf_name].as_str().unwrap();
        let shard_path = fixture(&format!("hf/{shard}"));
        let bytes = std::fs::read(shard_path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let t = st.tensor(&hf_name).unwrap();
        assert_eq!(t.dtype(), safetensors::Dtype::BF16);
        assert_eq!(
            t.shape(),
            &[m.n_head * (m.qk_nope + m.v_head), m.kv_lora_rank]
        );
        let want: Vec<f32> = t
            .data()
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect();
        let k = HostWeight::from_model(&model, &format!("blk.{}.attn_k_b.weight", l.index))
            .unwrap()
            .to_f32()
            .unwrap();
        let v = HostWeight::from_model(&model, &format!("blk.{}.attn_v_b.weight", l.index))
            .unwrap()
            .to_f32()
            .unwrap();
        let d = MlaDims {
            n_head: m.n_head,
            qk_nope: m.qk_nope,
            v_head: m.v_head,
            kv_lora: m.kv_lora_rank,
        };
        assert!(reassemble(&k, &v, d).unwrap() == want, "layer {}", l.index);
    }
}
