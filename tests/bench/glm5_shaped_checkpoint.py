#!/usr/bin/env python3
"""Writes a GLM-5-shaped HF checkpoint (real GLM-5 widths: hidden 6144, q_lora 2048, kv_lora 512,
64 heads, qk_nope 192 / rope 64 / v 256, indexer 32x128, moe_ff 2048, vocab 154880) with fewer
layers and experts, so it is a few GB: 1 dense layer, 1 MoE layer and the MTP block, EXPERTS
routed experts (default 24). bf16 values come from one pseudo-random 64 MiB block reused (the
converter's speed does not depend on them). Standard library only.

usage: glm5_shaped_checkpoint.py OUT_DIR [EXPERTS]   (OUT_DIR's name becomes general.name)
The tokenizer files are the tiny-glm5 fixture's (tests/fixtures/hf), padded to the vocab size.
"""
import json, os, random, shutil, struct, sys

out = sys.argv[1]
experts = int(sys.argv[2]) if len(sys.argv) > 2 else 24
H, QL, KVL, NH, NOPE, ROPE, V, IH, ID, FF, MFF, VOCAB = 6144, 2048, 512, 64, 192, 64, 256, 32, 128, 12288, 2048, 154880
os.makedirs(out, exist_ok=True)
here = os.path.dirname(os.path.abspath(__file__))
fx = os.path.join(here, "..", "fixtures", "hf")
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(os.path.join(fx, f), os.path.join(out, f))

def layer(l, moe, mtp):
    p = f"model.layers.{l}"
    t = [(f"{p}.input_layernorm.weight", [H]), (f"{p}.post_attention_layernorm.weight", [H]),
         (f"{p}.self_attn.q_a_proj.weight", [QL, H]), (f"{p}.self_attn.q_a_layernorm.weight", [QL]),
         (f"{p}.self_attn.q_b_proj.weight", [NH * (NOPE + ROPE), QL]),
         (f"{p}.self_attn.kv_a_proj_with_mqa.weight", [KVL + ROPE, H]),
         (f"{p}.self_attn.kv_a_layernorm.weight", [KVL]),
         (f"{p}.self_attn.kv_b_proj.weight", [NH * (NOPE + V), KVL]),
         (f"{p}.self_attn.o_proj.weight", [H, NH * V]),
         (f"{p}.self_attn.indexer.k_norm.weight", [ID]), (f"{p}.self_attn.indexer.k_norm.bias", [ID]),
         (f"{p}.self_attn.indexer.weights_proj.weight", [IH, H]),
         (f"{p}.self_attn.indexer.wk.weight", [ID, H]), (f"{p}.self_attn.indexer.wq_b.weight", [IH * ID, QL])]
    if moe:
        t += [(f"{p}.mlp.gate.weight", [experts, H]), (f"{p}.mlp.gate.e_score_correction_bias", [experts])]
        for x in range(experts):
            t += [(f"{p}.mlp.experts.{x}.gate_proj.weight", [MFF, H]), (f"{p}.mlp.experts.{x}.up_proj.weight", [MFF, H]),
                  (f"{p}.mlp.experts.{x}.down_proj.weight", [H, MFF])]
        t += [(f"{p}.mlp.shared_experts.gate_proj.weight", [MFF, H]), (f"{p}.mlp.shared_experts.up_proj.weight", [MFF, H]),
              (f"{p}.mlp.shared_experts.down_proj.weight", [H, MFF])]
    else:
        t += [(f"{p}.mlp.gate_proj.weight", [FF, H]), (f"{p}.mlp.up_proj.weight", [FF, H]), (f"{p}.mlp.down_proj.weight", [H, FF])]
    if mtp:
        t += [(f"{p}.eh_proj.weight", [H, 2 * H]), (f"{p}.enorm.weight", [H]), (f"{p}.hnorm.weight", [H]),
              (f"{p}.shared_head.norm.weight", [H])]
    return t

shards = [[("model.embed_tokens.weight", [VOCAB, H]), ("lm_head.weight", [VOCAB, H]), ("model.norm.weight", [H])] + layer(0, False, False),
          layer(1, True, False), layer(2, True, True)]
rng = random.Random(0)
block = bytearray()
while len(block) < 64 << 20:
    # bf16 in [-0.25, 0.25): sign, exponent 0x7c/0x7d, random mantissa
    block += struct.pack("<H", (rng.getrandbits(1) << 15) | (rng.choice((0x7c, 0x7d)) << 7) | rng.getrandbits(7))
block = bytes(block)
weight_map = {}
for i, tensors in enumerate(shards):
    name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
    hdr, off = {}, 0
    for n, s in tensors:
        nb = 2
        for d in s:
            nb *= d
        hdr[n] = {"dtype": "BF16", "shape": s, "data_offsets": [off, off + nb]}
        off += nb
        weight_map[n] = name
    h = json.dumps(hdr).encode()
    h += b" " * (-len(h) % 8)
    with open(os.path.join(out, name), "wb") as f:
        f.write(struct.pack("<Q", len(h)) + h)
        for n, s in tensors:
            nb = hdr[n]["data_offsets"][1] - hdr[n]["data_offsets"][0]
            while nb > 0:
                k = min(nb, len(block))
                f.write(block[:k])
                nb -= k
json.dump({"metadata": {}, "weight_map": weight_map}, open(os.path.join(out, "model.safetensors.index.json"), "w"))
cfg = {"architectures": ["GlmMoeDsaForCausalLM"], "model_type": "glm_moe_dsa", "hidden_size": H, "intermediate_size": FF,
       "num_attention_heads": NH, "num_key_value_heads": NH, "num_hidden_layers": 2, "num_nextn_predict_layers": 1,
       "vocab_size": VOCAB, "max_position_embeddings": 202752, "rms_norm_eps": 1e-5, "q_lora_rank": QL, "kv_lora_rank": KVL,
       "qk_nope_head_dim": NOPE, "qk_rope_head_dim": ROPE, "qk_head_dim": NOPE + ROPE, "head_dim": ROPE, "v_head_dim": V,
       "index_n_heads": IH, "index_head_dim": ID, "index_topk": 2048, "indexer_types": ["full", "full"],
       "n_routed_experts": experts, "num_experts_per_tok": 8, "n_shared_experts": 1, "moe_intermediate_size": MFF,
       "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 2.5,
       "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"}, "tie_word_embeddings": False,
       "eos_token_id": [1975, 1982, 1984], "pad_token_id": 1975, "dtype": "bfloat16"}
json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=1)
print(out)
