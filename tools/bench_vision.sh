#!/usr/bin/env bash
# Side-by-side vision encoder benchmark: osprey vs transformers f32 on one checkpoint, 2 threads each.
# Usage: tools/bench_vision.sh MODEL_DIR [SIZES]   (SIZES like 448x448,1024x768)
set -euo pipefail
model=$1; sizes=${2:-448x448,1024x768}
venv=${VENV:-$HOME/.cache/osprey/venv}
here=$(cd "$(dirname "$0")" && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}
cargo build --release --quiet --manifest-path "$here/../Cargo.toml"
echo "# $(date -u +%F) $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
"$CARGO_TARGET_DIR/release/osprey" --threads 2 bench vision --model "$model" --sizes "$sizes" --repeats 3 2>/dev/null
OMP_NUM_THREADS=2 "$venv/bin/python" "$here/bench_vision_transformers.py" --model "$model" --sizes "$sizes" --repeats 3 --threads 2 2>/dev/null
