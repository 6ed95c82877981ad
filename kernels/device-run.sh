#!/usr/bin/env bash
# Runs on the GPU machine from the repository root over the carried .device/ folder (built by
# kernels/device-prepare.sh) and the fixtures in tests/fixtures: kernel correctness tests, the
# GPU-vs-CPU check of every fixture model, then the kernel and decode benchmarks. Logs and JSON
# go to $OUT; a short summary is printed last. Builds nothing.
#   usage: .device/run.sh [tests|bench|all]   (default all)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/gguftool-gpu}
mkdir -p "$OUT"
FIX=$PWD/tests/fixtures
cd .device
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.csv"
date -u +"date: %Y-%m-%dT%H:%M:%SZ" | tee -a "$OUT/nvidia-smi.csv"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    # Synchronize after every launch so a fault names its op.
    GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu-tests --test-threads=1 2>&1 | tee "$OUT/gpu-tests.txt"
    rc=${PIPESTATUS[0]}
    GGUFTOOL_CUDA_SYNC=1 ./gguftool doctor --no-compile \
        --model "$FIX"/gguf/tiny-glm5-BF16.gguf --model "$FIX"/gguf/tiny-glm5-Q8_0.gguf \
        --model "$FIX"/gguf/tiny-glm5-Q6_K.gguf --model "$FIX"/gguf/tiny-glm5-Q4_K_M.gguf \
        --refs "$FIX"/refs/hf-tiny-glm5.json --refs "$FIX"/refs/hf-tiny-glm5-long.json \
        2>&1 | tee "$OUT/doctor.txt"
    drc=${PIPESTATUS[0]}
    [ "$drc" = 0 ] || rc=$drc
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    ./gguftool bench --kernels --json > "$OUT/bench.json" 2> "$OUT/bench.txt"
    for m in tiny-glm5-Q4_K_M tiny-glm5-BF16; do
        ./gguftool bench -m "$FIX/gguf/$m.gguf" -p 32 -n 128 --device cuda 2>&1 | tee -a "$OUT/bench.txt"
    done
    # GLM-5-shaped model (bench-models preset, 4 layers: dense + 3 MoE), generated here.
    if timeout 180 ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --quiet; then
        timeout 200 ./gguftool bench -m /tmp/glm5.gguf --device cuda -p 512 -n 128 \
            2>&1 | tee -a "$OUT/bench.txt"
    fi
fi
echo "== summary (exit $rc)"
grep -c ' ok |' "$OUT/gpu-tests.txt" 2>/dev/null | sed 's/^/kernel checks ok: /'
grep -E '^\| .*FAIL|panicked|test result' "$OUT/gpu-tests.txt" 2>/dev/null | head -20
grep -E '^finding|no findings' "$OUT/doctor.txt" 2>/dev/null | head -20
exit $rc
