#!/usr/bin/env bash
# osprey against llama.cpp on the same checkpoint, interleaved in one run, with the ratios.
#
#   tools/bench_peer.sh OSPREY_BIN HF_BF16_DIR HF_NVFP4_DIR GGUF_PREFIX [REPEATS]
#
# HF_BF16_DIR is BENCHMARKS.md's q35moe-L4; HF_NVFP4_DIR is `osprey quantize --all-linear` of it;
# GGUF_PREFIX is what `../shared/tools/llamacpp_peer.sh convert HF_BF16_DIR PREFIX` wrote
# (PREFIX-bf16.gguf, PREFIX-q4_0.gguf, PREFIX-nvfp4.gguf). Every engine runs 2 threads, 512-token
# prefill and 32 decode tokens ("osprey nvfp4 bf16-gemm" is `--gemm bf16`: NVFP4 prefill on the bf16 tiles,
# the kernel before the int8 GEMM); each repetition runs every engine once, in turn, so drift in the
# machine's speed hits all of them alike. Prints JSON lines, then a table of medians and ratios.
set -euo pipefail
osprey=$1; bf16=$2; nvfp4=$3; gguf=$4; reps=${5:-3}
peer=${PEER:-$(dirname "$0")/../../shared/tools/llamacpp_peer.sh}
log=$(mktemp)
. "$(dirname "$0")/bench_lib.sh"
machine_header
"$osprey" --threads 2 bench membw 2>/dev/null | tee -a "$log"
for r in $(seq "$reps"); do
  for run in "osprey bf16|$bf16|int8|auto" "osprey nvfp4|$nvfp4|int8|auto" "osprey nvfp4 bf16-gemm|$nvfp4|int8|bf16" \
             "osprey nvfp4 f32-act|$nvfp4|f32|auto"; do
    IFS='|' read -r name dir act gemm <<<"$run"
    printf '{"engine":"%s","rep":%s,"result":' "$name" "$r" | tee -a "$log"
    "$osprey" --threads 2 --activations "$act" --gemm "$gemm" bench forward --model "$dir" --prompt-len 512 --decode-tokens 32 \
      --repeats 1 2>/dev/null | tr -d '\n ' | tee -a "$log"
    echo "}" | tee -a "$log"
  done
  for fmt in bf16 q4_0 nvfp4; do
    bash "$peer" bench "$gguf-$fmt.gguf" 2>/dev/null \
      | sed "s/^/{\"engine\":\"llama.cpp $fmt\",\"rep\":$r,\"result\":/; s/\$/}/" | tee -a "$log"
  done
done
python3 - "$log" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"engine"')]
pp, tg = {}, {}
for r in rows:
    e, x = r["engine"], r["result"]
    if "prefill_tok_s" in x:
        pp.setdefault(e, []).append(x["prefill_tok_s"]); tg.setdefault(e, []).append(x["decode_tok_s"])
    elif x.get("n_prompt", 0) > 0:
        pp.setdefault(e, []).append(x["avg_ts"])
    elif x.get("n_gen", 0) > 0:
        tg.setdefault(e, []).append(x["avg_ts"])
med = lambda d, e: statistics.median(d[e]) if d.get(e) else float("nan")
print("\n| engine / format | prefill tok/s (median) | decode tok/s (median) |\n| --- | --- | --- |")
for e in sorted(set(pp) | set(tg)):
    print(f"| {e} | {med(pp, e):.1f} | {med(tg, e):.1f} |")
print("\n| ratio | prefill | decode |\n| --- | --- | --- |")
for a, b in [("osprey nvfp4", "llama.cpp nvfp4"), ("osprey nvfp4", "llama.cpp q4_0"), ("osprey bf16", "llama.cpp bf16"),
             ("osprey nvfp4", "osprey nvfp4 bf16-gemm"), ("osprey nvfp4", "osprey nvfp4 f32-act")]:
    print(f"| {a} / {b} | {med(pp, a) / med(pp, b):.2f} | {med(tg, a) / med(tg, b):.2f} |")
PY
rm -f "$log"
