#!/usr/bin/env bash
# Read-ahead on by default (issue 55): decode of an NVFP4 MoE checkpoint with its experts streamed from
# disk at RAM budgets of 100%, 50%, 25% and 10%, without read-ahead (off), with the default policy (as
# `serve` runs it: router, margin 2, depth 1) and with the oracle (the next two layers' true experts from
# a trace of the same prompt: the pipeline's ceiling), interleaved over REPS repetitions. Each sweep
# measures the disk first (`bench experts --budgets`). One JSON line per run on stdout:
# {"rep", "config", "disk_gb_s", "r": report}. Summarise with tools/bench_readahead_summary.py.
# CONFIGS (name:policy:margin:depth ...) and BUDGETS (comma-separated) override the defaults, e.g.
# CONFIGS="off:off:0:1 wrong-unscored:wrong-unscored:0:1 wrong:wrong:0:1" BUDGETS=0.25 for what a wrong
# guess costs.
# Usage: tools/bench_readahead.sh NVFP4_MODEL_DIR [REPS] [DECODE_TOKENS] > runs.jsonl
set -euo pipefail
model=$1; reps=${2:-5}; dec=${3:-32}
. "$(dirname "$0")/bench_lib.sh"
build_release
trace=$(mktemp --suffix .json)
machine_header
"$bin" --threads 2 bench experts --model "$model" --budget 1.0 --warmup --decode-tokens "$dec" \
  --trace-out "$trace" 2>/dev/null | sed 's/^/{"config": "resident", "r": /; s/$/}/'
# config:policy:margin:depth
for rep in $(seq "$reps"); do
  for c in ${CONFIGS:-off:off:0:1 default:router:2:1 oracle:oracle:0:2}; do
    IFS=: read -r name p m d <<<"$c"
    out=$(mktemp --suffix .json)
    "$bin" --threads 2 bench experts --model "$model" --budgets "${BUDGETS:-1.0,0.5,0.25,0.1}" --decode-tokens "$dec" \
      --prefetch "$p" --prefetch-margin "$m" --prefetch-depth "$d" --trace-in "$trace" --out "$out" >/dev/null 2>&1
    python3 - "$out" "$rep" "$name" <<'PY'
import json, sys
path, rep, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
doc = json.load(open(path))
disk = doc.get("disk_read_gb_s") or doc.get("disk_gb_s") or doc.get("disk")
for r in doc["runs"]:
    print(json.dumps({"rep": rep, "config": name, "disk_gb_s": disk, "r": r}))
PY
    rm -f "$out"
  done
done
rm -f "$trace"
