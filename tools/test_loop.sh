#!/usr/bin/env bash
# Runs every test binary of the workspace N times, on a busy machine if asked, to find the tests that fail
# only sometimes (issue 33: a suite that passes every time).
#
#   tools/test_loop.sh [-n RUNS] [--busy] [--only REGEX]
#
# Builds the test binaries once (`cargo test --workspace --no-run`), copies them aside (a cargo build beside
# the loop cannot replace them mid-run), then runs each binary RUNS times (default 10) in its package's
# directory, as cargo does. --busy keeps one busy loop per core running beside the tests: the machine is
# saturated the whole time, harsher than a concurrent `cargo build` and the same every run. --only runs the
# binaries whose name matches REGEX. A failed run's log is kept under $LOOP_DIR/failures/. The last line is
# "N passed, M failed" (runs of binaries).
set -euo pipefail
cd "$(dirname "$0")/.."

runs=10 busy=0 only=""
while [ $# -gt 0 ]; do
  case "$1" in
    -n) runs="$2"; shift 2 ;;
    --busy) busy=1; shift ;;
    --only) only="$2"; shift 2 ;;
    *) echo "usage: $0 [-n RUNS] [--busy] [--only REGEX]" >&2; exit 2 ;;
  esac
done

export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}"
LOOP_DIR="${LOOP_DIR:-${TMPDIR:-/tmp}/osprey-test-loop}"
rm -rf "$LOOP_DIR" && mkdir -p "$LOOP_DIR/bin" "$LOOP_DIR/failures"

echo "== building the test binaries once"
cargo test --workspace --no-run --message-format=json 2>/dev/null >"$LOOP_DIR/build.json"
# One line per binary: "<copied path> <package dir> <name>".
python3 - "$LOOP_DIR" "$only" >"$LOOP_DIR/binaries.txt" <<'EOF'
import json, os, re, shutil, sys
loop, only = sys.argv[1], sys.argv[2]
seen = set()
for line in open(os.path.join(loop, "build.json")):
    m = json.loads(line)
    if m.get("reason") != "compiler-artifact" or not m.get("executable") or not m["profile"]["test"]:
        continue
    exe = m["executable"]
    name = os.path.basename(exe)
    if name in seen or (only and not re.search(only, name)):
        continue
    seen.add(name)
    dst = os.path.join(loop, "bin", name)
    shutil.copy2(exe, dst)
    print(dst, os.path.dirname(m["manifest_path"]), name)
EOF
echo "   $(wc -l <"$LOOP_DIR/binaries.txt") binaries, $runs runs each"

pids=()
stop_busy() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; }
trap stop_busy EXIT
if [ "$busy" = 1 ]; then
  for _ in $(seq "$(nproc)"); do (while :; do :; done) & pids+=($!); done
  echo "   beside $(nproc) busy loops"
fi

passed=0 failed=0
for run in $(seq "$runs"); do
  while read -r exe dir name; do
    log="$LOOP_DIR/run.log"
    start=$(date +%s)
    if (cd "$dir" && CARGO_MANIFEST_DIR="$dir" "$exe" >"$log" 2>&1); then
      passed=$((passed + 1))
      echo "run $run $name ok ($(( $(date +%s) - start )) s)"
    else
      failed=$((failed + 1))
      cp "$log" "$LOOP_DIR/failures/$name.run$run.log"
      echo "run $run $name FAILED ($(( $(date +%s) - start )) s): $(grep -E '^test .* FAILED|panicked' "$log" | head -3 | tr '\n' ' ')"
    fi
  done <"$LOOP_DIR/binaries.txt"
done
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
