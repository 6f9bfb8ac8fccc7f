#!/usr/bin/env bash
# Long image conversations on the speed checkpoint, and the same conversation as text against
# llama-server, in one run (issue 53).
#
#   tools/bench_long_images.sh OSPREY_BIN VISION_DIR OUT_DIR [CONTEXTS] [TEXT_DIR GGUF TEXT_CONTEXT]
#
# VISION_DIR is `osprey bench synth --layers 4 --vision-layers 3 --context 262144` (docs/bench.md).
# For each context C (default "8000 32000 64000") a fresh osprey serves VISION_DIR with a KV pool
# of C + 4096 tokens (and 512 media items a request) and `bench serve --scenario long-images --context-tokens C` runs against it;
# the server stops between runs, so no run starts with another's cache. With TEXT_DIR (BENCHMARKS.md's
# q35moe-L4 quantized with `osprey quantize --all-linear --lm-head`) and GGUF (its Q4_0), the
# conversation runs as text (`--text-only`) to TEXT_CONTEXT tokens against osprey serving TEXT_DIR and
# llama-server serving GGUF (one slot, its prompt cache on), 2 threads each.
set -euo pipefail
osprey=$1; vision=$2; out=$3; contexts=${4:-8000 32000 64000}; text=${5:-}; gguf=${6:-}; text_ctx=${7:-32000}
peer_bin=${PEER_BIN:-$HOME/.cache/osprey/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
port=${PORT:-18300}
mkdir -p "$out"
stem=$(date -u +%Y-%m-%d)
. "$(dirname "$0")/bench_lib.sh"
run() { # NAME ARGS...: bench serve against the server on $port
  local name=$1; shift
  "$osprey" bench serve --url "http://127.0.0.1:$port" --scenario long-images --requests 1000 --max-tokens 16 \
    --out "$out/$stem-$name.json" "$@"
}
for c in $contexts; do
  # 512 media items: a conversation of 512x384 images reaches 64k tokens at ~290 (the default 256
  # stopped the 2026-12-07 run at 58,099 tokens).
  "$osprey" --threads 2 serve --model "$vision" --port "$port" --context-len $((c + 4096)) \
    --kv-capacity-tokens $((c + 4096)) --max-media-per-request 512 > "$out/$stem-long-images-$c.log" 2>&1 &
  pid=$!
  wait_up
  run "long-images-$c" --context-tokens "$c" --disk-dir "$vision" || true
  stop $pid
done
if [ -n "$text" ]; then
  "$osprey" --threads 2 serve --model "$text" --port "$port" --context-len $((text_ctx + 4096)) \
    --kv-capacity-tokens $((text_ctx + 4096)) > "$out/$stem-long-text-osprey.log" 2>&1 &
  pid=$!
  wait_up
  run "long-text-osprey-$text_ctx" --context-tokens "$text_ctx" --text-only || true
  stop $pid
  "$peer_bin/llama-server" -m "$gguf" -t 2 -np 1 -c $((text_ctx + 4096)) --port "$port" \
    > "$out/$stem-long-text-llama.log" 2>&1 &
  pid=$!
  wait_up
  run "long-text-llama-$text_ctx" --context-tokens "$text_ctx" --text-only || true
  stop $pid
fi
