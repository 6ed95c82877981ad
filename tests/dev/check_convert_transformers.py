"""Load a `gguftool convert` output in transformers and compare its last-position logits with the
fixture's transformers reference (made from the original HF checkpoint). Needs torch and
transformers >= 5.17 (GlmMoeDsaForCausalLM). Not part of CI (no Python there).
usage: python3 tests/dev/check_convert_transformers.py OUT_DIR tests/fixtures/refs/hf-tiny-glm5.json
transformers older than 5.24 reject config.json's `layer_types: indexed_attention`; the script then
drops that key (in OUT_DIR/config.json) and says so: for prompts shorter than index_topk (all of
hf-tiny-glm5.json) attention is dense either way."""
import json, os, sys
import torch
import transformers
from transformers import AutoModelForCausalLM

out_dir, ref_path = sys.argv[1], sys.argv[2]
print("transformers", transformers.__version__)
cfg_path = os.path.join(out_dir, "config.json")
cfg = json.load(open(cfg_path))
try:
    transformers.AutoConfig.from_pretrained(out_dir)
except Exception as e:  # noqa: BLE001 - the exception type differs across versions
    if "layer_types" not in str(e):
        raise
    cfg.pop("layer_types")
    json.dump(cfg, open(cfg_path, "w"), indent=1)
    print("note: this transformers rejects layer_types=indexed_attention; dropped it from config.json")
model = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch.float32, attn_implementation="eager")
model.eval()
worst = 0.0
for p in json.load(open(ref_path))["prompts"]:
    with torch.no_grad():
        logits = model(torch.tensor([p["token_ids"]])).logits[0, -1]
    d = (logits - torch.tensor(p["last_logits"])).abs().max().item()
    same_top1 = int(logits.argmax()) == max(range(len(p["last_logits"])), key=p["last_logits"].__getitem__)
    print(f"{p['id']}: max |logit diff| {d:.3e}, top-1 {'same' if same_top1 else 'DIFFERENT'}")
    worst = max(worst, d)
# fp32 forward of the same bf16 weights: differences come from kernel order only (~1e-5).
print(f"convert-transformers: max |logit diff| {worst:.3e} -> {'ok' if worst < 1e-3 else 'FAIL'}")
sys.exit(0 if worst < 1e-3 else 1)
