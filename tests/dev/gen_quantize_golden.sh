#!/bin/bash
# Records llama-quantize's output for every file type it makes from the fixture without an
# importance matrix, as sha256 + size per file and per tensor, into
# tests/fixtures/quantize/llama-quantize-tiny-glm5.json (the outputs are ~100 MB together, too
# big to commit; a sha256 match is a byte match).
#
# llama-quantize: built from /work/shared/bench/llama.cpp-2026-10-01-trimmed.tar.xz with
#   cmake -B build -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
#         -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DGGML_OPENMP=OFF
#   cmake --build build --target llama-quantize
# (ggml-quants.c lives in ggml-base, compiled without -march=native: no FMA.) That build's
# Q8_0, Q6_K and Q4_K_M outputs are byte-identical to the fixture files made by the fixture
# authors, which this script checks first.
# usage: tests/dev/gen_quantize_golden.sh LLAMA_QUANTIZE GGUFTOOL
set -euo pipefail
Q=$1; TOOL=$2
HERE=$(cd "$(dirname "$0")/.." && pwd)
IN=$HERE/fixtures/gguf/tiny-glm5-BF16.gguf
T=$(mktemp -d); trap 'rm -rf "$T"' EXIT
for t in Q8_0 Q6_K Q4_K_M; do
  "$Q" "$IN" "$T/$t.gguf" $t 2 >/dev/null 2>&1
  cmp "$T/$t.gguf" "$HERE/fixtures/gguf/tiny-glm5-$t.gguf"
done
TYPES="Q8_0 Q6_K Q5_K_M Q5_K_S Q4_K_M Q4_K_S Q3_K_L Q3_K_M Q3_K_S Q2_K Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS IQ3_S IQ3_M TQ1_0 TQ2_0 MXFP4_MOE F16 BF16 F32"
TYPES_IM="Q8_0 Q6_K Q5_K_M Q5_K_S Q4_K_M Q4_K_S Q3_K_L Q3_K_M Q3_K_S Q2_K Q4_0 Q4_1 Q5_0 Q5_1 IQ4_NL IQ4_XS IQ3_S IQ3_M"
TYPES_OV="IQ3_XXS IQ3_XS IQ2_XXS IQ2_XS IQ2_S IQ2_M IQ1_S IQ1_M Q2_K_S"
FAIL="Q1_0 Q2_K_S IQ3_XS IQ3_XXS IQ2_M IQ2_S IQ2_XS IQ2_XXS IQ1_S IQ1_M"
# One JSON object of `"TYPE": {bytes, sha256}` for llama-quantize --imatrix runs from the
# fixtures folder; arguments before `--` are passed to llama-quantize.
imatrix_section() {
  local extra=() first=1 t
  if [[ " $* " == *" -- "* ]]; then
    while [[ $1 != -- ]]; do extra+=("$1"); shift; done; shift
  fi
  for t in "$@"; do
    (cd "$HERE/fixtures/quantize" && "$Q" --imatrix tiny-glm5-imatrix.gguf "${extra[@]}" ../gguf/tiny-glm5-BF16.gguf "$T/o.gguf" $t 2 >/dev/null 2>&1)
    [[ $first == 1 ]] || echo ','; first=0
    printf '    "%s": {"bytes": %s, "sha256": "%s"}' $t $(stat -c %s "$T/o.gguf") $(sha256sum "$T/o.gguf" | cut -c1-64)
  done
  echo
  echo '  },'
}
{
echo '{'
echo '  "tool": "llama-quantize, llama.cpp source of 2026-10-01 (trimmed tarball), CPU build as in tests/dev/gen_quantize_golden.sh",'
echo '  "input": "tests/fixtures/gguf/tiny-glm5-BF16.gguf",'
echo '  "command": "llama-quantize tiny-glm5-BF16.gguf OUT TYPE 2",'
echo '  "outputs": {'
first=1
for t in $TYPES; do
  "$Q" "$IN" "$T/o.gguf" $t 2 >/dev/null 2>&1
  [[ $first == 1 ]] || echo ','; first=0
  printf '    "%s": {"bytes": %s, "sha256": "%s", "tensors": ' $t $(stat -c %s "$T/o.gguf") $(sha256sum "$T/o.gguf" | cut -c1-64)
  "$TOOL" verify "$T/o.gguf" --hash --json -q 2>/dev/null | python3 -c '
import json,sys; r=json.load(sys.stdin)
print(json.dumps([[t["name"], t["type"], t["sha256"]] for t in r["tensors"]]), end="")'
  printf '}'
done
echo
echo '  },'
# With the importance matrix tests/fixtures/quantize/tiny-glm5-imatrix.gguf, made by
#   llama-imatrix -m tiny-glm5-BF16.gguf -f tests/fixtures/quantize/imatrix-calibration.txt \
#                 -o tiny-glm5-imatrix.gguf -c 128 -t 2
# run from tests/fixtures/quantize so the recorded quantize.imatrix.file is the relative name.
echo '  "imatrix_command": "cd tests/fixtures/quantize && llama-quantize --imatrix tiny-glm5-imatrix.gguf ../gguf/tiny-glm5-BF16.gguf OUT TYPE 2",'
echo '  "imatrix_outputs": {'
imatrix_section $TYPES_IM
# Types that need an importance matrix for every tensor: the fixture imatrix has no entries for
# the MTP block (llama-imatrix does not run it), so that block is pinned to Q8_0.
echo '  "imatrix_override_command": "cd tests/fixtures/quantize && llama-quantize --imatrix tiny-glm5-imatrix.gguf --tensor-type blk\\.3\\.=q8_0 ../gguf/tiny-glm5-BF16.gguf OUT TYPE 2",'
echo '  "imatrix_override_outputs": {'
imatrix_section --tensor-type 'blk\.3\.=q8_0' -- $TYPES_OV
echo '  "refused": {'
first=1
for t in $FAIL; do
  if "$Q" "$IN" "$T/o.gguf" $t 2 >"$T/log" 2>&1; then echo "$t unexpectedly succeeded" >&2; exit 1; fi
  [[ $first == 1 ]] || echo ','; first=0
  printf '    "%s": "%s"' $t "$(grep -o 'failed to quantize: .*' "$T/log" | head -1 | sed 's/"/\\"/g')"
done
echo
echo '  }'
echo '}'
} > "$HERE/fixtures/quantize/llama-quantize-tiny-glm5.json"
