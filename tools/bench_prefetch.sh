#!/usr/bin/env bash
# Read-ahead benchmark (issue 36): decode of an NVFP4 MoE checkpoint with its experts streamed from disk,
# at RAM budgets of 25% and 10%, without read-ahead and with each policy (and depth), interleaved over
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
# policy:margin:depth (depth 2: each layer also guesses the layer after next).
for rep in $(seq "$reps"); do
  for b in 0.25 0.1; do
    for c in off:0:1 router:0:1 router:0:2 router:2:1 union:2:1 oracle:0:1 oracle:0:2; do
      IFS=: read -r p m d <<<"$c"
      "$bin" --threads 2 bench experts --model "$model" --budget "$b" --decode-tokens "$dec" \
        --prefetch "$p" --prefetch-margin "$m" --prefetch-depth "$d" --trace-in "$trace" 2>/dev/null |
        sed "s/^/{\"rep\": $rep, \"depth\": $d, \"r\": /; s/\$/}/"
    done
  done
done
rm -f "$trace"
