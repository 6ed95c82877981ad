#!/usr/bin/env bash
# Runs on the GPU machine from the repository root over the carried .device/ folder (built by
# kernels/device-prepare.sh): kernel correctness tests, then the kernel benchmarks. Logs and
# JSON go to $OUT; a short table is printed last. Builds nothing.
#   usage: .device/run.sh [tests|bench|all]   (default all)
set -uo pipefail
what=${1:-all}
OUT=${OUT:-/tmp/gguftool-gpu}
mkdir -p "$OUT"
cd .device
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv | tee "$OUT/nvidia-smi.csv"
date -u +"date: %Y-%m-%dT%H:%M:%SZ" | tee -a "$OUT/nvidia-smi.csv"
./gguftool doctor --no-compile 2>&1 | tee "$OUT/doctor.txt"
rc=0
if [ "$what" = tests ] || [ "$what" = all ]; then
    # Synchronize after every launch so a fault names its op.
    GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu-tests --test-threads=1 2>&1 | tee "$OUT/gpu-tests.txt"
    rc=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    ./gguftool bench --gpu --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt"
fi
echo "== correctness (tests exit $rc)"
grep -E '^\| ' "$OUT/gpu-tests.txt" 2>/dev/null | grep -c ' ok |' | sed 's/^/checks ok: /'
grep -E '^\| .*FAIL|panicked|test result' "$OUT/gpu-tests.txt" 2>/dev/null | head -20
exit $rc
