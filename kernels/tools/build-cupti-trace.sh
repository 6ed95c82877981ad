#!/usr/bin/env bash
# Builds kernels/tools/cupti_trace.c into DEST (default .device-speed/) with libcupti.so.13 beside
# it, from the PyPI wheels of CUDA 13.0's CUPTI and runtime headers (the device's CUDA). A
# measuring instrument, not part of the product.
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${DEST:-.device-speed}
W=${W:-/tmp/cupti-wheels}
mkdir -p "$W" "$DEST"
if [ ! -f "$W/x/nvidia/cu13/include/cupti.h" ]; then
    pip download nvidia-cuda-cupti==13.0.85 nvidia-cuda-runtime==13.0.96 nvidia-cuda-crt==13.0.88 --no-deps -d "$W" -q
    mkdir -p "$W/x"
    for f in "$W"/*.whl; do unzip -q -o "$f" -d "$W/x"; done
fi
I=$W/x/nvidia/cu13
gcc -O2 -shared -fPIC -I"$I/include" -o "$DEST/libcupti_trace.so" kernels/tools/cupti_trace.c \
    -L"$I/lib" -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN'
cp "$I/lib/libcupti.so.13" "$DEST/"
ls -la "$DEST/libcupti_trace.so" "$DEST/libcupti.so.13"
