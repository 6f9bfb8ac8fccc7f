# Pieces the bench scripts share (source it: `. "$(dirname "$0")/bench_lib.sh"`).
bench_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
bench_venv=${VENV:-$HOME/.cache/osprey/venv}

# Builds the release binary of this checkout (reusing $CARGO_TARGET_DIR, default ~/.cache/osprey/target)
# and sets $bin to it.
build_release() {
  export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}
  cargo build --release --quiet --manifest-path "$bench_here/../Cargo.toml"
  bin="$CARGO_TARGET_DIR/release/osprey"
}

# The machine, as every recorded run names it: date, cores, CPU model and the SIMD flags that matter.
machine_header() {
  echo "# $(date -u '+%F %H:%M') $(nproc) cores; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)"
  echo "# flags: $(grep -m1 '^flags' /proc/cpuinfo | tr ' ' '\n' | grep -E '^(avx2|fma|f16c|avx512f|avx512bw|avx512vl|avx512_vnni|avx512_bf16|avx_vnni|amx_tile|amx_bf16|amx_int8)$' | tr '\n' ' ')"
}

# ttft_run BIN MODEL PORT TURNS [SERVE FLAGS...]: serves MODEL with BIN on PORT, runs the multi-turn
# image conversation (bench_prefix.py, one JSON line per turn), stops the server.
ttft_run() {
  local bin=$1 model=$2 port=$3 turns=$4
  shift 4
  "$bin" --threads 2 serve --model "$model" --port "$port" --context-len 16384 "$@" >"/tmp/osprey-bench-$port.log" 2>&1 &
  local pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; sleep 0.2; done
  "$bench_venv/bin/python" "$bench_here/bench_prefix.py" --base "http://127.0.0.1:$port" --turns "$turns"
  kill "$pid"; wait "$pid" 2>/dev/null || true
}

# wait_up / stop: a server on $port answering /health (up to 10 minutes), and a server stopped.
wait_up() {
  for _ in $(seq 1 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null 2>&1 && return 0
    sleep 1
  done
  echo "server on $port did not start" >&2; return 1
}
stop() { kill "$1" 2>/dev/null || true; wait "$1" 2>/dev/null || true; }
