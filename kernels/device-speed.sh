#!/usr/bin/env bash
# One GPU-machine call of the speed work (issue 12), over .device-speed/ staged by
# kernels/device-speed-prepare.sh: correctness of every kernel against the CPU oracle, the CUDA
# backend against the CPU reference (fixtures, exact and fast paths; a 64-head model past 1,023
# and 4,096 tokens), kernel microbenchmarks against the copy bandwidth of the same run, then the
# end-to-end bench on the GLM-5-shaped model made here with `synth`. Every step has a time box
# inside one global deadline (DEADLINE seconds); logs and JSON go to $OUT, a table is printed
# last. Builds nothing. usage: bash .device-speed/run.sh [DEADLINE]
set -uo pipefail
DEADLINE=${1:-320}
T0=$(date +%s)
OUT=${OUT:-/tmp/speed-out}
export OUT
mkdir -p "$OUT"
ROOT=$PWD
D=$ROOT/.device-speed
export GGUFTOOL_FIXTURES=$ROOT/tests/fixtures GGUFTOOL_KERNEL_CACHE=/tmp/gguftool-kcache
export NCCL_NVLS_ENABLE=0
cd "$D" || exit 2
# One solid archive (the binaries share most of their code, so xz compresses them together).
[ -f payload.tar.xz ] && xz -d -c payload.tar.xz | tar xf -
chmod +x gguftool kernels-gpu runtime-lib 2>/dev/null
[ -f gguftool-main ] && chmod +x gguftool-main
# At most 8 files come back: log.txt, kernel-tests.txt, runtime-tests.txt, kernels.json,
# bench-all.json; everything else stays in $W.
W=/tmp/speed-work
mkdir -p "$W"
LOG=$OUT/log.txt
STEPS=$W/steps.txt
{
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,clocks.mem --format=csv
    date -u +"date: %Y-%m-%dT%H:%M:%SZ"
    nproc
} > "$LOG" 2>&1

left() { echo $((DEADLINE - ($(date +%s) - T0))); }
# step NAME SECONDS OUTFILE CMD...: run with a time box (capped by the deadline), record rc + time.
step() {
    local name=$1 box=$2 out=$3
    shift 3
    local l
    l=$(left)
    if [ "$l" -lt 15 ]; then
        echo "$name skipped (deadline)" >> "$STEPS"
        return
    fi
    [ "$box" -gt "$((l - 5))" ] && box=$((l - 5))
    local t=$(date +%s)
    echo "===== $name (box ${box}s)" >> "$LOG"
    timeout "$box" "$@" > "$out" 2>> "$LOG"
    local rc=$?
    echo "$name rc=$rc $(( $(date +%s) - t ))s" >> "$STEPS"
}

# Ordered by what the branch needs first (each box is a maximum; the deadline cuts the tail).
# 1. Kernel correctness (sync after every launch so a fault names its op).
step kernel-tests 110 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 2>&1'
# 2. The CUDA backend against the CPU reference (fixtures both paths, 64 heads past 1,023 / 4,096
#    with and without the per-expert prefill GEMMs, device sampling, the fused norms).
step runtime-tests 90 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda --test-threads=1 --nocapture 2>&1'
# 3. The GLM-5-shaped bench model (bench-models.md), 4 layers, made here.
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
# 4. End to end, fast path: prefill 512, decode 128 at depth 0; 8 sequences.
step bench-d0 70 "$W/bench.json" ./gguftool bench -m /tmp/glm5.gguf --device cuda -p 32,512 -n 128 -r 3 --npl 1,8 --json
# 5. The serving path: generate (device sampling), greedy and sampled, against bench's tg.
P="The quick brown fox jumps over the lazy dog while the band plays on"
step generate-greedy 25 "$W/generate-greedy.json" ./gguftool generate -m /tmp/glm5.gguf --device cuda -p "$P" -n 128 --temp 0 --ignore-eos --json
step generate-sampled 25 "$W/generate-sampled.json" ./gguftool generate -m /tmp/glm5.gguf --device cuda -p "$P" -n 128 --temp 0.8 --seed 7 --ignore-eos --json
# 6. Prefill MoE and per-head matmuls as bf16 GEMMs (off by default) against bench-d0's pp512.
step bench-prefill-gemm 40 "$W/bench-prefill-gemm.json" env GGUFTOOL_PREFILL_GEMM=1 ./gguftool bench -m /tmp/glm5.gguf --device cuda -p 512 -n 16 -r 2 --json
# 7. Kernel microbenchmarks at GLM-5 shapes vs the copy bandwidth.
step kernel-bench 70 "$OUT/kernels.json" ./gguftool bench --kernels --json
# The baseline (the branch's starting point) on the same file, same run: before/after.
if [ -x gguftool-main ]; then
    step bench-main 50 "$W/bench-main.txt" ./gguftool-main bench --model /tmp/glm5.gguf --backend cuda --tokens 128
fi
# 8. The exact path and long context.
step bench-exact 40 "$W/bench-exact.json" env GGUFTOOL_CUDA_EXACT=1 ./gguftool bench -m /tmp/glm5.gguf --device cuda -p 512 -n 64 -r 2 --no-profile --json
step bench-d32k 80 "$W/bench-d32k.json" ./gguftool bench -m /tmp/glm5.gguf --device cuda -p 512 -n 32 -d 32768 -r 2 --json

# Summary (the reply carries the end of the output).
cat "$STEPS" >> "$LOG"
cd "$W"
python3 - "$OUT/bench-all.json" <<'PY'
import json, sys
out = {}
for f in ("bench.json", "bench-prefill-gemm.json", "generate-greedy.json", "generate-sampled.json",
          "bench-d32k.json", "bench-exact.json", "synth.json"):
    try:
        out[f] = json.load(open(f))
    except Exception as e:
        out[f] = "missing: %s" % e
try:
    out["bench-main.txt"] = open("bench-main.txt").read()
except Exception:
    pass
json.dump(out, open(sys.argv[1], "w"), indent=1)
PY
echo "== steps"; cat "$STEPS"
echo "== kernel tests"; grep -E '^test |test result|FAIL|panicked' "$OUT/kernel-tests.txt" | grep -v ' ok$' | tail -15
grep -c '| ok |' "$OUT/kernel-tests.txt" | sed 's/^/checks ok: /'
echo "== runtime tests"; grep -E 'test result|FAILED|panicked|^\| ' "$OUT/runtime-tests.txt" | tail -14
python3 - <<'PY'
import json, os
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return None
k = load(os.environ["OUT"] + "/kernels.json")
if k:
    print("== kernels (copy %.0f GB/s)" % k["copy_gb_per_s"])
    for r in k["results"]:
        print("%-10s %-50s %8.1f us %6.0f GB/s %4.0f%%" % (r["kind"], r["what"][:50], r["us"], r["gb_per_s"], 100 * r["fraction_of_copy"]))
for f in ("bench.json", "bench-d32k.json", "bench-exact.json"):
    b = load(f)
    if not b:
        continue
    print("==", f)
    for r in b:
        ks = r.get("kernels") or []
        top = ", ".join("%s %.0f" % (x["kind"], x["us_per_token"]) for x in ks[:5])
        print("%s%d d%d x%d: %.1f ± %.1f t/s, %.0f GB/s (%.1f%% copy) | %s" % (r["test"], r["n_prompt"] or r["n_gen"], r["n_depth"], r["n_seq"], r["avg_ts"], r["stddev_ts"], r["weight_gbs"] or 0, 100 * (r["copy_share"] or 0), top))
PY
[ -s bench-main.txt ] && { echo "== main (before)"; tail -4 bench-main.txt; }
echo "== log tail"; tail -5 "$LOG"
