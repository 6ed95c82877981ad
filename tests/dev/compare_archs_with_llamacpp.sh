#!/bin/bash
# Cross-check of `gguftool convert --to gguf` against llama.cpp's converter on the generated
# checkpoints of tests/tests/convert_gguf_archs.rs (one per mapping-table architecture).
# Needs: a venv with torch (CPU or CUDA wheel), numpy, safetensors, sentencepiece, transformers,
# tokenizers; llama.cpp's python sources (convert_hf_to_gguf.py + conversion/ + gguf-py/) in $LC.
# The converter names BPE pre-tokenizers by a hash of token ids; the generated tokenizers are the
# fixture's, so $LC/conversion/base.py needs the fixtures' one-clause patch
# (a24cd1fe... -> "glm4") plus 84b74bad... -> "qwen2" for the Qwen variant (digits split one by one).
# With that patch the llama checkpoint differs only in tokenizer.ggml.pre ("glm4" from the patched
# hash vs our table's "llama-bpe" for llama-3's regex on llama).
# usage: PY=venv/bin/python LC=llama.cpp-python bash tests/dev/compare_archs_with_llamacpp.sh
set -u
OUT=$(mktemp -d)
GGUFTOOL_KEEP_CHECKPOINTS=$OUT cargo test -q -p gguftool-tests --test convert_gguf_archs >/dev/null || exit 1
cd "$OUT"
for d in tiny-*/; do
  d=${d%/}
  nice "$PY" "$LC/convert_hf_to_gguf.py" "$d" --outtype bf16 --outfile "lc-$d.gguf" >"lc-$d.log" 2>&1 || { echo "$d: converter failed (lc-$d.log)"; continue; }
  if cmp -s "lc-$d.gguf" "$d.gguf"; then echo "$d: byte-identical"; else echo "$d: DIFFERS"; fi
done
echo "files in $OUT"
