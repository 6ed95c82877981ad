#!/usr/bin/env bash
# One GPU-machine call of the speed work (issue 12), over .device-speed/ staged by
# kernels/device-speed-prepare.sh: correctness of every kernel against the CPU oracle, the CUDA
# backend against the CPU reference (fixtures, exact and fast paths; a 64-head model past 1,023
# and 4,096 tokens), kernel microbenchmarks against the copy bandwidth of the same run, then the
# end-to-end bench on the GLM-5-shaped model made here with `synth`. Every step has a time box
# inside one global deadline (DEADLINE seconds); logs and JSON go to $OUT, a table is printed
# last. Builds nothing. usage: [STAGE=new|regress|final|tiles|tiles-check|mla-tc|mla-tc2|seqs|depth|mmq|mmq2|mmq3|stack2|all14|reg14|rows15|fin15|pf17|fin17|s18|s18m|s19|s19b] bash .device-speed/run.sh [DEADLINE]
set -uo pipefail
DEADLINE=${1:-560}
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
chmod +x gguftool kernels-gpu runtime-lib tp-gpu 2>/dev/null
[ -f gguftool-main ] && chmod +x gguftool-main
[ -f gguftool-prof ] && chmod +x gguftool-prof
[ -f gguftool-b ] && chmod +x gguftool-b
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
# The seventh session (2026-12-05) wrote three things without a GPU, each checked on the CPU
# emulator (kernels/emu) and off by default until this script has run them: the int8
# tensor-core product (GGUFTOOL_MMQ=1), the lane-per-key indexer scorer
# (GGUFTOOL_INDEXER_LANES=1). First their correctness, then same-call A/B runs, then the rest.
# STAGE=new (default): steps 1-5, ~9 minutes; STAGE=regress: step 6 only (a second call);
# STAGE=final: step 7.
STAGE=${STAGE:-new}
export STAGE
if [ "$STAGE" = new ]; then
# 1. The new kernels against their oracles (sync after every launch so a fault names its op);
#    mma_s8_selftest compares the hardware's fragment layout with the emulated one.
step new-kernel-tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 mma mmq indexer 2>&1'
# 2. The CUDA backend against the CPU reference with the new paths on: the 64-head model's
#    2-65-token prefills and 4-sequence batches on mmq, the fixtures and long prompts.
step new-runtime-tests 120 "$OUT/runtime-tests.txt" bash -c 'GGUFTOOL_MMQ=1 GGUFTOOL_INDEXER_LANES=1 ./runtime-lib cuda::tests::glm5_heads cuda::tests::cuda_matches_cpu_on_fixtures --test-threads=1 --nocapture 2>&1'
# 3. The GLM-5-shaped bench model (bench-models.md), 4 layers, made here.
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
# 4. Same-call A/B, alternating off / on: prefill 8-512 and batched decode 1/8/32 (mmq), decode
#    at depth 32,768 (indexer scorer).
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-mmq-off-1 45 "$W/ab-mmq-off-1.json" env GGUFTOOL_MMQ=0 $B -p 8,16,32,64,512 -n 32 -r 2 --npl 1,8,32
step ab-mmq-on-1 45 "$W/ab-mmq-on-1.json" env GGUFTOOL_MMQ=1 $B -p 8,16,32,64,512 -n 32 -r 2 --npl 1,8,32
step ab-mmq-off-2 45 "$W/ab-mmq-off-2.json" env GGUFTOOL_MMQ=0 $B -p 8,16,32,64,512 -n 32 -r 2 --npl 1,8,32
step ab-mmq-on-2 45 "$W/ab-mmq-on-2.json" env GGUFTOOL_MMQ=1 $B -p 8,16,32,64,512 -n 32 -r 2 --npl 1,8,32
# Where the range ends: one-row decode GEMVs through mmq (1-64) against the GEMVs (tg), and
# 512-token prefill through mmq (2-1024) against the bf16 GEMM path (pp512).
step ab-mmq-rows-1 40 "$W/ab-mmq-rows-1.json" env GGUFTOOL_MMQ=1 GGUFTOOL_MMQ_ROWS=1-64 $B -p 0 -n 64 -r 2
step ab-mmq-rows-1024 40 "$W/ab-mmq-rows-1024.json" env GGUFTOOL_MMQ=1 GGUFTOOL_MMQ_ROWS=2-1024 $B -p 512 -n 0 -r 2
step ab-lanes-off 40 "$W/ab-lanes-off.json" env GGUFTOOL_INDEXER_LANES=0 $B -p 0 -n 32 -d 32768 -r 1
step ab-lanes-on 40 "$W/ab-lanes-on.json" env GGUFTOOL_INDEXER_LANES=1 $B -p 0 -n 32 -d 32768 -r 1
# 5. Kernel microbenchmarks at GLM-5 shapes vs the copy bandwidth (mmq against the 8-column
#    GEMVs and the bf16 GEMM, the grouped MoE tiles, both indexer scorers at 2k-32k keys).
step kernel-bench 90 "$OUT/kernels.json" ./gguftool bench --kernels --json
fi
# 6. Regressions: every kernel and runtime GPU test with the defaults.
if [ "$STAGE" = regress ]; then
step kernel-tests-all 250 "$W/kernel-tests-all.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 2>&1'
step runtime-tests-all 200 "$W/runtime-tests-all.txt" bash -c './runtime-lib cuda --test-threads=1 2>&1'
fi

# 7. The closing figures (STAGE=final, one call): llama.cpp's llama-bench is built on the CPUs
#    (~4 min, ../shared/bench/llamacpp-bench.sh and its tarball copied into .device-speed/) while
#    the GPU runs the regression suites, then both tools are timed on the same file, one after
#    the other, with nothing else running.
LB=/tmp/llamacpp/llama.cpp/build/bin
# llama.cpp built in the background (CPUs only) while the GPU runs other steps.
build_llama() {
    ( bash ./llamacpp-bench.sh /nonexistent -p 0 -n 0 > "$W/llama-build.txt" 2>&1 ) &
    BUILD=$!
}
# Both tools on the same file, one after the other, once the build is done.
closing_figures() {
    wait "$BUILD"
    local B="./gguftool bench -m /tmp/glm5.gguf --device cuda --json"
    step llama-pp-tg 120 "$W/bench-llama.txt" bash -c "$LB/llama-bench -m /tmp/glm5.gguf -ngl 99 -fa 0 -p 8,16,32,64,512 -n 128 -r 3 -o md 2>&1 | grep '^|'"
    step llama-batched 60 "$W/bench-llama-batched.txt" bash -c "$LB/llama-batched-bench -m /tmp/glm5.gguf -ngl 99 -fa 0 -npp 32 -ntg 32 -npl 8,32 2>&1 | grep '^|'"
    step ours-pp-tg 60 "$W/final-pp-tg.json" $B -p 8,16,32,64,512 -n 128 -r 2
    step ours-batched 40 "$W/final-batched.json" $B -p 0 -n 32 -r 1 --npl 8,32
    step ours-depth 40 "$W/final-depth.json" $B --no-profile -p 0 -n 32 -d 32768 -r 1
    cat "$W"/bench-llama*.txt > "$OUT/llama.txt" 2>/dev/null
}
# Every final-*.json record of this call: test, prompt, generated, depth, sequences, tok/s, sd
# (and the weight-read GB/s where a stage asks for it: print_finals gbps).
print_finals() {
    local extra=${1:-}
    for f in "$W"/final-*.json; do echo "== $f"; python3 - "$f" "$extra" <<'PY' 2>&1
import json, sys
for r in json.load(open(sys.argv[1])):
    row = [r.get('test'), r.get('n_prompt'), r.get('n_gen'), r.get('n_depth'), r.get('n_seq'),
           round(r.get('avg_ts', 0), 1), round(r.get('stddev_ts', 0), 1)]
    if sys.argv[2] == 'gbps':
        row.append(r.get('gbps', ''))
    print(*row)
PY
    done
}
if [ "$STAGE" = final ]; then
build_llama
step synth 90 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step runtime-tests-all 150 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda --test-threads=1 2>&1'
step tp-tests 60 "$W/tp-tests.txt" bash -c './tp-gpu --test-threads=1 2>&1'
# The kernel suite fills what is left of the build's ~4 minutes (at least 30 s); the timings
# below must not share the GPU with it.
KB=$((250 - ($(date +%s) - T0)))
[ "$KB" -lt 30 ] && KB=30
step kernel-tests-all "$KB" "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 2>&1'
closing_figures
fi

# 8. Wide MoE tiles (STAGE=tiles, 2026-12-06): on the tensor cores the experts with more than 8
#    tokens in a step take a second tile set up to 64 columns wide (kernels::moe_mmq_tile), the
#    others keep 8-column tiles. Their tests, same-call A/B against 8-column tiles only
#    (GGUFTOOL_MOE_TILE=8), then the closing figures of both tools as in STAGE=final (llama.cpp
#    built meanwhile), the kernel benchmarks, and the TP suite with what time is left.
if [ "$STAGE" = tiles ]; then
build_llama
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step tile-kernel-tests 80 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mmq_grouped gemvq_glu_combine_and_grouped 2>&1'
step tile-runtime-tests 120 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::glm5_heads_mmq cuda::tests::cuda_matches_cpu_on_fixtures --test-threads=1 --nocapture 2>&1'
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-tile8-1 30 "$W/ab-tile8-1.json" env GGUFTOOL_MOE_TILE=8 $B -p 8,16,32,64 -n 32 -r 2 --npl 1,8,32
step ab-tile-auto-1 30 "$W/ab-tile-auto-1.json" $B -p 8,16,32,64 -n 32 -r 2 --npl 1,8,32
step ab-tile8-2 30 "$W/ab-tile8-2.json" env GGUFTOOL_MOE_TILE=8 $B -p 8,16,32,64 -n 32 -r 2 --npl 1,8,32
step ab-tile-auto-2 30 "$W/ab-tile-auto-2.json" $B -p 8,16,32,64 -n 32 -r 2 --npl 1,8,32
closing_figures
step kernel-bench 60 "$OUT/kernels.json" ./gguftool bench --kernels --json
step tp-tests 150 "$W/tp-tests.txt" bash -c './tp-gpu --test-threads=1 2>&1'
fi

# 9. STAGE=tiles-check: the grouped mmq test to its end (no sync after each launch: the tiles
#    call's 80-second box cut it inside the wide set), then the tile A/B with no build beside it.
if [ "$STAGE" = tiles-check ]; then
step tile-kernel-tests 110 "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 --nocapture mmq_grouped 2>&1'
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-tile8-1 30 "$W/ab-tile8-1.json" env GGUFTOOL_MOE_TILE=8 $B -p 32,64 -n 32 -r 2 --npl 1,8,32
step ab-tile-auto-1 30 "$W/ab-tile-auto-1.json" $B -p 32,64 -n 32 -r 2 --npl 1,8,32
step ab-tile8-2 30 "$W/ab-tile8-2.json" env GGUFTOOL_MOE_TILE=8 $B -p 32,64 -n 32 -r 2 --npl 1,8,32
step ab-tile-auto-2 30 "$W/ab-tile-auto-2.json" $B -p 32,64 -n 32 -r 2 --npl 1,8,32
fi

# 10. STAGE=mla-tc (2026-12-06): the MLA on tensor cores (mla.cu `mla_tc_bf16`, bf16 cache:
#     prefill, long and sparse decode) on a GPU for the first time: its tests against the f64
#     oracle and past the grid's y limit, the CUDA backend against the CPU on the fixtures and on
#     the 64-head model's 1,100 / 4,200-token prompts (sparse past 2,048), then same-call A/B
#     against the tile kernel (GGUFTOOL_MLA_TC=0), alternating, and the kernel benchmarks.
if [ "$STAGE" = mla-tc ]; then
step tc-kernel-tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mla_latent launches_past_the_grid_y_limit 2>&1'
step tc-runtime-tests 170 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_prompts_past cuda::tests::glm5_heads_mmq_steps --test-threads=1 --nocapture 2>&1'
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-tc-off-1 35 "$W/ab-tc-off-1.json" env GGUFTOOL_MLA_TC=0 $B -p 64,512,2048 -n 32 -r 2
step ab-tc-on-1 35 "$W/ab-tc-on-1.json" $B -p 64,512,2048 -n 32 -r 2
step ab-tc-depth-off 30 "$W/ab-tc-depth-off.json" env GGUFTOOL_MLA_TC=0 $B -p 0 -n 32 -d 32768 -r 1
step ab-tc-depth-on 30 "$W/ab-tc-depth-on.json" $B -p 0 -n 32 -d 32768 -r 1
step ab-tc-off-2 35 "$W/ab-tc-off-2.json" env GGUFTOOL_MLA_TC=0 $B -p 64,512,2048 -n 32 -r 2
step ab-tc-on-2 35 "$W/ab-tc-on-2.json" $B -p 64,512,2048 -n 32 -r 2
step kernel-bench 60 "$OUT/kernels.json" ./gguftool bench --kernels --json
fi

# 11. STAGE=mla-tc2: the tensor-core MLA with its loads in flight together (the first call's
#     decode-sized launches were bound by the queries' staging), its tests, the kernel
#     benchmarks, the depth A/B, then the closing figures of both tools (llama.cpp built
#     meanwhile) on the same file.
if [ "$STAGE" = mla-tc2 ]; then
build_llama
step tc-kernel-tests 60 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mla_latent launches_past_the_grid_y_limit attention_dense 2>&1'
step tc-runtime-tests 120 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_pdl --test-threads=1 --nocapture 2>&1'
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step kernel-bench 60 "$OUT/kernels.json" ./gguftool bench --kernels --json
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-tc-depth-off 30 "$W/ab-tc-depth-off.json" env GGUFTOOL_MLA_TC=0 $B -p 0 -n 32 -d 32768 -r 1
step ab-tc-depth-on 30 "$W/ab-tc-depth-on.json" $B -p 0 -n 32 -d 32768 -r 1
closing_figures
fi

# 12. STAGE=seqs (2026-12-06, tenth session): a batched step's cache appends and MLA attention
#     as one launch each over all sequences (GGUFTOOL_FUSE_SEQS), its tests (kernels against
#     f64, the backend against its per-sequence composition, 4 sequences against the CPU), a
#     same-call A/B of 8 and 32 sequences, alternating; then the tensor-core MLA's phases timed
#     inside the kernel (gguftool-prof: an instrumented build of mla_tc_bf16 that prints clock64
#     deltas per phase from two blocks of each launch; never committed), the depth profile, and
#     the closing figures of both tools (llama.cpp built meanwhile).
if [ "$STAGE" = seqs ]; then
build_llama
ls /usr/local/cuda*/bin 2>/dev/null | grep -iE 'ncu|nsys|nvdisasm|cuobjdump' >> "$LOG"
step seqs-kernel-tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mla_batched scatter_rows mla_latent 2>&1'
step seqs-runtime-tests 120 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::cuda_batched cuda::tests::glm5_heads_mmq_steps cuda::tests::cuda_matches_cpu_on_fixtures --test-threads=1 --nocapture 2>&1'
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-seqs-off-1 30 "$W/ab-seqs-off-1.json" env GGUFTOOL_FUSE_SEQS=0 $B -p 0 -n 32 -r 1 --npl 8,32
step ab-seqs-on-1 30 "$W/ab-seqs-on-1.json" $B -p 0 -n 32 -r 1 --npl 8,32
step ab-seqs-off-2 30 "$W/ab-seqs-off-2.json" env GGUFTOOL_FUSE_SEQS=0 $B -p 0 -n 32 -r 1 --npl 8,32
step ab-seqs-on-2 30 "$W/ab-seqs-on-2.json" $B -p 0 -n 32 -r 1 --npl 8,32
if [ -f ./gguftool-prof ]; then
    step tc-prof 70 "$W/tc-prof.txt" bash -c './gguftool-prof bench --kernels --json 2>&1 | grep TCPROF'
    python3 - "$W/tc-prof.txt" > "$OUT/tc-prof.txt" <<'PY'
import re, sys, statistics as st
rows = {}
for line in open(sys.argv[1]):
    m = re.search(r"H (\d+) n_eff (\d+) grid (\S+) blk (\d+) sm \d+ chunks (\d+) \| (.*)", line)
    if not m:
        continue
    key = (m.group(1), m.group(2), m.group(3), m.group(4), m.group(5))
    vals = [int(v) for v in re.findall(r"(-?\d+)", m.group(6))]
    rows.setdefault(key, []).append(vals)
names = "pdl q k s smx pv bar loop out total_cyc ns".split()
print("H n_eff grid blk chunks n | " + " ".join(names) + " (medians; cycles, last: globaltimer ns)")
for k, v in sorted(rows.items(), key=lambda kv: -len(kv[1]))[:30]:
    med = [int(st.median(c)) for c in zip(*v)]
    print(" ".join(k), len(v), "|", " ".join(str(x) for x in med))
PY
fi
step depth-profile 45 "$W/depth-profile.json" ./gguftool bench -m /tmp/glm5.gguf --device cuda --json -p 0 -n 32 -d 32768 -r 1
closing_figures
fi

# 13. STAGE=depth (tenth session, second call): the DSA indexer's scores on the tensor cores
#     (indexer_scores.cu `indexer_scores_tc_bf16`, the fast path's default wherever it fits),
#     the tensor-core MLA's accumulators written through shared memory, and the batched step's
#     sparse fix: their tests, the kernel benchmarks, a same-call A/B at depth 32,768
#     (GGUFTOOL_INDEXER_TC=0 against the default, alternating), the depth profile, then the
#     closing figures of both tools (llama.cpp built meanwhile).
if [ "$STAGE" = depth ]; then
build_llama
step depth-kernel-tests 100 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mla_latent mla_batched scatter_rows indexer_lanes indexer_scores_and_topk launches_past_the_grid_y_limit 2>&1'
step depth-runtime-tests 130 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::cuda_batched cuda::tests::glm5_heads_mmq_steps cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_pdl --test-threads=1 --nocapture 2>&1'
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step kernel-bench 70 "$OUT/kernels.json" ./gguftool bench --kernels --json
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
step ab-ixtc-off-1 30 "$W/ab-ixtc-off-1.json" env GGUFTOOL_INDEXER_TC=0 $B -p 0 -n 32 -d 32768 -r 1
step ab-ixtc-on-1 30 "$W/ab-ixtc-on-1.json" $B -p 0 -n 32 -d 32768 -r 1
step ab-ixtc-off-2 30 "$W/ab-ixtc-off-2.json" env GGUFTOOL_INDEXER_TC=0 $B -p 0 -n 32 -d 32768 -r 1
step ab-ixtc-on-2 30 "$W/ab-ixtc-on-2.json" $B -p 0 -n 32 -d 32768 -r 1
step depth-profile 45 "$W/depth-profile.json" ./gguftool bench -m /tmp/glm5.gguf --device cuda --json -p 0 -n 32 -d 32768 -r 1
closing_figures
fi

# 14. STAGE=mmq (eleventh session): the tensor-core products' data through a 4-stage cp.async
#     ring (weights, codes and records: no load into registers in the loop) and a chunk's
#     column groups issued together (mmq.cu). Their tests, the kernel benchmarks (every allowed k-split), a
#     same-call A/B of prefill 16-64 against gguftool-main (the previous commit), then the
#     closing figures of both tools (llama.cpp built meanwhile; the depth run left out: this
#     change does not touch it).
if [ "$STAGE" = mmq ]; then
build_llama
step mmq-kernel-tests 110 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mma_s8 mmq_dense mmq_grouped mmq_channel 2>&1'
step mmq-runtime-tests 100 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::glm5_heads_mmq_steps cuda::tests::cuda_matches_cpu_on_fixtures --test-threads=1 --nocapture 2>&1'
step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step kernel-bench 50 "$OUT/kernels.json" ./gguftool bench --kernels --json --quick
A="-m /tmp/glm5.gguf --device cuda --no-profile --json -p 16,32,64 -n 16 -r 2"
step ab-main-1 20 "$W/ab-main-1.json" ./gguftool-main bench $A
step ab-new-1 20 "$W/ab-new-1.json" ./gguftool bench $A
wait "$BUILD"
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --json"
step llama-pp-tg 120 "$W/bench-llama.txt" bash -c "$LB/llama-bench -m /tmp/glm5.gguf -ngl 99 -fa 0 -p 8,16,32,64,512 -n 128 -r 3 -o md 2>&1 | grep '^|'"
step ours-pp-tg 60 "$W/final-pp-tg.json" $B -p 8,16,32,64,512 -n 128 -r 2
step llama-batched 50 "$W/bench-llama-batched.txt" bash -c "$LB/llama-batched-bench -m /tmp/glm5.gguf -ngl 99 -fa 0 -npp 32 -ntg 32 -npl 8,32 2>&1 | grep '^|'"
step ours-batched 40 "$W/final-batched.json" $B -p 0 -n 32 -r 1 --npl 8,32
cat "$W"/bench-llama*.txt > "$OUT/llama.txt" 2>/dev/null
python3 - "$W/final-pp-tg.json" > "$OUT/profile.txt" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if (r["n_prompt"] or 0) not in (32, 64) and r["test"] != "tg":
        continue
    print("== %s%d: %.1f t/s" % (r["test"], r["n_prompt"] or r["n_gen"], r["avg_ts"]))
    for x in (r.get("kernels") or [])[:14]:
        print("  %-24s %8.2f us/tok %s" % (x["kind"], x["us_per_token"], {k: v for k, v in x.items() if k not in ("kind", "us_per_token")}))
PY
fi

# 15. STAGE=mmq2 (eleventh session, second call; device time nearly spent): the same change's
#     tests, kernel benchmarks, a same-call A/B against gguftool-main, then this tool's closing
#     figures (llama.cpp's are call 1's, same GPU type and file: no time to build it again).
if [ "$STAGE" = mmq2 ]; then
step mmq-kernel-tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 --nocapture mma_s8 mmq_dense mmq_grouped mmq_channel 2>&1'
step mmq-runtime-tests 80 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::glm5_heads_mmq_steps --test-threads=1 --nocapture 2>&1'
step synth 70 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step kernel-bench 50 "$OUT/kernels.json" ./gguftool bench --kernels --json --quick
A="-m /tmp/glm5.gguf --device cuda --no-profile --json -p 16,32,64 -n 16 -r 2"
step ab-main-1 25 "$W/ab-main-1.json" ./gguftool-main bench $A
step ab-new-1 25 "$W/ab-new-1.json" ./gguftool bench $A
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --json"
step ours-pp-tg 40 "$W/final-pp-tg.json" $B -p 8,16,32,64,512 -n 128 -r 2
step ours-batched 25 "$W/final-batched.json" $B -p 0 -n 32 -r 1 --npl 8,32
python3 - "$W/final-pp-tg.json" > "$OUT/profile.txt" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1])):
    if (r["n_prompt"] or 0) not in (32, 64):
        continue
    print("== %s%d: %.1f t/s" % (r["test"], r["n_prompt"] or r["n_gen"], r["avg_ts"]))
    for x in (r.get("kernels") or [])[:10]:
        print("  %-24s %8.2f us/tok %s" % (x["kind"], x["us_per_token"], {k: v for k, v in x.items() if k not in ("kind", "us_per_token")}))
PY
fi

# Summary (the reply carries the end of the output).
cat "$STEPS" >> "$LOG"
cd "$W"
python3 - "$OUT/bench-all.json" <<'PY'
import json, sys
out = {}
for f in ("ab-mmq-off-1.json", "ab-mmq-on-1.json", "ab-mmq-off-2.json", "ab-mmq-on-2.json",
          "ab-mmq-rows-1.json", "ab-mmq-rows-1024.json", "ab-lanes-off.json", "ab-lanes-on.json",
          "final-pp-tg.json", "final-batched.json", "final-depth.json", "synth.json",
          "ab-tile8-1.json", "ab-tile-auto-1.json", "ab-tile8-2.json", "ab-tile-auto-2.json",
          "ab-moe-gemm-1.json", "ab-moe-mmq-1.json", "ab-moe-gemm-2.json", "ab-moe-mmq-2.json",
          "depth-profile.json", "pp512-profile.json",
          "ab-tc-off-1.json", "ab-tc-on-1.json", "ab-tc-depth-off.json", "ab-tc-depth-on.json",
          "ab-tc-off-2.json", "ab-tc-on-2.json",
          "ab-seqs-off-1.json", "ab-seqs-on-1.json", "ab-seqs-off-2.json", "ab-seqs-on-2.json",
          "ab-ixtc-off-1.json", "ab-ixtc-on-1.json", "ab-ixtc-off-2.json", "ab-ixtc-on-2.json",
          "ab-main-1.json", "ab-new-1.json", "ab-main-2.json", "ab-new-2.json", "pp-profile.json"):
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
echo "== runtime tests"; grep -E 'test result|FAILED|panicked' "$OUT/runtime-tests.txt" | tail -14
echo "== kernel tests, failures"; grep -E 'FAILED|panicked|test result' "$OUT/kernel-tests.txt" | tail -8
python3 - <<'PY'
import json, os
def load(p):
    try:
        return json.load(open(p))
    except Exception as e:
        return None
for kf in ("kernels.json", "kernels-main.json"):
  k = load(os.environ["OUT"] + "/" + kf)
  if k:
    print("== " + kf)
    print("== kernels (copy %.0f GB/s)" % k["copy_gb_per_s"])
    for r in k["results"]:
        if os.environ.get("STAGE") == "tiles" and not r["kind"].startswith("moe"):
            continue
        if (os.environ.get("STAGE", "").startswith("mla-tc") or os.environ.get("STAGE") == "depth") and r["kind"] not in ("mla", "attention", "indexer", "topk"):
            continue
        if os.environ.get("STAGE", "").startswith("mmq") and "mmq" not in r["kind"] and "gemm" not in r["kind"] and "gemv" not in r["kind"]:
            continue
        print("%-10s %-50s %8.1f us %6.0f GB/s %4.0f%%" % (r["kind"], r["what"][:50], r["us"], r["gb_per_s"], 100 * r["fraction_of_copy"]))
for f in ("ab-mmq-off-1.json", "ab-mmq-on-1.json", "ab-mmq-off-2.json", "ab-mmq-on-2.json",
          "ab-mmq-rows-1.json", "ab-mmq-rows-1024.json", "ab-lanes-off.json", "ab-lanes-on.json",
          "final-pp-tg.json", "final-batched.json", "final-depth.json",
          "ab-tile8-1.json", "ab-tile-auto-1.json", "ab-tile8-2.json", "ab-tile-auto-2.json",
          "ab-moe-gemm-1.json", "ab-moe-mmq-1.json", "ab-moe-gemm-2.json", "ab-moe-mmq-2.json",
          "depth-profile.json", "pp512-profile.json",
          "ab-tc-off-1.json", "ab-tc-on-1.json", "ab-tc-depth-off.json", "ab-tc-depth-on.json",
          "ab-tc-off-2.json", "ab-tc-on-2.json",
          "ab-seqs-off-1.json", "ab-seqs-on-1.json", "ab-seqs-off-2.json", "ab-seqs-on-2.json",
          "ab-ixtc-off-1.json", "ab-ixtc-on-1.json", "ab-ixtc-off-2.json", "ab-ixtc-on-2.json",
          "ab-main-1.json", "ab-new-1.json", "ab-main-2.json", "ab-new-2.json", "pp-profile.json"):
    b = load(f)
    if not b:
        continue
    print("==", f)
    for r in b:
        ks = r.get("kernels") or []
        top = ", ".join("%s %.0f" % (x["kind"], x["us_per_token"]) for x in ks[:5])
        print("%s%d d%d x%d: %.1f ± %.1f t/s, %.0f GB/s (%.1f%% copy) | %s" % (r["test"], r["n_prompt"] or r["n_gen"], r["n_depth"], r["n_seq"], r["avg_ts"], r["stddev_ts"], r["weight_gbs"] or 0, 100 * (r["copy_share"] or 0), top))
PY
for f in kernel-tests-all.txt runtime-tests-all.txt tp-tests.txt; do
    [ -f "$f" ] && { echo "== $f"; grep -E 'test result|FAILED|panicked' "$f" | tail -6; }
done
[ -f "$OUT/llama.txt" ] && { echo "== llama.cpp"; cat "$OUT/llama.txt"; }
[ -f "$OUT/profile.txt" ] && { echo "== profile"; cat "$OUT/profile.txt"; }
[ -f "$OUT/tc-prof.txt" ] && { echo "== tensor-core MLA phases"; cat "$OUT/tc-prof.txt"; }
[ -f "$W/llama-build.txt" ] && tail -3 "$W/llama-build.txt"
echo "== log tail"; tail -5 "$LOG"

# 12. The 32-64-column products (STAGE=mmq3, 2026-12-07): k-slices (grid.z, partial sums
#     added in order by mmq_reduce) so a dense product's few row blocks fill the SMs. The mmq
#     tests (forced slices and the plan's), the kernel benchmarks (`mmq kz` sweep beside `mmq
#     ks`), pp A/B end to end in one binary (GGUFTOOL_MMQ_SLICES=1: none / the plan's), the
#     runtime's mmq steps against the CPU. (The measuring call ran the build where slices were
#     still off by default, with GGUFTOOL_MMQ_SLICES=0 for the plan's.)
if [ "$STAGE" = mmq3 ]; then
cd "$D" || exit 2
step mmq-tests 40 "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 mma mmq_dense 2>&1'
step kb-new 75 "$W/kb-new.txt" bash -c './gguftool bench --kernels --quick 2>&1'
grep -h "mmq\\|copy\\|gemm\\|gemv q8" "$W"/kb-new.txt > "$OUT/kb-new.txt" 2>/dev/null
step synth 40 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
B="bench -m /tmp/glm5.gguf --device cuda --no-profile -p 16,32,64 -n 16 -r 1"
step ab-off-1 30 "$W/ab-off-1.txt" bash -c "GGUFTOOL_MMQ_SLICES=1 ./gguftool $B 2>&1"
step ab-on-1 30 "$W/ab-on-1.txt" bash -c "./gguftool $B 2>&1"
step ab-off-2 30 "$W/ab-off-2.txt" bash -c "GGUFTOOL_MMQ_SLICES=1 ./gguftool $B 2>&1"
step ab-on-2 30 "$W/ab-on-2.txt" bash -c "./gguftool $B 2>&1"
for f in "$W"/ab-*.txt; do echo "== $(basename "$f")"; grep -E "pp|tg" "$f" | head -8; done > "$OUT/ab.txt"
step runtime-mmq 100 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::glm5_heads_mmq --test-threads=1 --nocapture 2>&1'
fi

# 13. trace_run (2026-12-07, thirteenth session): the decode step's kernel timeline through
#     CUPTI (kernels/tools/cupti_trace.c injected with CUDA_INJECTION64_PATH: no stream operation
#     added between launches, so PDL overlaps as in a plain run), each kernel charged the time
#     between the previous completion and its own (kernels/tools/timeline.py). Extra arguments
#     are environment settings for the traced run (e.g. GGUFTOOL_PDL=0).
trace_run() {  # NAME ENV... : tg64 under the tracer, then the timeline of its last 48 steps
    local name=$1
    shift
    step "trace-$name" 60 "$W/trace-$name.txt" env "$@" CUDA_INJECTION64_PATH="$D/libcupti_trace.so" \
        CUPTI_TRACE_OUT="$W/trace-$name.csv" "${TRACE_BIN:-./gguftool}" bench -m /tmp/glm5.gguf --device cuda --no-profile -p 0 -n 64 -r 1
    python3 "$D/timeline.py" "$W/trace-$name.csv" --last 48 > "$OUT/timeline-$name.txt" 2>&1
}
# Same-call A/B runs (fourteenth session on). ab_tg NAME BIN BOX ENV...: tg128 twice, JSON.
ab_tg() {
    local name=$1 bin=$2 box=$3
    shift 3
    step "ab-$name" "$box" "$W/ab-$name.json" env "$@" "$bin" bench -m /tmp/glm5.gguf --device cuda --no-profile -p 0 -n 128 -r 2 --json
}
# ab_table CONFIG...: every ab-*.json's tg128 and each CONFIG's mean over its rounds -1 and -2;
# the fastest CONFIG but the first (the baseline) is written to $W/fastest.
ab_table() {
    python3 - "$W" "$@" <<'PY'
import json, glob, os, sys
w, configs = sys.argv[1], sys.argv[2:]
res = {}
for f in sorted(glob.glob(os.path.join(w, "ab-*.json"))):
    name = os.path.basename(f)[3:-5]
    try:
        r = [x for x in json.load(open(f)) if x.get("test") == "tg"][0]
        res[name] = r["samples_ts"]
        print(f"{name:10} tg128 {r['avg_ts']:8.1f} +- {r['stddev_ts']:5.1f}  {[round(v, 1) for v in r['samples_ts']]}")
    except Exception as e:
        print(f"{name:10} no result ({e})")
def mean(p):
    v = [s for k in (p + "-1", p + "-2") for s in res.get(k, [])]
    return sum(v) / len(v) if v else 0.0
if configs:
    m = {p: mean(p) for p in configs}
    best = max(configs[1:] or configs, key=lambda p: m[p])
    print("means: " + ", ".join(f"{k} {v:.1f}" for k, v in m.items()) + f" -> fastest {best}")
    open(os.path.join(w, "fastest"), "w").write(best)
PY
}

# 14. STAGE=stack2 (thirteenth session): q_a, kv_a and the indexer keys as one stacked GEMV
#     (GGUFTOOL_FUSE_STACK=0: a launch each): its tests, one same-binary A/B pair, the kernel
#     timeline of both.
if [ "$STAGE" = stack2 ]; then
cd "$D" || exit 2
step stack-tests 40 "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 gemvq_stacked 2>&1'
step runtime-stack 60 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::glm5_heads_decode_fusions --test-threads=1 --nocapture 2>&1'
step synth 40 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
B="bench -m /tmp/glm5.gguf --device cuda --no-profile -p 0 -n 128 -r 2"
step "ab-off-1" 25 "$W/ab-off-1.txt" bash -c "GGUFTOOL_FUSE_STACK=0 ./gguftool $B 2>&1"
step "ab-on-1" 25 "$W/ab-on-1.txt" bash -c "./gguftool $B 2>&1"
for f in "$W"/ab-*.txt; do echo "== $(basename "$f")"; grep -E "tg" "$f" | head -4; done > "$OUT/ab.txt"
trace_run stack
trace_run nostack GGUFTOOL_FUSE_STACK=0
echo "== tests"; grep -E "gemvq stacked|test result|FAILED|panicked|decode fusions" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | grep -v "| ok |" | tail -12
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
for f in "$OUT"/timeline-*.txt; do echo "== $(basename "$f")"; head -42 "$f"; done
cat "$OUT/ab.txt"
cat "$STEPS"
fi

# 15. STAGE=all14 (fourteenth session; one call for a same-call A/B and STAGE=final's figures):
#     llama.cpp built in the background; the changed kernels' tests and the CUDA backend against
#     the CPU; tg128 of the previous commit (gguftool-b) and of this tree with the router's
#     k-split off and on, RMSNorm blocks of 256 / 512 threads (GGUFTOOL_RMS_WIDE), the shared
#     expert's gate + up apart (GGUFTOOL_FUSE_SHARED=0), in JSON; the router k-split and the RMSNorm
#     block kept for the closing figures only where the A/B says they are faster (the choice is
#     printed); one timeline; then the closing figures of both tools on the same file.
if [ "$STAGE" = all14 ]; then
cd "$D" || exit 2
build_llama
[ -n "${SKIP_KT:-}" ] || step gpu-tests 70 "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 gemv_every gemv_glm5 mla_ attention_dense rms_norm fused_norm moe_router argmax sample topk 2>&1'
[ -s /tmp/glm5.gguf ] || step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
ab() {  # NAME BIN ENV...: tg128 twice, JSON
    local name=$1 bin=$2
    shift 2
    step "ab-$name" 25 "$W/ab-$name.json" env "$@" "$bin" bench -m /tmp/glm5.gguf --device cuda --no-profile -p 0 -n 128 -r 2 --json
}
for i in 1 2; do
    ab "base-$i" ./gguftool-b X=0
    ab "new-$i" ./gguftool GGUFTOOL_GEMV_KSPLIT=0
    ab "newks-$i" ./gguftool GGUFTOOL_GEMV_KSPLIT=1
done
ab r256 ./gguftool GGUFTOOL_GEMV_KSPLIT=1 GGUFTOOL_RMS_WIDE=256
ab r512 ./gguftool GGUFTOOL_GEMV_KSPLIT=1 GGUFTOOL_RMS_WIDE=512
ab nosh ./gguftool GGUFTOOL_GEMV_KSPLIT=1 GGUFTOOL_FUSE_SHARED=0
python3 - "$W" > "$OUT/ab.txt" <<'PY'
import json, glob, os, sys
w = sys.argv[1]
res = {}
for f in sorted(glob.glob(os.path.join(w, "ab-*.json"))):
    name = os.path.basename(f)[3:-5]
    try:
        recs = json.load(open(f))
        r = [x for x in recs if x.get("test") == "tg"][0]
        res[name] = r["samples_ts"]
        print(f"{name:10} tg128 {r['avg_ts']:8.1f} +- {r['stddev_ts']:5.1f}  {r['samples_ts']}")
    except Exception as e:
        print(f"{name:10} no result ({e})")
def mean(keys):
    v = [s for k in keys for s in res.get(k, [])]
    return sum(v) / len(v) if v else 0.0
new, ks = mean(["new-1", "new-2"]), mean(["newks-1", "newks-2"])
best_r = max([("1024", ks), ("256", mean(["r256"])), ("512", mean(["r512"]))], key=lambda x: x[1])
env = []
if ks > new * 1.003: env.append("GGUFTOOL_GEMV_KSPLIT=1")
if best_r[0] != "1024" and best_r[1] > ks * 1.01: env.append("GGUFTOOL_RMS_WIDE=" + best_r[0])
print("base %.1f new %.1f newks %.1f -> closing figures with: %s" % (mean(["base-1", "base-2"]), new, ks, " ".join(env) or "defaults"))
open(os.path.join(w, "choice.env"), "w").write("\n".join("export " + e for e in env) + "\n")
PY
. "$W/choice.env"
trace_run new
closing_figures
step runtime-tests 200 "$OUT/runtime-tests.txt" bash -c 'GGUFTOOL_GEMV_KSPLIT=1 ./runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_decode cuda::tests::glm5_heads_shared cuda::tests::glm5_heads_pdl --test-threads=1 --nocapture 2>&1'
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -8
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
grep -E "^\| (decode fusions|shared Q6_K)" "$OUT/runtime-tests.txt"
head -30 "$OUT/timeline-new.txt"
cat "$OUT/ab.txt"
cat "$OUT/llama.txt"
print_finals
cat "$STEPS"
fi

# 16. STAGE=reg14 (written in the fourteenth session; no machine started for it, so it is the
#     next call's): the same-call A/B against the previous
#     commit (its kernels compiled first: the first call's 25-second boxes ran out compiling
#     them) and the 512-thread RMSNorm against the default, alternating; the previous commit's
#     timeline beside this tree's. Every runtime and TP test first, the kernel suite last (what
#     the deadline leaves of it).
if [ "$STAGE" = reg14 ]; then
cd "$D" || exit 2
step runtime-tests-all 130 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda --test-threads=1 2>&1'
step tp-tests 70 "$OUT/tp-tests.txt" bash -c './tp-gpu --test-threads=1 2>&1'
step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
ab_tg base-0 ./gguftool-b 100 X=0
for i in 1 2; do
    ab_tg "new-$i" ./gguftool 25 X=0
    ab_tg "base-$i" ./gguftool-b 25 X=0
    ab_tg "r512-$i" ./gguftool 25 GGUFTOOL_RMS_WIDE=512
done
ab_table base new r512 > "$OUT/ab.txt"
trace_run new
TRACE_BIN=./gguftool-b trace_run base
step kernel-tests-all 150 "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 2>&1'
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" "$OUT/tp-tests.txt" | tail -12
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
grep -E "\| (decode fusions|shared Q6_K)" "$OUT/runtime-tests.txt"
for f in "$OUT"/timeline-*.txt; do echo "== $(basename "$f")"; head -20 "$f"; done
cat "$OUT/ab.txt"
cat "$STEPS"
fi

# 17. STAGE=rows15 (fifteenth session): one-column integer GEMVs with 2 or 4 rows per lane group
#     (GGUFTOOL_GEMVQ1_ROWS=1|2|4; the activation loads of a task serve every row; the
#     one-column GLU's gate and up now share them too). Their kernel tests (bitwise the one-row
#     kernels, f64 bounds), then tg128 of the previous commit (gguftool-b, its kernels compiled
#     first) and of this tree at 1, 2 and 4 rows, alternating; the timelines of the fastest and
#     of 1 row with every launch listed; the CUDA backend against the CPU at the default.
if [ "$STAGE" = rows15 ]; then
cd "$D" || exit 2
step gemvq-tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 gemvq gemv_glm5 2>&1'
step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
ab_tg base-0 ./gguftool-b 100 X=0
for i in 1 2; do
    ab_tg "rows1-$i" ./gguftool 25 GGUFTOOL_GEMVQ1_ROWS=1
    ab_tg "rows2-$i" ./gguftool 25 GGUFTOOL_GEMVQ1_ROWS=2
    ab_tg "rows4-$i" ./gguftool 25 GGUFTOOL_GEMVQ1_ROWS=4
    ab_tg "base-$i" ./gguftool-b 25 X=0
done
ab_table base rows1 rows2 rows4 > "$OUT/ab.txt"
BEST=$(sed "s/rows//" "$W/fastest" 2>/dev/null || echo 2)
trace_run "rows$BEST" GGUFTOOL_GEMVQ1_ROWS="$BEST"
trace_run rows1 GGUFTOOL_GEMVQ1_ROWS=1
for n in "rows$BEST" rows1; do
    [ -s "$W/trace-$n.csv" ] && python3 "$D/timeline.py" "$W/trace-$n.csv" --last 48 --launches > "$OUT/launches-$n.txt" 2>&1
done
step runtime-tests 120 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_decode cuda::tests::glm5_heads_shared --test-threads=1 --nocapture 2>&1'
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -8
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
grep -E "rows per group|rows a group" "$OUT/kernel-tests.txt" | grep -v "| ok |" | head -8
grep -E "^\| (decode fusions|shared Q6_K)" "$OUT/runtime-tests.txt"
for f in "$OUT"/timeline-*.txt; do echo "== $(basename "$f")"; head -14 "$f"; done
cat "$OUT/ab.txt"
cat "$STEPS"
fi

# 18. STAGE=fin15 (fifteenth session, H200): llama.cpp built in the background; tg128 of the
#     previous commit (gguftool-b) and of this tree with one row per group, the default (2 rows
#     for launches of <= 8 waves) and 2 rows everywhere (GGUFTOOL_GEMVQ1_WAVES=0),
#     alternating; every launch of the three timelines; the closing figures of both tools with
#     the fastest; the CUDA backend against the CPU with what is left.
if [ "$STAGE" = fin15 ]; then
cd "$D" || exit 2
build_llama
step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
ab_tg base-0 ./gguftool-b 100 X=0
ab_tg auto-0 ./gguftool 100 X=0
for i in 1 2; do
    ab_tg "rows1-$i" ./gguftool 25 GGUFTOOL_GEMVQ1_ROWS=1
    ab_tg "auto-$i" ./gguftool 25 X=0
    ab_tg "all2-$i" ./gguftool 25 GGUFTOOL_GEMVQ1_WAVES=0
    ab_tg "base-$i" ./gguftool-b 25 X=0
done
ab_table base rows1 auto all2 > "$OUT/ab.txt"
case $(cat "$W/fastest" 2>/dev/null) in
    rows1) export GGUFTOOL_GEMVQ1_ROWS=1 ;;
    all2) export GGUFTOOL_GEMVQ1_WAVES=0 ;;
esac
for c in "rows1 GGUFTOOL_GEMVQ1_ROWS=1" "auto X=0" "all2 GGUFTOOL_GEMVQ1_WAVES=0"; do
    set -- $c
    trace_run "$1" "$2"
    [ -s "$W/trace-$1.csv" ] && python3 "$D/timeline.py" "$W/trace-$1.csv" --last 48 --launches > "$OUT/launches-$1.txt" 2>&1
    rm -f "$OUT/timeline-$1.txt"
done
closing_figures
step runtime-tests 150 "$OUT/runtime-tests.txt" bash -c './runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads --test-threads=1 --nocapture 2>&1'
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/runtime-tests.txt" | tail -4
for f in "$OUT"/launches-*.txt; do echo "== $(basename "$f")"; head -12 "$f"; done
cat "$OUT/ab.txt"
cat "$OUT/llama.txt"
print_finals gbps
cat "$STEPS"
fi

# 19. STAGE=pf17 (sixteenth session): three things written without a GPU, each off by default:
#     the weight prefetch into L2 before a GEMV's wait on the previous kernel
#     (GGUFTOOL_PREFETCH_MB: the HBM idles while a one-block norm or the router runs), the
#     router's coalesced F32 GEMV (GGUFTOOL_GEMV_COALESCED=1), more key splits for the short
#     decode MLA (GGUFTOOL_MLA_DEC_SPLIT / _DIRECT), their merge by the last block of each head
#     group instead of the combine launch (GGUFTOOL_MLA_MERGE=1), 4 rows per lane group where
#     a lane runs one task a row (GGUFTOOL_GEMVQ1_SHORT=4), and the fifteenth session's RMSNorm in
#     parts (GGUFTOOL_RMS_PARTS=1). Ran on commit 54f3c83's tree: the prefetch, merge and
#     short-row variables exist only there (e27b03d took them out), so on a later tree those
#     rows measure the default. Their tests first, then tg128 of the previous commit
#     (gguftool-b) and of each setting alternating, the timeline of the combination with
#     every launch, and the CUDA backend against the CPU with everything on.
if [ "$STAGE" = pf17 ]; then
cd "$D" || exit 2
ALL="GGUFTOOL_RMS_PARTS=1 GGUFTOOL_GEMV_COALESCED=1 GGUFTOOL_PREFETCH_MB=${PF_MB:-16} GGUFTOOL_MLA_MERGE=1"
step tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 GGUFTOOL_MLA_MERGE=1 ./kernels-gpu --test-threads=1 gemv_every gemv_glm5 gemvq_every rms_norm fused_norm mla_ 2>&1'
[ -s /tmp/glm5.gguf ] || step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
rm -f "$W"/ab-*.json
ab_tg base-0 ./gguftool-b 100 X=0
ab_tg def-0 ./gguftool 100 X=0
for i in 1 2; do
    ab_tg "base-$i" ./gguftool-b 25 X=0
    ab_tg "def-$i" ./gguftool 25 X=0
    ab_tg "pf16-$i" ./gguftool 25 GGUFTOOL_PREFETCH_MB=16
    ab_tg "pf32-$i" ./gguftool 25 GGUFTOOL_PREFETCH_MB=32
    ab_tg "coal-$i" ./gguftool 25 GGUFTOOL_GEMV_COALESCED=1
    ab_tg "parts-$i" ./gguftool 25 GGUFTOOL_RMS_PARTS=1
    ab_tg "merge-$i" ./gguftool 25 GGUFTOOL_MLA_MERGE=1
    ab_tg "short4-$i" ./gguftool 25 GGUFTOOL_GEMVQ1_SHORT=4
    ab_tg "mla4m-$i" ./gguftool 25 GGUFTOOL_MLA_DEC_SPLIT=4 GGUFTOOL_MLA_DEC_DIRECT=0 GGUFTOOL_MLA_MERGE=1
    ab_tg "all-$i" ./gguftool 25 $ALL
    if [ "$i" = 1 ]; then
        trace_run all $ALL
        [ -s "$W/trace-all.csv" ] && python3 "$D/timeline.py" "$W/trace-all.csv" --last 48 --launches > "$OUT/launches-all.txt" 2>&1
        rm -f "$OUT/timeline-all.txt"
    fi
done
ab_table base def pf16 pf32 coal parts merge short4 mla4m all > "$OUT/ab.txt"
step runtime-tests 120 "$OUT/runtime-tests.txt" env $ALL GGUFTOOL_MLA_DEC_SPLIT=4 GGUFTOOL_MLA_DEC_DIRECT=0 ./runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_decode cuda::tests::glm5_heads_shared --test-threads=1 --nocapture
echo "== tests"; grep -E "test result|FAILED|panicked|changed the output" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -8
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
grep -E "coalesced|F32" "$OUT/kernel-tests.txt" | head -6
cat "$OUT/ab.txt"
head -110 "$OUT/launches-all.txt"
cat "$STEPS"
fi

# 20. STAGE=fin17 (sixteenth session, after pf17): the weight prefetch and the MLA merge measured
#     slower and were taken out; the RMSNorm in parts and the router's coalesced GEMV are on by
#     default. Their tests, tg128 of the previous session's last commit (gguftool-b) against
#     this tree's defaults and each of the two turned off, and the short-decode MLA with more
#     key splits (GGUFTOOL_MLA_DEC_SPLIT=4 GGUFTOOL_MLA_DEC_DIRECT=0), alternating; the
#     default's timeline with every launch; the CUDA backend against the CPU; this tree's
#     closing figures (llama.cpp's on this machine type: the fifteenth session's call 2).
if [ "$STAGE" = fin17 ]; then
cd "$D" || exit 2
# SHORT=1 (the session's device time nearly spent): no kernel tests (pf17 ran them), the
# A/B without the two off-switches and the MLA splits, only the pp / tg closing figures.
[ -n "${SHORT:-}" ] || step tests 70 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 gemv_every gemv_glm5 rms_norm fused_norm 2>&1'
[ -s /tmp/glm5.gguf ] || step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
rm -f "$W"/ab-*.json
ab_tg base-0 ./gguftool-b 100 X=0
ab_tg def-0 ./gguftool 100 X=0
for i in 1 2; do
    ab_tg "base-$i" ./gguftool-b 25 X=0
    ab_tg "def-$i" ./gguftool 25 X=0
    ab_tg "noparts-$i" ./gguftool 25 GGUFTOOL_RMS_PARTS=0
    [ -n "${SHORT:-}" ] && continue
    ab_tg "nocoal-$i" ./gguftool 25 GGUFTOOL_GEMV_COALESCED=0
    ab_tg "mla4-$i" ./gguftool 25 GGUFTOOL_MLA_DEC_SPLIT=4 GGUFTOOL_MLA_DEC_DIRECT=0
done
ab_table base def noparts nocoal mla4 > "$OUT/ab.txt"
step runtime-tests 100 "$OUT/runtime-tests.txt" ./runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_decode cuda::tests::glm5_heads_shared --test-threads=1 --nocapture
trace_run def X=0
[ -s "$W/trace-def.csv" ] && python3 "$D/timeline.py" "$W/trace-def.csv" --last 48 --launches > "$OUT/launches-def.txt" 2>&1
rm -f "$OUT/timeline-def.txt"
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --json"
step ours-pp-tg 60 "$W/final-pp-tg.json" $B -p 8,16,32,64,512 -n 128 -r 2
[ -n "${SHORT:-}" ] || step ours-batched 40 "$W/final-batched.json" $B -p 0 -n 32 -r 1 --npl 8,32
[ -n "${SHORT:-}" ] || step ours-depth 40 "$W/final-depth.json" $B --no-profile -p 0 -n 32 -d 32768 -r 1
cp "$W/final-pp-tg.json" "$OUT/bench-all.json" 2>/dev/null
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -6
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
cat "$OUT/ab.txt"
head -24 "$OUT/launches-def.txt"
print_finals
cat "$STEPS"
fi

# 21. STAGE=s18 (seventeenth session; one ~9-minute call, not yet run: the session's machine
#     came for 3 minutes, STAGE=s18m below): the step's positions uploaded before its first
#     kernel (Backend::stage_positions), the MLA queries' quantize + RoPE as one launch
#     (GGUFTOOL_FUSE_ROPE_Q8) and the attention output's q8 from the combine launch
#     (GGUFTOOL_FUSE_ATTN_Q8), the short decode's MLA in 4-key splits: all on by default. Their
#     kernel tests, the CUDA backend against the CPU, then tg128 of a previous commit
#     (gguftool-b) against this tree's default, each fusion off, and other key splits (16/32 as
#     before, 2, 8), alternating; the default's timeline with the copies shown (timeline.py
#     --mem); both tools' closing figures (llama.cpp built in the background at nice 19; prepare
#     with LLAMA=1).
if [ "$STAGE" = s18 ]; then
cd "$D" || exit 2
# SHORT=1 (little device time left): no llama.cpp, two A/B rounds of three settings and the
# timeline, no closing figures.
if [ -z "${SHORT:-}" ]; then
    ( nice -n 19 bash ./llamacpp-bench.sh /nonexistent -p 0 -n 0 > "$W/llama-build.txt" 2>&1 ) &
    BUILD=$!
fi
step tests 90 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 rope_q8 mla_ rope 2>&1'
[ -s /tmp/glm5.gguf ] || step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step runtime-tests 120 "$OUT/runtime-tests.txt" ./runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_decode cuda::tests::glm5_heads_shared --test-threads=1 --nocapture
rm -f "$W"/ab-*.json
ab_tg base-0 ./gguftool-b 100 X=0
ab_tg def-0 ./gguftool 100 X=0
for i in 1 2; do
    ab_tg "base-$i" ./gguftool-b 25 X=0
    ab_tg "def-$i" ./gguftool 25 X=0
    if [ -n "${SHORT:-}" ]; then
        ab_tg "s16-$i" ./gguftool 25 GGUFTOOL_MLA_DEC_SPLIT=16 GGUFTOOL_MLA_DEC_DIRECT=32
        [ "$i" = 1 ] && { trace_run def X=0; [ -s "$W/trace-def.csv" ] && python3 "$D/timeline.py" "$W/trace-def.csv" --last 48 --launches --mem > "$OUT/launches-def.txt" 2>&1; rm -f "$OUT/timeline-def.txt"; }
        continue
    fi
    ab_tg "norq8-$i" ./gguftool 25 GGUFTOOL_FUSE_ROPE_Q8=0
    ab_tg "noaq8-$i" ./gguftool 25 GGUFTOOL_FUSE_ATTN_Q8=0
    ab_tg "s16-$i" ./gguftool 25 GGUFTOOL_MLA_DEC_SPLIT=16 GGUFTOOL_MLA_DEC_DIRECT=32
    ab_tg "s2-$i" ./gguftool 25 GGUFTOOL_MLA_DEC_SPLIT=2 GGUFTOOL_MLA_DEC_DIRECT=0
    ab_tg "s8-$i" ./gguftool 25 GGUFTOOL_MLA_DEC_SPLIT=8 GGUFTOOL_MLA_DEC_DIRECT=0
done
ab_table base def norq8 noaq8 s16 s2 s8 > "$OUT/ab.txt"
if [ -z "${SHORT:-}" ]; then
    trace_run def X=0
    [ -s "$W/trace-def.csv" ] && python3 "$D/timeline.py" "$W/trace-def.csv" --last 48 --launches --mem > "$OUT/launches-def.txt" 2>&1
    rm -f "$OUT/timeline-def.txt"
    closing_figures
fi
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -6
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
cat "$OUT/ab.txt"
head -24 "$OUT/launches-def.txt"
cat "$OUT/llama.txt"
print_finals gbps
cat "$STEPS"
fi

# 22. STAGE=s18m: STAGE=s18 for a call of ~4 minutes: the new kernels' GPU tests, the same-call
#     tg128 A/B (previous commit, default, both fusions, and those with 4-key MLA splits), then
#     the CUDA backend against the CPU with both fusions on. Ran once, on 80443bd's binaries,
#     where the fusions were opt-in and the splits 16/32; on later trees the fusions' variables
#     and "def" against "both" measure nothing (both are defaults, and so are the 4-key splits).
if [ "$STAGE" = s18m ]; then
cd "$D" || exit 2
NEW="GGUFTOOL_FUSE_ROPE_Q8=1 GGUFTOOL_FUSE_ATTN_Q8=1"
step tests 50 "$OUT/kernel-tests.txt" bash -c './kernels-gpu --test-threads=1 rope_q8 mla_attention_q8 2>&1'
[ -s /tmp/glm5.gguf ] || step synth 60 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
rm -f "$W"/ab-*.json
ab_tg base-0 ./gguftool-b 40 X=0
for i in 1 2; do
    ab_tg "base-$i" ./gguftool-b 20 X=0
    ab_tg "def-$i" ./gguftool 20 X=0
    ab_tg "both-$i" ./gguftool 20 $NEW
    ab_tg "s4q-$i" ./gguftool 20 $NEW GGUFTOOL_MLA_DEC_SPLIT=4 GGUFTOOL_MLA_DEC_DIRECT=0
done
ab_table base def both s4q > "$OUT/ab.txt"
step runtime-tests 90 "$OUT/runtime-tests.txt" env $NEW ./runtime-lib cuda::tests::glm5_heads_decode cuda::tests::cuda_matches_cpu_on_fixtures --test-threads=1 --nocapture
echo "== tests"; grep -E "test result|FAILED|panicked|\| rope_q8|mla_q8|launches per step" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -12
cat "$OUT/ab.txt"
cat "$STEPS"
fi

# 23. STAGE=s19 (eighteenth session; ~5 minutes): an MLA block's q_a norm, latent cache rows and
#     indexer keys as one launch (Backend::mla_norms, kernels::Gpu::mla_norms; on by default,
#     GGUFTOOL_FUSE_MLA_NORMS=0 turns it off). Its kernel test and the neighbouring norm tests,
#     the CUDA backend against the CPU (the fusion test now counts 31 launches), then tg128 of
#     the previous commit (gguftool-b) against this tree with and without the fusion, three
#     alternating rounds, pp512 and 8-sequence decode with and without it, and the default's
#     timeline with copies. Also the 6,144-wide norms as 12 parts of 512 threads or 24 of 256
#     (GGUFTOOL_RMS_REGS=12 / 24 with GGUFTOOL_RMS_WIDE=512 / 256), two rounds.
if [ "$STAGE" = s19 ]; then
cd "$D" || exit 2
step tests 60 "$OUT/kernel-tests.txt" bash -c 'GGUFTOOL_CUDA_SYNC=1 ./kernels-gpu --test-threads=1 mla_norms norm_rope fused_norm rms_norm 2>&1'
[ -s /tmp/glm5.gguf ] || step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
step runtime-tests 130 "$OUT/runtime-tests.txt" ./runtime-lib cuda::tests::cuda_matches_cpu_on_fixtures cuda::tests::glm5_heads_decode cuda::tests::glm5_heads_shared --test-threads=1 --nocapture
rm -f "$W"/ab-*.json
ab_tg base-0 ./gguftool-b 100 X=0
ab_tg def-0 ./gguftool 100 X=0
for i in 1 2 3; do
    ab_tg "base-$i" ./gguftool-b 25 X=0
    ab_tg "def-$i" ./gguftool 25 X=0
    ab_tg "nonorm-$i" ./gguftool 25 GGUFTOOL_FUSE_MLA_NORMS=0
    [ "$i" = 3 ] && continue
    ab_tg "r12-$i" ./gguftool 25 GGUFTOOL_RMS_REGS=12 GGUFTOOL_RMS_WIDE=512
    ab_tg "r24-$i" ./gguftool 25 GGUFTOOL_RMS_REGS=24 GGUFTOOL_RMS_WIDE=256
done
ab_table base def nonorm r12 r24 > "$OUT/ab.txt"
B="./gguftool bench -m /tmp/glm5.gguf --device cuda --no-profile --json"
for c in def nonorm def nonorm; do
    v=1; [ "$c" = nonorm ] && v=0
    step "pp-$c" 30 "$W/pp-$c-$(date +%s%N).json" env GGUFTOOL_FUSE_MLA_NORMS=$v $B -p 512 -n 32 -r 2 --npl 1,8
done
python3 - "$W" >> "$OUT/ab.txt" <<'PY'
import json, glob, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "pp-*.json"))):
    for r in json.load(open(f)):
        print(os.path.basename(f).split("-")[1], r["test"], r["n_prompt"], r["n_gen"], r["n_seq"], round(r["avg_ts"], 1))
PY
trace_run def X=0
[ -s "$W/trace-def.csv" ] && python3 "$D/timeline.py" "$W/trace-def.csv" --last 48 --launches --mem > "$OUT/launches-def.txt" 2>&1
rm -f "$OUT/timeline-def.txt"
echo "== tests"; grep -E "test result|FAILED|panicked" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | tail -6
grep -c "| ok |" "$OUT/kernel-tests.txt" | sed 's/^/kernel checks ok: /'
grep -E "mla_norms|decode fusions" "$OUT/kernel-tests.txt" "$OUT/runtime-tests.txt" | head -20
cat "$OUT/ab.txt"
head -24 "$OUT/launches-def.txt"
cat "$STEPS"
fi

# 24. STAGE=s19b (eighteenth session; ~3 minutes): fewer parts for the one-row RMSNorms
#     (GGUFTOOL_RMS_PARTS_MAX=3 / 2; GGUFTOOL_RMS_PARTS=0: one block) against the default (one
#     part per register slot: 6 for the 6,144-wide rows, 4 for q_a's), after s19 found 12 and
#     24 parts slower. tg128, a warm-up and two alternating rounds.
if [ "$STAGE" = s19b ]; then
cd "$D" || exit 2
[ -s /tmp/glm5.gguf ] || step synth 150 "$W/synth.json" ./gguftool synth --preset glm5 -o /tmp/glm5.gguf --force --json
rm -f "$W"/ab-*.json
ab_tg def-0 ./gguftool 100 X=0
for i in 1 2; do
    ab_tg "def-$i" ./gguftool 25 X=0
    ab_tg "p3-$i" ./gguftool 25 GGUFTOOL_RMS_PARTS_MAX=3
    ab_tg "p2-$i" ./gguftool 25 GGUFTOOL_RMS_PARTS_MAX=2
    ab_tg "p1-$i" ./gguftool 25 GGUFTOOL_RMS_PARTS=0
done
ab_table def p3 p2 p1 > "$OUT/ab.txt"
cat "$OUT/ab.txt"
cat "$STEPS"
fi
