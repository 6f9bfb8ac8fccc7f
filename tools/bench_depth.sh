#!/usr/bin/env bash
# Decode and prefill at a context depth, osprey against llama.cpp in one run (issue 53, item 4).
#
#   tools/bench_depth.sh OSPREY_BIN HF_NVFP4_DIR GGUF [DEPTHS]
#
# HF_NVFP4_DIR is `osprey quantize --all-linear --lm-head` of BENCHMARKS.md's q35moe-L4; GGUF is the
# peer's Q4_0 of the same checkpoint (`../shared/tools/llamacpp_peer.sh convert`). For each depth D
# (default "1000 30000"): osprey prefills a D-token prompt in one chunk and decodes 32 tokens
# (`bench forward`, one warm-up and one measured run); llama-bench runs pp D (a D-token prompt) and
# tg 32 after a D-token context (`-d D`), 2 threads each. One JSON line per measurement.
set -euo pipefail
osprey=$1; nvfp4=$2; gguf=$3; depths=${4:-1000 30000}
peer_bin=${PEER_BIN:-$HOME/.cache/osprey/llamacpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin}
flags=$(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512_vnni|avx512_bf16|avx_vnni|amx_tile)$' | tr '\n' ' ')
printf '{"machine":"%s (%s cores)","flags":"%s","command":"tools/bench_depth.sh %s"}\n' \
  "$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)" "$(nproc)" "${flags% }" "$*"
"$osprey" --threads 2 bench membw 2>/dev/null
for d in $depths; do
  printf '{"engine":"osprey nvfp4","depth":%s,"result":' "$d"
  "$osprey" --threads 2 bench forward --model "$nvfp4" --prompt-len "$d" --decode-tokens 32 --repeats 1 2>/dev/null | tr -d '\n '
  echo "}"
  "$peer_bin/llama-bench" -m "$gguf" -t 2 -r 1 -o jsonl -p "$d" -n 0 | sed "s/^/{\"engine\":\"llama.cpp q4_0\",\"depth\":$d,\"result\":/; s/\$/}/"
  "$peer_bin/llama-bench" -m "$gguf" -t 2 -r 1 -o jsonl -p 0 -n 32 -d "$d" | sed "s/^/{\"engine\":\"llama.cpp q4_0\",\"depth\":$d,\"result\":/; s/\$/}/"
done
