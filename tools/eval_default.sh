#!/usr/bin/env bash
# Held-out evaluation of the embedded default model through osprey's HTTP API (docs/benchmarks.md):
# transformers' greedy answers, then osprey at the fast default precision (`fast`: int8 / bf16
# activations where the CPU has the kernels), osprey exact (`--activations f32`), osprey NVFP4
# (`osprey quantize`) fully resident, and NVFP4 with 2 experts per layer in RAM (top-k: every token
# evicts and re-reads from disk); then the fast default again with the MTP head drafting K = 1…4 tokens
# per step (answers must be identical; the acceptance rate is printed).
#   PER_TASK=200 tools/eval_default.sh [MODEL_DIR] [OSPREY_BIN] [OUT_DIR]   (prompts per task; default 64)
set -euo pipefail
cd "$(dirname "$0")"
MODEL=$(realpath "${1:-../fixtures/models/osprey-default}")
BIN=$(realpath "${2:-${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}/release/osprey}")
OUT=${3:-/tmp/osprey-default-eval}
PY=${PY:-$HOME/.cache/osprey/venv/bin/python}
PORT=${PORT:-18181}

rm -rf "$OUT" && mkdir -p "$OUT"
"$PY" eval_default.py heldout --model "$MODEL" --out "$OUT/set" --per-task "${PER_TASK:-64}" 2>&1 | grep -v '^\[transformers\]'
"$BIN" quantize --model "$MODEL" --out "$OUT/nvfp4" >"$OUT/quantize.log" 2>&1

serve_and_ask() { # TAG MODEL_DIR [extra serve flags...] -- [extra ask flags...]
  local tag=$1 dir=$2; shift 2
  local serve=() ask=()
  while [[ $# -gt 0 && $1 != -- ]]; do serve+=("$1"); shift; done
  [[ $# -gt 0 ]] && shift && ask=("$@")
  "$BIN" serve --model "$dir" --port "$PORT" "${serve[@]}" >"$OUT/serve-$tag.log" 2>&1 &
  local pid=$!
  for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done
  "$PY" eval_default.py ask --set "$OUT/set" --url "http://127.0.0.1:$PORT" --tag "$tag" "${ask[@]}"
  curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^osprey_expert_(residency|evictions_total|resident_bytes) ' || true
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

serve_and_ask fast "$MODEL"
serve_and_ask exact "$MODEL" --activations f32 -- --same-as fast
serve_and_ask nvfp4 "$OUT/nvfp4"
serve_and_ask nvfp4-2experts "$OUT/nvfp4" --expert-ram-experts 2 -- --same-as nvfp4
for k in 1 2 3 4; do
  serve_and_ask "spec$k" "$MODEL" --speculative-tokens "$k" -- --same-as fast
done
