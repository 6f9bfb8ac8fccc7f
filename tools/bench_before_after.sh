#!/usr/bin/env bash
# Two osprey builds side by side in one run (a refactor must not be slower): `bench forward` on a text
# checkpoint (prefill + decode) and the multi-turn image conversation TTFT (tools/bench_prefix.py, prefix
# cache on), the two binaries interleaved REPEATS times.
# Usage: tools/bench_before_after.sh BIN_BEFORE BIN_AFTER TEXT_MODEL VISION_MODEL [REPEATS] [TURNS]
set -euo pipefail
before=$1; after=$2; text=$3; vision=$4; reps=${5:-3}; turns=${6:-8}
venv=${VENV:-$HOME/.cache/osprey/venv}
here=$(cd "$(dirname "$0")" && pwd)
echo "# $(date -u '+%F %H:%M') $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "# flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx_vnni)$' | tr '\n' ' ')"
"$after" --threads 2 bench membw 2>/dev/null
for r in $(seq "$reps"); do
  for which in before after; do
    bin=$before; [ "$which" = after ] && bin=$after
    echo "## forward $which rep $r"
    "$bin" --threads 2 bench forward --model "$text" --prompt-len 512 --decode-tokens 32 --repeats 1 2>/dev/null | tr -d '\n '; echo
  done
done
for r in $(seq "$reps"); do
  for which in before after; do
    bin=$before; [ "$which" = after ] && bin=$after
    "$bin" --threads 2 serve --model "$vision" --port 18766 --context-len 16384 >/tmp/osprey-bench-ba.log 2>&1 &
    pid=$!
    for _ in $(seq 300); do curl -sf http://127.0.0.1:18766/health >/dev/null && break; sleep 0.2; done
    echo "## ttft $which rep $r"
    "$venv/bin/python" "$here/bench_prefix.py" --base http://127.0.0.1:18766 --turns "$turns"
    kill $pid; wait $pid 2>/dev/null || true
  done
done
