"""gguftool doctor, check 7 with --hf: run the HF checkpoint in transformers (fp32, eager
attention) on the given token ids and save the activations under the names gguftool's forward
pass observes (runtime/src/glm.rs), with the token ids as `token_ids`, to a safetensors file.

usage: hf_activations.py --hf DIR --ids 1,2,3 --out FILE [--layers N]
With --layers N only the first N decoder layers are built (the truncated model's final norm and
head are applied to layer N's output, as gguftool's --quick model does).
"""
import argparse

import torch
import transformers
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM

PER_LAYER_LISTS = ("layer_types", "mlp_layer_types", "indexer_types")


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--hf", required=True)
    p.add_argument("--ids", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--layers", type=int, default=0)
    a = p.parse_args()

    cfg = AutoConfig.from_pretrained(a.hf)
    if a.layers and a.layers < cfg.num_hidden_layers:
        cfg.num_hidden_layers = a.layers
        for k in PER_LAYER_LISTS:
            v = getattr(cfg, k, None)
            if isinstance(v, list):
                setattr(cfg, k, v[: a.layers])
    kw = dict(config=cfg, attn_implementation="eager")
    try:
        model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32, **kw)
    except TypeError:  # transformers before `dtype` replaced `torch_dtype`
        model = AutoModelForCausalLM.from_pretrained(a.hf, torch_dtype=torch.float32, **kw)
    model.eval()
    acts = {}

    def keep(name, t):
        t = t.detach()
        if t.dim() == 3:  # [batch, tokens, features] -> [tokens, features]
            t = t[0]
        acts[name] = (t.to(torch.float32) if t.is_floating_point() else t.to(torch.int64)).contiguous()

    def hook(name):
        def f(_mod, _inp, out):
            keep(name, out[0] if isinstance(out, tuple) else out)

        return f

    base = model.model
    base.embed_tokens.register_forward_hook(hook("token_embd.out"))
    for i, layer in enumerate(base.layers):
        b = f"blk.{i}."
        layer.input_layernorm.register_forward_hook(hook(b + "attn_norm.out"))
        at = layer.self_attn
        for attr, op in (
            ("q_a_layernorm", "attn_q_a_norm.out"),
            ("q_b_proj", "attn_q_b.out"),
            ("q_proj", "attn_q_b.out"),
            ("kv_a_proj_with_mqa", "attn_kv_a_mqa.out"),
            ("kv_a_layernorm", "attn_kv_a_norm.out"),
            ("o_proj", "attn_output.out"),
        ):
            m = getattr(at, attr, None)
            if m is not None:
                m.register_forward_hook(hook(b + op))
        ix = getattr(at, "indexer", None)
        if ix is not None:
            ix.register_forward_hook(hook(b + "indexer.topk_indices"))
        layer.post_attention_layernorm.register_forward_hook(hook(b + "ffn_norm.out"))
        mlp = layer.mlp
        route = getattr(mlp, "route_tokens_to_experts", None)
        if route is not None:

            def routed(*args, _orig=route, _b=b, **kw):
                idx, w = _orig(*args, **kw)
                acts[_b + "router.experts"] = idx.reshape(-1, idx.shape[-1]).to(torch.int64).contiguous()
                acts[_b + "router.weights"] = w.reshape(-1, w.shape[-1]).to(torch.float32).contiguous()
                return idx, w

            mlp.route_tokens_to_experts = routed
        mlp.register_forward_hook(hook(b + "ffn.out"))
        layer.register_forward_hook(hook(b + "out"))
    base.norm.register_forward_hook(hook("output_norm.out"))
    model.lm_head.register_forward_hook(hook("logits"))

    ids = torch.tensor([[int(x) for x in a.ids.split(",")]], dtype=torch.long)
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    acts["token_ids"] = ids[0].contiguous()
    save_file(
        acts,
        a.out,
        metadata={"source": f"transformers {transformers.__version__} fp32 eager, gguftool doctor --hf"},
    )


if __name__ == "__main__":
    main()
