#!/usr/bin/env bash
# Installs NVRTC (the CUDA runtime compiler, no GPU needed) from PyPI so that
# `cargo test -p kernels --test compile` really compiles every kernel for sm_90 and sm_120.
# Prints the directory to put on LD_LIBRARY_PATH as its only stdout line, e.g.
#   export LD_LIBRARY_PATH="$(.ci/nvrtc-setup.sh)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# CUDA 13.0 matches the driver of the GPU machines (docs/GPU.md); PTX/CUBIN from a newer NVRTC
# could be rejected there. Exit status is non-zero when the wheel cannot be installed.
set -euo pipefail
VERSION=13.0.88
PY=${PYTHON:-python3}
if ! "$PY" -c "import importlib.metadata as m; assert m.version('nvidia-cuda-nvrtc') == '$VERSION'" 2>/dev/null; then
    "$PY" -m pip install --quiet --disable-pip-version-check "nvidia-cuda-nvrtc==$VERSION" >&2
fi
LIB=$("$PY" - <<'PY'
import importlib.metadata as m, pathlib
dist = m.distribution("nvidia-cuda-nvrtc")
libs = {pathlib.Path(dist.locate_file(f)).parent for f in dist.files if "libnvrtc.so" in f.name}
print(sorted(libs)[0] if libs else "")
PY
)
if [ -z "$LIB" ] || [ ! -d "$LIB" ]; then
    echo "nvrtc-setup: libnvrtc.so not found in the nvidia-cuda-nvrtc wheel" >&2
    exit 1
fi
echo "$LIB"
