#!/usr/bin/env bash
# Read-ahead benchmark (issue 36): decode of an NVFP4 MoE checkpoint with its experts streamed from disk,
# at RAM budgets of 25% and 10%, without read-ahead and with each policy, engines interleaved over
# REPS repetitions (medians in docs/benchmarks.md). The oracle reads a trace of the same prompt recorded
# first, at a full budget after a warm-up (that run is also the compute-only time: nothing is read).
# Usage: tools/bench_prefetch.sh NVFP4_MODEL_DIR [REPS] [DECODE_TOKENS]
set -euo pipefail
model=$1; reps=${2:-3}; dec=${3:-32}
. "$(dirname "$0")/bench_lib.sh"
build_release
trace=$(mktemp --suffix .json)
machine_header
"$bin" --threads 2 bench experts --model "$model" --budget 1.0 --warmup --decode-tokens "$dec" \
  --trace-out "$trace" 2>/dev/null | sed 's/^/{"budget_run": "resident", "r": /; s/$/}/'
for rep in $(seq "$reps"); do
  for b in 0.25 0.1; do
    for p in off router previous union oracle; do
      "$bin" --threads 2 bench experts --model "$model" --budget "$b" --decode-tokens "$dec" \
        --prefetch "$p" --trace-in "$trace" 2>/dev/null | sed "s/^/{\"rep\": $rep, \"r\": /; s/\$/}/"
    done
  done
done
rm -f "$trace"
