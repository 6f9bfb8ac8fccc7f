#!/usr/bin/env bash
# Expert streaming benchmark: fio's O_DIRECT random-read bandwidth on the checkpoint, then decode with the
# experts under RAM budgets of 100/50/25/10% (one process per budget, so each peak RSS is that budget's).
# Usage: tools/bench_experts.sh NVFP4_MODEL_DIR [DECODE_TOKENS]
set -euo pipefail
model=$1; dec=${2:-32}
here=$(cd "$(dirname "$0")" && pwd)
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}
cargo build --release --quiet --manifest-path "$here/../Cargo.toml"
bin="$CARGO_TARGET_DIR/release/osprey"
file=$(ls "$model"/*.safetensors | head -1)
echo "# $(date -u +%F) $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
echo "## fio: O_DIRECT random 512 KiB reads, io_uring, depth 16, on $file"
fio --name=experts --filename="$file" --rw=randread --bs=512k --direct=1 --ioengine=io_uring --iodepth=16 \
    --runtime=10 --time_based --readonly --output-format=json 2>/dev/null \
  | python3 -c 'import json,sys; j=json.load(sys.stdin)["jobs"][0]["read"]; print(json.dumps({"fio_read_gb_s": round(j["bw_bytes"]/1e9, 3), "iops": round(j["iops"])}))'
echo "## osprey bench experts"
"$bin" --threads 2 bench membw 2>/dev/null
for b in 1.0 0.5 0.25 0.1; do
  "$bin" --threads 2 bench experts --model "$model" --budget "$b" --decode-tokens "$dec" 2>/dev/null
done
