#!/usr/bin/env bash
# One device call checking what the CLI does on a GPU, over the carried .device/ (built by
# kernels/device-prepare.sh): kernel tests + CUDA-vs-CPU doctor (device-run.sh tests), then
# `verify --gpu` on every fixture, `generate --device cuda` vs `--device cpu` on the reference
# prompts, `serve` on the GPU, and the convert output loaded in transformers. Builds nothing.
set -uo pipefail
OUT=${OUT:-/tmp/gguftool-gpu}; mkdir -p "$OUT"
FIX=$PWD/tests/fixtures; B=$PWD/.device/gguftool
bash .device/run.sh tests > "$OUT/run-tests.txt" 2>&1; echo "kernel tests + doctor: exit $?"
tail -6 "$OUT/run-tests.txt"
for f in BF16 Q8_0 Q6_K Q4_K_M; do
  "$B" verify --gpu "$FIX/gguf/tiny-glm5-$f.gguf" --json > "$OUT/verify-gpu-$f.json"; rc=$?
  python3 -c "import json,sys; g=json.load(open(sys.argv[1]))['gpu']; print('verify --gpu $f: exit $rc,', g['checked'], 'tensors, max abs', g['max_abs'], 'failed', g['failed'], 'on', g['device'])" "$OUT/verify-gpu-$f.json"
done
"$B" synth --preset glm5-mini --layers 3 -o /tmp/mini.gguf --force --quiet
"$B" verify --gpu /tmp/mini.gguf > "$OUT/verify-gpu-mini.txt"; echo "verify --gpu synth glm5-mini: exit $?"; grep '^gpu:' "$OUT/verify-gpu-mini.txt"
python3 - "$B" "$FIX" "$OUT" <<'PY'
import json, subprocess, sys
B, FIX, OUT = sys.argv[1:4]
same = total = 0
for ref in ("hf-tiny-glm5.json", "hf-tiny-glm5-long.json"):
    for p in json.load(open(f"{FIX}/refs/{ref}"))["prompts"]:
        for f in ("BF16", "Q4_K_M"):
            outs = {}
            for dev in ("cpu", "cuda"):
                r = subprocess.run([B, "generate", "-m", f"{FIX}/gguf/tiny-glm5-{f}.gguf", "-p", p["text"], "-n", "16",
                                    "--temp", "0", "--ignore-eos", "--json", "--device", dev], capture_output=True, text=True)
                outs[dev] = json.loads(r.stdout)
            total += 1
            ok = outs["cpu"]["ids"] == outs["cuda"]["ids"]
            ok_ref = f != "BF16" or outs["cuda"]["ids"] == p["greedy_16"]["ids"]
            same += ok and ok_ref
            print(f"generate {p['id']:<22} {f:<7} cuda==cpu {ok}  cuda==transformers {ok_ref if f == 'BF16' else '-'}  device {outs['cuda'].get('device')}")
print(f"generate --device cuda: {same}/{total} identical")
PY
"$B" serve --port 18080 > "$OUT/serve.txt" 2>&1 & SP=$!
for i in $(seq 60); do curl -sf localhost:18080/health >/dev/null && break; sleep 0.5; done
curl -s localhost:18080/v1/completions -H 'Content-Type: application/json' -d '{"prompt": "1 2 3 4 5", "max_tokens": 8, "temperature": 0}' | tee "$OUT/serve-completion.json"; echo
grep "running on" "$OUT/serve.txt"; kill $SP
"$B" convert "$FIX/gguf/tiny-glm5-BF16.gguf" --to safetensors --dtype bf16 /tmp/hfout -q --force > /dev/null && \
  python3 tests/dev/check_convert_transformers.py /tmp/hfout "$FIX/refs/hf-tiny-glm5.json" 2>&1 | grep -v Warning | tail -4
