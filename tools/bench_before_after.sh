#!/usr/bin/env bash
# Two osprey builds side by side in one run (a refactor must not be slower): `bench forward` on a text
# checkpoint (prefill + decode) and the multi-turn image conversation TTFT (tools/bench_prefix.py, prefix
# cache on), the two binaries interleaved REPEATS times.
# Usage: tools/bench_before_after.sh BIN_BEFORE BIN_AFTER TEXT_MODEL VISION_MODEL [REPEATS] [TURNS]
set -euo pipefail
before=$1; after=$2; text=$3; vision=$4; reps=${5:-3}; turns=${6:-8}
. "$(dirname "$0")/bench_lib.sh"
machine_header
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
    echo "## ttft $which rep $r"
    ttft_run "$bin" "$vision" 18766 "$turns"
  done
done
