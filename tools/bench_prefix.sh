#!/usr/bin/env bash
# Multi-turn image conversation TTFT with and without the prefix cache, one server after the other.
# Usage: tools/bench_prefix.sh MODEL_DIR [TURNS]
set -euo pipefail
model=$1; turns=${2:-8}
here=$(cd "$(dirname "$0")" && pwd)
. "$here/bench_lib.sh"
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}
cargo build --release --quiet --manifest-path "$here/../Cargo.toml"
bin="$CARGO_TARGET_DIR/release/osprey"
machine_header
echo "## cache"
ttft_run "$bin" "$model" 18765 "$turns"
echo "## no-cache"
ttft_run "$bin" "$model" 18765 "$turns" --disable-prefix-cache
