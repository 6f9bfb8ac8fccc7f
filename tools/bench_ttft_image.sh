#!/usr/bin/env bash
# Time to first token of one 448x448 image plus ~1,000 text tokens (12 filler sentences: 1,203 prompt
# tokens with the tiny test tokenizer, 196 of them the image's) through the whole serving pipeline
# (HTTP, tokenizer, vision actor, prefill; prefix cache off so every request computes everything), for
# several builds or flag sets side by side, interleaved REPEATS times. Prints JSON lines, then medians.
#
#   tools/bench_ttft_image.sh MODEL REPEATS "NAME|BIN|GLOBAL FLAGS" ...
#
# e.g. "after|target/release/osprey|" "int8 off|target/release/osprey|--gemm bf16" "before|/tmp/osprey-old|"
set -euo pipefail
model=$1; reps=$2; shift 2
. "$(dirname "$0")/bench_lib.sh"
machine_header
log=$(mktemp)
port=18767
for r in $(seq "$reps"); do
  for spec in "$@"; do
    IFS='|' read -r name bin flags <<<"$spec"
    # shellcheck disable=SC2086 # the flags are words
    "$bin" --threads 2 $flags serve --model "$model" --port "$port" --context-len 8192 --disable-prefix-cache \
      >"/tmp/osprey-ttft-$port.log" 2>&1 &
    pid=$!
    trap 'kill "$pid" 2>/dev/null || true' EXIT
    for _ in $(seq 600); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
    # A first request warms the weights' pages; the second, with other pixels (so the vision tower runs
    # again instead of hitting the media cache), is measured.
    "$bench_venv/bin/python" "$bench_here/bench_prefix.py" --base "http://127.0.0.1:$port" --turns 1 --filler 12 \
      --image-seed 1 >/dev/null
    "$bench_venv/bin/python" "$bench_here/bench_prefix.py" --base "http://127.0.0.1:$port" --turns 1 --filler 12 \
      --image-seed "$((r + 1))" \
      | sed "s/^/{\"engine\":\"$name\",\"rep\":$r,\"result\":/; s/\$/}/" | tee -a "$log"
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done
python3 - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
by = {}
for r in rows:
    by.setdefault(r["engine"], []).append(r["result"])
print("\n| build | prompt tokens | TTFT s (runs) | median |\n| --- | --- | --- | --- |")
for e, rs in by.items():
    t = [x["ttft_s"] for x in rs]
    print(f"| {e} | {rs[0]['prompt_tokens']} | {', '.join(f'{v:.2f}' for v in t)} | {statistics.median(t):.2f} |")
PY
rm -f "$log"
