#!/usr/bin/env bash
# Coverage-guided fuzzing of the input-facing code (crates/fuzz) with libFuzzer, on the pinned stable
# toolchain: cargo-fuzz's instrumentation flags without its nightly-only sanitizers.
#
#   tools/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]
#
# CI runs 20 s per target (.ci/run); a real session is e.g. `tools/fuzz.sh 1800`. New inputs that add
# coverage go to fuzz/corpus/<target>/ (commit the interesting ones); a crash is written to
# fuzz/artifacts/<target>/ and the script fails. Reproduce one with `fuzz-bin/<target> <file>`, fix the
# bug, and add the file to the corpus so `cargo test` replays it for good.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-20}"
shift || true
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(request media chat_template detokenize tool_calls schema)

export CARGO_TARGET_DIR="${FUZZ_TARGET_DIR:-$HOME/.cache/osprey/fuzz-target}"
export RUSTFLAGS="--cfg fuzzing -Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares -Cdebug-assertions -Coverflow-checks"
# An explicit --target keeps RUSTFLAGS off build scripts and proc macros (they cannot link libFuzzer).
host="$(rustc -vV | sed -n 's/^host: //p')"
cargo build --release --manifest-path fuzz/Cargo.toml --bins --target "$host"
bin="$CARGO_TARGET_DIR/$host/release"

status=0
for t in "${targets[@]}"; do
  mkdir -p "fuzz/artifacts/$t"
  work="$(mktemp -d)"
  # New coverage goes to a scratch folder first (the committed corpus stays a reviewed set); merge with
  # `-merge=1 fuzz/corpus/$t $work` to keep what a long run found.
  echo "== fuzz $t for ${secs}s"
  # FUZZ_SEED fixes libFuzzer's mutation sequence (CI sets it, so a run explores the same inputs each
  # time); unset, each run starts from a fresh random seed.
  if ! "$bin/$t" "$work" "fuzz/corpus/$t" -seed="${FUZZ_SEED:-0}" -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 \
      -max_len=65536 -artifact_prefix="fuzz/artifacts/$t/" -print_final_stats=1 2>"$work.log"; then
    status=1
    tail -40 "$work.log"
  fi
  grep -E "stat::number_of_executed_units|stat::new_units_added|Done [0-9]+ runs" "$work.log" || true
  rm -rf "$work" "$work.log"
done
exit $status
