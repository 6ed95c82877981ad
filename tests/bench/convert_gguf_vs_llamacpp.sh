#!/bin/bash
# Wall time and peak RSS of `gguftool convert HF_DIR --to gguf` against llama.cpp's converter and
# against plain copies of the same bytes, in one run.
#   BIN=target/release/gguftool PY=venv/bin/python LC=llama.cpp-python WORK=/tmp/x \
#     bash tests/bench/convert_gguf_vs_llamacpp.sh
# PY: a venv with torch, numpy, safetensors, sentencepiece, transformers, tokenizers.
# LC: llama.cpp's python sources (convert_hf_to_gguf.py, conversion/, gguf-py/) with the fixtures'
#     one-clause pre-tokenizer patch (the fixture tokenizer's hash -> "glm4").
# WORK: scratch space (~2x the checkpoint; the GLM-5-shaped checkpoint is 8.6 GB, deleted after).
set -eu
HERE=$(cd "$(dirname "$0")" && pwd)
measure() { # label, command...: prints "label  wall_s  peak_rss_MiB"
  local label=$1; shift
  /usr/bin/time -f %e:%M -o "$WORK/.time" nice "$@" >/dev/null 2>&1
  local out; out=$(tail -1 "$WORK/.time")
  printf '%-44s %8s s %8.1f MiB\n' "$label" "${out%%:*}" "$(echo "${out##*:} / 1024" | bc -l)"
}
mkdir -p "$WORK"
# 1. the tiny-glm5 fixture (15 MB), in a directory named as llama.cpp's converter saw it
rm -rf "$WORK/tiny-glm5" && cp -r "$HERE/../fixtures/hf" "$WORK/tiny-glm5"
for i in 1 2 3; do
  measure "tiny-glm5 llama.cpp convert_hf_to_gguf.py" "$PY" "$LC/convert_hf_to_gguf.py" "$WORK/tiny-glm5" --outtype bf16 --outfile "$WORK/lc.gguf"
  measure "tiny-glm5 gguftool convert --to gguf" "$BIN" convert "$WORK/tiny-glm5" --to gguf "$WORK/ours.gguf" --outtype bf16 --force -q
done
cmp "$WORK/lc.gguf" "$WORK/ours.gguf" && echo "tiny-glm5: outputs byte-identical"
# 2. a GLM-5-shaped checkpoint (real widths, 24 experts, 1 dense + 1 MoE layer + MTP), 8.6 GB
G="$WORK/glm5-shaped"
[[ -d $G ]] || python3 "$HERE/glm5_shaped_checkpoint.py" "$G" 24 >/dev/null
du -sb "$G" | awk '{printf "checkpoint %.2f GB\n", $1/1e9}'
measure "cat shards > /dev/null (read baseline)" sh -c "cat $G/*.safetensors > /dev/null"
measure "cat shards > copy; sync (read+write baseline)" sh -c "cat $G/*.safetensors > $WORK/copy && sync $WORK/copy"
rm -f "$WORK/copy"
measure "gguftool convert --to gguf --outtype bf16" "$BIN" convert "$G" --to gguf "$WORK/big.gguf" --outtype bf16 --force -q
ls -l "$WORK/big.gguf" | awk '{printf "output %.2f GB\n", $5/1e9}'
measure "gguftool convert --to gguf --outtype q8_0" "$BIN" convert "$G" --to gguf "$WORK/big.gguf" --outtype q8_0 --force -q
rm -f "$WORK/big.gguf"
if [[ ${SKIP_LC_BIG:-0} != 1 ]]; then
  measure "llama.cpp convert_hf_to_gguf.py --outtype bf16" "$PY" "$LC/convert_hf_to_gguf.py" "$G" --outtype bf16 --outfile "$WORK/lc-big.gguf"
  rm -f "$WORK/lc-big.gguf"
fi
[[ ${KEEP:-0} == 1 ]] || rm -rf "$G"
