#!/usr/bin/env bash
# Multi-turn image conversation TTFT with and without the prefix cache, one server after the other.
# Usage: tools/bench_prefix.sh MODEL_DIR [TURNS]
set -euo pipefail
model=$1; turns=${2:-8}
venv=${VENV:-$HOME/.cache/osprey/venv}
here=$(cd "$(dirname "$0")" && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}
cargo build --release --quiet --manifest-path "$here/../Cargo.toml"
bin="$CARGO_TARGET_DIR/release/osprey"
echo "# $(date -u +%F) $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
for mode in cache no-cache; do
  flag=""; [ "$mode" = no-cache ] && flag="--disable-prefix-cache"
  "$bin" --threads 2 serve --model "$model" --port 18765 --context-len 16384 $flag >/tmp/osprey-bench-prefix.log 2>&1 &
  pid=$!
  for _ in $(seq 100); do curl -sf http://127.0.0.1:18765/health >/dev/null && break; sleep 0.2; done
  echo "## $mode"
  "$venv/bin/python" "$here/bench_prefix.py" --base http://127.0.0.1:18765 --turns "$turns"
  kill $pid; wait $pid 2>/dev/null || true
done
