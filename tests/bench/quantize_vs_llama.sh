#!/bin/bash
# gguftool quantize vs llama-quantize on the same BF16 input, alternating, same thread count;
# every output compared byte for byte. Prints one line per run and the medians.
# usage: BIN=target/release/gguftool LLAMA=path/to/llama-quantize [RUNS=5] [THREADS=2] \
#        [LAYERS=8] bash tests/bench/quantize_vs_llama.sh WORKDIR TYPE...
# Input: `gguftool synth --preset glm5-mini --layers $LAYERS` (GLM-5 structure, small dims,
# random contents) converted to BF16 with `gguftool quantize ... BF16 --allow-requantize`.
set -euo pipefail
BIN=${BIN:-target/release/gguftool}; LLAMA=${LLAMA:?set LLAMA to llama-quantize}
RUNS=${RUNS:-5}; THREADS=${THREADS:-2}; LAYERS=${LAYERS:-8}
W=$1; shift; mkdir -p "$W"
"$BIN" synth --preset glm5-mini --layers "$LAYERS" -o "$W/synth.gguf" --force -q
"$BIN" quantize "$W/synth.gguf" "$W/in.gguf" BF16 --allow-requantize --force -q
echo "input: $(stat -c %s "$W/in.gguf") bytes, load $(cut -d' ' -f1-3 /proc/loadavg)"
secs() { local t0 t1; t0=$(date +%s.%N); "$@" >/dev/null 2>&1; t1=$(date +%s.%N); echo "$t1 - $t0" | bc; }
median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
for t in "$@"; do
  : > "$W/l.txt"; : > "$W/g.txt"
  for r in $(seq "$RUNS"); do
    l=$(secs "$LLAMA" "$W/in.gguf" "$W/l.gguf" "$t" "$THREADS")
    g=$(secs "$BIN" quantize "$W/in.gguf" "$W/g.gguf" "$t" --threads "$THREADS" --force -q)
    cmp -s "$W/l.gguf" "$W/g.gguf" && same=identical || same=DIFFERENT
    echo "$t run $r: llama-quantize $l s, gguftool $g s, outputs $same"
    echo "$l" >> "$W/l.txt"; echo "$g" >> "$W/g.txt"
  done
  echo "$t median: llama-quantize $(median < "$W/l.txt") s, gguftool $(median < "$W/g.txt") s"
done
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
