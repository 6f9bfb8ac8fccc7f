#!/usr/bin/env bash
# Side-by-side forward benchmark: osprey vs transformers (f32 and bf16) on one checkpoint, 2 threads each,
# run one after the other in one invocation so the ratios share the machine's state.
# Usage: tools/bench_forward.sh MODEL_DIR [PROMPT_LEN] [DECODE_TOKENS]
set -euo pipefail
model=$1; plen=${2:-512}; dec=${3:-32}
venv=${VENV:-$HOME/.cache/osprey/venv}
here=$(cd "$(dirname "$0")" && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}
cargo build --release --quiet --manifest-path "$here/../Cargo.toml"
echo "# $(date -u +%F) $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
"$CARGO_TARGET_DIR/release/osprey" --threads 2 bench membw 2>/dev/null
"$CARGO_TARGET_DIR/release/osprey" --threads 2 bench forward --model "$model" --prompt-len "$plen" --decode-tokens "$dec" --repeats 3 2>/dev/null
for dt in float32 bfloat16; do
  OMP_NUM_THREADS=2 "$venv/bin/python" "$here/bench_transformers.py" --model "$model" --dtype $dt \
    --prompt-len "$plen" --decode-tokens "$dec" --repeats 2 --threads 2 2>/dev/null
done
