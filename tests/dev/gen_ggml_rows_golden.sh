#!/bin/bash
# Records ggml's own output (ggml_quantize_chunk, via tests/dev/ggml_quantize_rows.c) for the
# low-bit grid quantizers on synthetic rows, with and without an importance matrix, as sha256s
# into tests/fixtures/quantize/ggml-quantize-rows.json; gguf/tests/quantize_ggml_rows.rs makes
# the same rows and compares. The rows (the generator is written out in that test too): 8 rows
# of 512 values from a 64-bit LCG, every 5th value rounded to 1/16 (exact ties for the sorts),
# exact zeros and negative zeros, an all-zero super-block and two tiny ones (the eps branches).
#
# ggml: libggml-base from /work/shared/bench/llama.cpp-2026-10-01-trimmed.tar.xz, built as in
# tests/dev/gen_quantize_golden.sh (no -march=native: no FMA).
# usage: tests/dev/gen_ggml_rows_golden.sh LLAMA_CPP_SOURCE_DIR LLAMA_CPP_BUILD_BIN_DIR
set -euo pipefail
SRC=$1; BIN=$2
HERE=$(cd "$(dirname "$0")/.." && pwd)
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
cc -O2 -I"$SRC/ggml/include" "$HERE/dev/ggml_quantize_rows.c" -L"$BIN" -lggml-base -Wl,-rpath,"$BIN" -o "$T/q"
python3 - "$T" <<'PY'
import math, struct, sys
t = sys.argv[1]
M = (1 << 64) - 1
def lcg(seed):
    s = seed
    while True:
        s = (s * 6364136223846793005 + 1442695040888963407) & M
        yield (s >> 40) / 16777216.0 - 0.5
N, ROWS = 512, 8
g = lcg(17)
x = []
for i in range(N * ROWS):
    u = next(g)
    v = u * u * u * 8.0 + u * 0.1
    if i % 5 == 0:
        v = math.floor(v * 16.0 + 0.5) / 16.0
    r, c = divmod(i, N)
    if r == 3 and c >= 256:
        v = 0.0
    elif r == 5 and c < 256:
        v = v * 1e-9
    elif r == 6 and c < 256:
        v = v * 1e-14
    if i % 97 == 0:
        v = 0.0
    elif i % 89 == 0:
        v = -0.0
    x.append(v)
g = lcg(23)
w = []
for i in range(N):
    u = next(g)
    w.append(u * u + 0.01)
open(f"{t}/x.f32", "wb").write(struct.pack(f"<{len(x)}f", *x))
open(f"{t}/w.f32", "wb").write(struct.pack(f"<{len(w)}f", *w))
PY
# name ggml-type-id with-imatrix
CASES="IQ2_XS:17:1 IQ2_S:22:0 IQ2_S:22:1 IQ1_S:19:1 IQ1_M:29:0 IQ1_M:29:1"
{
echo '{'
echo '  "tool": "ggml_quantize_chunk of libggml-base, llama.cpp source of 2026-10-01 (trimmed tarball), via tests/dev/ggml_quantize_rows.c",'
echo '  "rows": 8, "n_per_row": 512,'
echo '  "outputs": {'
first=1
for c in $CASES; do
  IFS=: read -r name id im <<<"$c"
  if [[ $im == 1 ]]; then "$T/q" $id "$T/x.f32" 512 "$T/w.f32" >"$T/o"; key="$name+imatrix"; else "$T/q" $id "$T/x.f32" 512 >"$T/o"; key=$name; fi
  [[ $first == 1 ]] || echo ','; first=0
  printf '    "%s": {"bytes": %s, "sha256": "%s"}' "$key" $(stat -c %s "$T/o") $(sha256sum "$T/o" | cut -c1-64)
done
echo
echo '  }'
echo '}'
} > "$HERE/fixtures/quantize/ggml-quantize-rows.json"
