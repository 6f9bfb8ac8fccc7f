#!/usr/bin/env bash
# Builds, on this machine, everything a GPU run needs into one ignored folder, .gpu-kit/ (docs/gpu_kit.md):
#   osprey.gz         the release binary with the `cuda` feature, stripped and gzipped
#   tests/*.gz        the GPU test binaries (`cargo test --release --no-run` of the targets in
#                     tools/gpu/tests.txt), stripped and gzipped, each with its test filter (*.args)
#   MANIFEST.json     commit, toolchain, features, and every file's size and sha256 (run.sh checks them)
# and prints the kit's size beside the tracked tree's: what travels to the GPU machine must fit in 64 MiB.
#
#   tools/gpu/build.sh            # then: device run, carry [".gpu-kit"], command "bash tools/gpu/run.sh"
set -euo pipefail
cd "$(dirname "$0")/../.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}"
KIT=.gpu-kit
LIMIT=$((64 * 1024 * 1024))

features="" test_features=""
if grep -qE '^cuda *=' Cargo.toml; then features="--features cuda" test_features="--features osprey-backend-cuda/cuda"; fi

# NVRTC at build time embeds every kernel's cubins (each target card) and PTX in the binaries
# (crates/backend-cuda/build.rs), so the GPU machine needs only its driver.
NVRTC_LIB="$(ls -d "$HOME"/.cache/osprey/nvrtc-venv/lib/python3*/site-packages/nvidia/cu13/lib 2>/dev/null | head -1 || true)"
if [ -n "$NVRTC_LIB" ]; then
  export LD_LIBRARY_PATH="$NVRTC_LIB${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export OSPREY_REQUIRE_NVRTC=1
else
  echo "WARNING: no NVRTC (pip install nvidia-cuda-nvrtc==13.0.88 into ~/.cache/osprey/nvrtc-venv): the kit embeds no kernel image and needs libnvrtc on the GPU machine" >&2
fi
echo "== cargo build --release $features"
# shellcheck disable=SC2086
cargo build --release --bin osprey $features
rm -rf "$KIT" && mkdir -p "$KIT/tests"
strip -o "$KIT/osprey" "$CARGO_TARGET_DIR/release/osprey"
gzip -9 "$KIT/osprey"

# GPU test targets, one `<package> <test target> [filter]` a line; the filter is kept beside the binary.
tests=()
while read -r pkg target filter; do
  [ -n "${pkg:-}" ] && [ "${pkg#\#}" = "$pkg" ] && tests+=("$pkg $target ${filter:-}")
done < <(cat tools/gpu/tests.txt 2>/dev/null || true)
for t in "${tests[@]}"; do
  read -r pkg target filter <<<"$t"
  printf '%s\n' "${filter:-}" >"$KIT/tests/$target.args"
  echo "== cargo test --release -p $pkg --test $target --no-run $test_features"
  # shellcheck disable=SC2086
  exe=$(cargo test --release -p "$pkg" --test "$target" --no-run $test_features --message-format=json 2>/dev/null |
    python3 -c 'import json,sys; print([m["executable"] for m in map(json.loads, sys.stdin) if m.get("executable")][-1])')
  strip -o "$KIT/tests/$target" "$exe"
  gzip -9 "$KIT/tests/$target"
done

python3 - "$KIT" "$features" <<'EOF'
import hashlib, json, os, subprocess, sys
kit, features = sys.argv[1], sys.argv[2]
files = {}
for root, _, names in os.walk(kit):
    for n in sorted(names):
        p = os.path.join(root, n)
        rel = os.path.relpath(p, kit)
        if rel == "MANIFEST.json":
            continue
        files[rel] = {"bytes": os.path.getsize(p), "sha256": hashlib.sha256(open(p, "rb").read()).hexdigest()}
git = lambda *a: subprocess.run(["git", *a], capture_output=True, text=True).stdout.strip()
manifest = {
    "commit": git("rev-parse", "HEAD"),
    "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
    "rustc": subprocess.run(["rustc", "--version"], capture_output=True, text=True).stdout.strip(),
    "features": features.replace("--features ", "") or None,
    "files": files,
}
json.dump(manifest, open(os.path.join(kit, "MANIFEST.json"), "w"), indent=2)
EOF

kit_bytes=$(du -cb "$KIT" | tail -1 | cut -f1)
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
untracked=$(git ls-files -z --others --exclude-standard | xargs -0 -r du -cb | tail -1 | cut -f1)
total=$((kit_bytes + tree_bytes + ${untracked:-0}))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
echo "kit $(mib "$kit_bytes") + tracked tree $(mib "$tree_bytes") + untracked $(mib "${untracked:-0}") = $(mib "$total") of 64 MiB"
if [ "$total" -gt "$LIMIT" ]; then
  echo "what travels is over 64 MiB: the GPU machine would refuse it" >&2
  exit 1
fi
