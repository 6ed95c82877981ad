#!/usr/bin/env bash
# Build what kernels/device-speed.sh needs on this (CPU) machine and stage it, xz-compressed, in
# the folder the device tool sends (default /work/main/.device-speed, git-ignored there): the
# release gguftool, the kernels GPU test binary, the runtime library test binary (CUDA vs CPU),
# the run script, optionally a baseline gguftool (MAIN_BIN=path) for before/after figures and
# llama.cpp's bench script and source (LLAMA=1, for STAGE=final), a measuring build (PROF_BIN=path),
# the CUPTI kernel tracer (TRACE=1, for STAGE=trace).
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${DEST:-/work/main/.device-speed}
mkdir -p "$DEST"
rm -f "$DEST"/*
cargo build --release -p gguftool
exe() { sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1; }
kt=$(cargo test --release -p kernels --test gpu --no-run --message-format=json 2>/dev/null | exe)
rt=$(cargo test --release -p runtime --lib --no-run --message-format=json 2>/dev/null | exe)
tp=$(cargo test --release -p runtime --test tp_gpu --no-run --message-format=json 2>/dev/null | exe)
[ -n "$kt" ] && [ -n "$rt" ] && [ -n "$tp" ] || { echo "test binaries not found" >&2; exit 1; }
cp target/release/gguftool "$DEST/gguftool"
cp "$kt" "$DEST/kernels-gpu"
cp "$rt" "$DEST/runtime-lib"
cp "$tp" "$DEST/tp-gpu"
[ -n "${MAIN_BIN:-}" ] && cp "$MAIN_BIN" "$DEST/gguftool-main"
# A measuring build (e.g. an instrumented kernel for STAGE=seqs) travels as gguftool-prof.
[ -n "${PROF_BIN:-}" ] && cp "$PROF_BIN" "$DEST/gguftool-prof"
# A second variant of the tree for same-call comparisons travels as gguftool-b.
[ -n "${B_BIN:-}" ] && cp "$B_BIN" "$DEST/gguftool-b"
strip "$DEST"/gguftool* "$DEST/kernels-gpu" "$DEST/runtime-lib" "$DEST/tp-gpu" 2>/dev/null || true
# One solid archive: the binaries share most of their code, so xz finds it once.
(cd "$DEST" && tar cf - gguftool* kernels-gpu runtime-lib tp-gpu | xz -9e -T1 > payload.tar.xz &&
    rm -f gguftool gguftool-* kernels-gpu runtime-lib tp-gpu)
cp kernels/device-speed.sh "$DEST/run.sh"
# STAGE=trace's kernel timeline: the CUPTI injection library (built here) and its reader.
if [ -n "${TRACE:-}" ]; then
    DEST=$DEST W=${CUPTI_WHEELS:-/tmp/cupti-wheels} bash kernels/tools/build-cupti-trace.sh
    cp kernels/tools/timeline.py "$DEST/"
fi
# STAGE=final builds llama.cpp there: the measuring instrument of ../shared/bench travels with it
# (never copied into the repository: .device-speed/ is ignored).
if [ -n "${LLAMA:-}" ]; then
    cp ../shared/bench/llamacpp-bench.sh ../shared/bench/llama.cpp-2026-10-01-trimmed.tar.xz "$DEST/"
fi
du -sh "$DEST"; ls -la "$DEST"
