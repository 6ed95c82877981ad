#!/usr/bin/env bash
# Build what a GPU run needs on this (CPU) machine and stage it in .device/ (git-ignored), which
# the device tool carries: the kernels GPU test binary, the gguftool binary, the device script
# and the fixture files the runs read. See docs/GPU.md.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .device
cargo build --release -p gguftool
bin=$(cargo test --release -p kernels --test gpu --no-run --message-format=json 2>/dev/null \
    | sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -1)
[ -n "$bin" ] || { echo "no test binary" >&2; exit 1; }
cp "$bin" .device/kernels-gpu-tests
cp target/release/gguftool .device/gguftool
strip .device/kernels-gpu-tests .device/gguftool 2>/dev/null || true
cp kernels/device-run.sh .device/run.sh
for f in "$@"; do cp "$f" .device/; done
du -sh .device
