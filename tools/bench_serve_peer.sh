#!/usr/bin/env bash
# Serving at concurrency, osprey against llama-server on the same checkpoint, interleaved (issue 54
# item 4): `bench serve --scenario text`, REQUESTS requests at CONCURRENCY in flight, max_tokens 64.
#
#   tools/bench_serve_peer.sh OSPREY_BIN HF_NVFP4_DIR GGUF OUT_DIR [REPEATS] [REQUESTS] [CONCURRENCY]
#
# HF_NVFP4_DIR is `osprey quantize --all-linear --lm-head` of BENCHMARKS.md's q35moe-L4, GGUF its Q4_0
# (`../shared/tools/llamacpp_peer.sh convert`). Each repetition starts a fresh osprey (`--threads 2`) and
# a fresh llama-server (`-t 2 -np CONCURRENCY`, one slot per request in flight), in turn, so neither
# starts with the other's caches and drift in the machine's speed hits both alike. Writes
# OUT_DIR/DATE-serve-{osprey,llama}-REP.json (`bench serve --out`) and prints a table of medians.
set -euo pipefail
osprey=$1; model=$2; gguf=$3; out=$4; reps=${5:-3}; requests=${6:-32}; conc=${7:-8}
# PEER_AMX=off: the build `llamacpp_peer.sh` makes without AMX (build-noamx), as the peer runs on AMX machines.
build=build; [ "${PEER_AMX:-on}" = off ] && build=build-noamx
peer_bin=${PEER_BIN:-$HOME/.cache/osprey/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/$build/bin}
port=${PORT:-18310}
mkdir -p "$out"
stem=$(date -u +%Y-%m-%d)
. "$(dirname "$0")/bench_lib.sh"
run() { # NAME: bench serve against the server on $port
  "$osprey" bench serve --url "http://127.0.0.1:$port" --scenario text --requests "$requests" \
    --concurrency "$conc" --max-tokens 64 --out "$out/$stem-serve-$1.json" > /dev/null
}
for r in $(seq "$reps"); do
  "$osprey" --threads 2 serve --model "$model" --port "$port" > "$out/$stem-serve-osprey-$r.log" 2>&1 &
  pid=$!
  wait_up
  run "osprey-$r"
  stop $pid
  "$peer_bin/llama-server" -m "$gguf" -t 2 -np "$conc" -c $((conc * 4096)) --port "$port" \
    > "$out/$stem-serve-llama-$r.log" 2>&1 &
  pid=$!
  wait_up
  run "llama-$r"
  stop $pid
done
python3 - "$out" "$stem" "$reps" <<'PY'
import json, statistics, sys
out, stem, reps = sys.argv[1], sys.argv[2], int(sys.argv[3])
cols = {}
for engine in ("osprey", "llama"):
    for r in range(1, reps + 1):
        rep = json.load(open(f"{out}/{stem}-serve-{engine}-{r}.json"))["report"]
        s, ok = rep["summary"], [x for x in rep["samples"] if x["error"] is None]
        row = {"throughput tok/s": s["throughput_tok_s"], "TTFT p50 s": s["ttft_s"]["p50"],
               "TTFT p90 s": s["ttft_s"]["p90"], "request p50 s": statistics.median(x["total_s"] for x in ok),
               "errors": len(rep["samples"]) - len(ok)}
        for k, v in row.items():
            cols.setdefault(k, {}).setdefault(engine, []).append(v)
print("\n| quantity (median of %d) | osprey | llama-server | osprey / llama |\n| --- | --- | --- | --- |" % reps)
for k, by in cols.items():
    o, l = statistics.median(by["osprey"]), statistics.median(by["llama"])
    print(f"| {k} | {o:.3f} | {l:.3f} | {o / l if l else float('nan'):.2f} |")
PY
