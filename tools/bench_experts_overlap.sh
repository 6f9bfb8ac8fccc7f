#!/usr/bin/env bash
# Overlap check: decode under each budget with resident experts computed while the misses are read, and
# with the wait-all baseline, interleaved (REPS runs each) so disk and CPU noise hit both alike.
# Usage: tools/bench_experts_overlap.sh NVFP4_MODEL_DIR [REPS] [DECODE_TOKENS]
set -euo pipefail
model=$1; reps=${2:-3}; dec=${3:-32}
. "$(dirname "$0")/bench_lib.sh"
build_release
for b in 1.0 0.5 0.25 0.1; do
  for r in $(seq "$reps"); do
    for mode in "" --wait-all; do
      "$bin" --threads 2 bench experts --model "$model" --budget "$b" --decode-tokens "$dec" $mode 2>/dev/null
    done
  done
done | python3 "$bench_here/overlap_table.py"
