#!/usr/bin/env bash
# Runs on the GPU machine, from the repository root, over the kit that tools/gpu/build.sh made
# (docs/gpu_kit.md). Fixed order, a deadline per step, 8 minutes at most in all:
#   1 device    nvidia-smi: the GPU, its driver and CUDA versions
#   2 libs      where libcuda (and libnvrtc, not needed) are (ldconfig, the usual folders); sets LD_LIBRARY_PATH
#   3 unpack    the kit's files, checked against MANIFEST.json
#   4 tests     every GPU test binary of the kit with OSPREY_CUDA_TEST_DEVICE=cuda:0 (the tests CI runs on
#               the emulated device, on the card), then one under compute-sanitizer memcheck when present
#               (without a driver: on the emulated device, so that the step itself is proven here)
#   5 serve     `osprey serve --device cuda:0` answering the README's image request (when cuda:0 cannot be
#               opened: its error, then the same request on the CPU, so that the step itself is proven)
#   6 bench     `osprey bench membw`; with a GPU, `bench forward` of the q35moe-L4 geometry on cuda:0 and on
#               the CPU in the same run (decode tok/s of each in the note)
# Everything goes to $OUT (at most 8 files come back): steps.log (every step's output), serve.log,
# answer.json and summary.json (each step's status, seconds and exit code; rewritten after every step,
# so a run stopped at its limit still says how far it got).
#
#   OUT=/tmp/gpu-out bash tools/gpu/run.sh     # here, without a GPU: proves the kit itself
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:?set OUT to the folder that comes back}"
KIT="${KIT:-.gpu-kit}"
BIN="${BIN_DIR:-/tmp/osprey-kit}"
PORT="${PORT:-18080}"
mkdir -p "$OUT" "$BIN"
LOG="$OUT/steps.log"
: >"$LOG"
T0=$(date +%s)
BUDGET="${BUDGET:-480}"
STEPS=()

summary() {
  python3 - "$OUT/summary.json" "$T0" "${STEPS[@]}" <<'EOF'
import json, sys, time
path, t0, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
out = {"seconds": int(time.time()) - t0, "steps": []}
for s in steps:
    name, status, secs, rc, note = s.split("|", 4)
    out["steps"].append({"step": name, "status": status, "seconds": int(secs), "rc": int(rc), "note": note})
json.dump(out, open(path, "w"), indent=2)
EOF
}

# step NAME DEADLINE_S FUNCTION: runs FUNCTION under a deadline (never past the run's budget); its output goes
# to steps.log. FUNCTION may print "NOTE: ..." (kept in the summary) and returns 0 (ok), 3 (skipped) or 4
# (an expected error, e.g. no CUDA backend in this build); anything else is a failure.
step() {
  local name=$1 limit=$2 fn=$3 left start rc status note
  left=$((BUDGET - ($(date +%s) - T0)))
  [ "$limit" -gt "$left" ] && limit=$left
  start=$(date +%s)
  echo "===== $name (deadline ${limit}s)" >>"$LOG"
  if [ "$limit" -le 0 ]; then
    rc=124
  else
    timeout --kill-after=5 "$limit" bash -c "$fn" >>"$LOG" 2>&1
    rc=$?
  fi
  case $rc in 0) status=ok ;; 3) status=skipped ;; 4) status=expected-error ;; 124 | 137) status=timeout ;; *) status=failed ;; esac
  note=$(sed -n "/^===== $name /,\$p" "$LOG" | grep '^NOTE: ' | tail -1 | cut -c7- | tr '|' '/')
  STEPS+=("$name|$status|$(($(date +%s) - start))|$rc|$note")
  echo "== $name: $status ($(($(date +%s) - start)) s)"
  summary
}

device() {
  if ! command -v nvidia-smi >/dev/null; then
    echo "NOTE: no nvidia-smi: no NVIDIA driver on this machine"
    return 3
  fi
  nvidia-smi
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
  echo "NOTE: $(nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader | head -1), $(nvidia-smi | grep -o 'CUDA Version: [0-9.]*')"
}

# Prints the folders that hold libcuda and libnvrtc (ldconfig first, then the usual places).
find_lib_dirs() {
  local dirs=()
  for lib in libcuda.so libnvrtc.so libcublas.so; do
    while read -r path; do dirs+=("$(dirname "$path")"); done < <(ldconfig -p 2>/dev/null | grep -o "/.*/$lib[.0-9]*" | head -2)
    for d in /usr/local/nvidia/lib64 /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib \
      /usr/lib/x86_64-linux-gnu /usr/lib64 /usr/local/lib/python3*/dist-packages/nvidia/*/lib \
      /usr/local/lib/python3*/site-packages/nvidia/*/lib /usr/local/lib/python3*/dist-packages/nvidia/cu*/lib; do
      compgen -G "$d/$lib*" >/dev/null 2>&1 && dirs+=("$d")
    done
  done
  printf '%s\n' "${dirs[@]}" | awk 'NF && !seen[$0]++' | paste -sd:
}

libs() {
  ldconfig -p 2>/dev/null | grep -E 'libcuda\.so|libnvrtc|libcublas' || echo "ldconfig knows no CUDA library"
  local found
  found=$(find_lib_dirs)
  echo "library folders: ${found:-none}"
  # Only the driver is required: the kit's binaries embed every kernel's cubins and PTX (build.sh builds
  # them with NVRTC; crates/backend-cuda/build.rs). NVRTC, when present, is only reported.
  if ! tr ':' '\n' <<<"$found" | while read -r d; do compgen -G "$d/libcuda.so*"; done | grep -q .; then
    echo "NOTE: libcuda.so not found"
    return 3
  fi
  if tr ':' '\n' <<<"$found" | while read -r d; do compgen -G "$d/libnvrtc.so*"; done | grep -q .; then
    echo "NOTE: libcuda and libnvrtc in $found (NVRTC not needed: kernel images are embedded)"
  else
    echo "NOTE: libcuda in $found; no libnvrtc, none needed (kernel images are embedded)"
  fi
}

unpack() {
  [ -f "$KIT/MANIFEST.json" ] || { echo "no kit at $KIT: run tools/gpu/build.sh here and carry .gpu-kit"; return 1; }
  python3 - "$KIT" "$BIN" <<'EOF'
import gzip, hashlib, json, os, shutil, sys
kit, bin_dir = sys.argv[1], sys.argv[2]
m = json.load(open(os.path.join(kit, "MANIFEST.json")))
print("kit of commit", m["commit"], "(with uncommitted changes)" if m["dirty"] else "", m["rustc"])
for rel, f in m["files"].items():
    data = open(os.path.join(kit, rel), "rb").read()
    assert hashlib.sha256(data).hexdigest() == f["sha256"], f"{rel}: sha256 differs from the manifest"
    dst = os.path.join(bin_dir, rel[:-3] if rel.endswith(".gz") else rel)
    os.makedirs(os.path.dirname(dst), exist_ok=True)
    with open(dst, "wb") as o:
        o.write(gzip.decompress(data) if rel.endswith(".gz") else data)
    os.chmod(dst, 0o755)
    print("unpacked", rel, "->", dst, os.path.getsize(dst), "bytes")
EOF
  "$BIN/osprey" --version
  echo "NOTE: $("$BIN/osprey" --version)"
}

tests() {
  local n=0 failed=0 filter device=cuda-emu
  compgen -G "/dev/nvidia*" >/dev/null && command -v nvidia-smi >/dev/null && device=cuda:0
  export OSPREY_CUDA_TEST_DEVICE=$device OSPREY_FIXTURES="$PWD/fixtures"
  for t in "$BIN"/tests/*; do
    [ -x "$t" ] && [ "${t%.args}" = "$t" ] || continue
    n=$((n + 1))
    filter=$(cat "$KIT/tests/$(basename "$t").args" 2>/dev/null || true)
    echo "--- $(basename "$t") ${filter:-(all)} on $device"
    # shellcheck disable=SC2086
    "$t" $filter || failed=$((failed + 1))
  done
  if [ "$n" = 0 ]; then
    echo "NOTE: no GPU test binaries in the kit (tools/gpu/tests.txt lists none)"
    return 3
  fi
  local sanitizer=""
  if command -v compute-sanitizer >/dev/null && [ -x "$BIN/tests/cuda" ]; then
    echo "--- compute-sanitizer memcheck: tests/cuda sequence"
    if compute-sanitizer --tool memcheck --error-exitcode 9 "$BIN/tests/cuda" sequence; then
      sanitizer=", memcheck clean"
    else
      failed=$((failed + 1)) sanitizer=", memcheck FAILED"
    fi
  fi
  echo "NOTE: $n binaries on $device, $failed failed$sanitizer"
  [ "$failed" = 0 ]
}

# Serves the default model on DEVICE and asks the README's image question; the answer goes to answer.json.
ask() {
  local device=$1 pid body
  "$BIN/osprey" serve --device "$device" --model fixtures/models/osprey-default --port "$PORT" \
    >"$OUT/serve.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || { wait "$pid"; return $?; }
    sleep 0.1
  done
  body=$(python3 - <<'EOF'
import base64, json
img = base64.b64encode(open("fixtures/media/default/red_circle_img0.png", "rb").read()).decode()
print(json.dumps({"messages": [{"role": "user", "content": [
    {"type": "image_url", "image_url": {"url": "data:image/png;base64," + img}},
    {"type": "text", "text": "What is in the image?"}]}], "max_tokens": 16, "temperature": 0}))
EOF
)
  curl -sS "http://127.0.0.1:$PORT/v1/chat/completions" -H 'content-type: application/json' -d "$body" \
    -o "$OUT/answer.json"
  local rc=$?
  kill "$pid" 2>/dev/null
  wait "$pid" 2>/dev/null
  cat "$OUT/answer.json"
  echo
  [ $rc = 0 ] && grep -q '"a red circle"' "$OUT/answer.json"
}

serve() {
  if ask cuda:0; then
    echo "NOTE: cuda:0 answered: $(grep -o '"content": *"[^"]*"' "$OUT/answer.json" | head -1)"
    return 0
  fi
  mv "$OUT/serve.log" "$OUT/serve-cuda.log"
  echo "cuda:0: $(grep -m1 -io 'error.*' "$OUT/serve-cuda.log" | cut -c1-300)"
  if ask cpu; then
    echo "NOTE: cuda:0 did not answer (serve-cuda.log); the same request on the CPU answered 'a red circle'"
    return 4
  fi
  echo "NOTE: the image request failed (serve.log)"
  return 1
}

bench() {
  "$BIN/osprey" bench membw --mib 1024
  local note="host $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs); membw $("$BIN/osprey" bench membw --mib 1024)"
  if compgen -G "/dev/nvidia*" >/dev/null; then
    # The CUDA issue's benchmark: BENCHMARKS.md's q35moe-L4 geometry, one prefill of 512 and 32 decode
    # steps, on the card and on this machine's CPU in the same run.
    "$BIN/osprey" bench synth --geometry qwen3.5-35b-a3b --layers 4 --out /tmp/synth-l4 >/dev/null || return 1
    local dev rate
    for dev in cuda:0 cpu; do
      echo "--- bench forward on $dev"
      "$BIN/osprey" --device "$dev" bench forward --model /tmp/synth-l4 --prompt-len 512 --decode-tokens 32 \
        --repeats 1 | tee "/tmp/forward-$dev.json" || return 1
      rate=$(python3 -c 'import json,sys; r=json.load(open(sys.argv[1])); print(r.get("decode_tok_s", r))' "/tmp/forward-$dev.json")
      note="$note; q35moe-L4 decode on $dev: $rate tok/s"
    done
  fi
  echo "NOTE: $note"
}

export -f device find_lib_dirs libs unpack tests ask serve bench
export BIN KIT OUT PORT LD_LIBRARY_PATH
LD_LIBRARY_PATH="$(find_lib_dirs)${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
step device 20 device
step libs 20 libs
step unpack 30 unpack
step tests 180 tests
step serve 90 serve
step bench 120 bench
echo "== $(($(date +%s) - T0)) s; $OUT: $(ls "$OUT" | paste -sd' ')"
