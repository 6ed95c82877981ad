#!/usr/bin/env bash
# Benchmark (docs/BENCHMARKS.md): merge a >= 4 GB GLM-5-shaped model split in 5 shards, against
# `cat` of the same shards to the same disk; median of RUNS runs each, peak RSS from GNU time.
# usage: tests/bench/merge_vs_cat.sh [DIR]   (BIN=target/release/gguftool, RUNS=3)
set -euo pipefail
BIN=${BIN:-target/release/gguftool}
DIR=${1:-/tmp/gguftool-bench}
RUNS=${RUNS:-3}
mkdir -p "$DIR"
[[ -f $DIR/model.gguf ]] || "$BIN" synth --preset glm5 --layers 2 -o "$DIR/model.gguf" --quiet
rm -f "$DIR"/shard-*.gguf
"$BIN" split "$DIR/model.gguf" -o "$DIR/shard" --max-tensors 9 --quiet
shards=("$DIR"/shard-*.gguf)
echo "model $(stat -c %s "$DIR/model.gguf") bytes in ${#shards[@]} shards"
TIME=/usr/bin/time
cat "${shards[@]}" > /dev/null   # warm the page cache for both
declare -a tc tm rc rm_
for i in $(seq "$RUNS"); do
  rm -f "$DIR/cat.out" "$DIR/merged.gguf"
  sync
  r=$($TIME -f "%e %M" bash -c "cat ${shards[*]} > $DIR/cat.out" 2>&1 | tail -1); tc+=("${r% *}"); rc+=("${r#* }")
  sync
  r=$($TIME -f "%e %M" "$BIN" merge "${shards[0]}" -o "$DIR/merged.gguf" --quiet 2>&1 | tail -1); tm+=("${r% *}"); rm_+=("${r#* }")
  sync
  cmp -s "$DIR/merged.gguf" "$DIR/model.gguf" || { echo "merged file differs from the model"; exit 1; }
done
med() { printf '%s\n' "$@" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
mc=$(med "${tc[@]}"); mm=$(med "${tm[@]}")
echo "cat   times: ${tc[*]}  median ${mc}s  peak RSS KiB: ${rc[*]}"
echo "merge times: ${tm[*]}  median ${mm}s  peak RSS KiB: ${rm_[*]}"
awk -v a="$mm" -v b="$mc" 'BEGIN {printf "merge/cat = %.3f\n", a/b}'
rm -f "$DIR/cat.out" "$DIR/merged.gguf"
