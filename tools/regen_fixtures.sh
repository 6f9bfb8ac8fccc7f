#!/usr/bin/env bash
# Regenerates every fixture under fixtures/ but the trained default model (tools/README.md, "The trained
# default model") with the pinned reference stack, in the order the generators read each other's output,
# then trims the references to what the tests read (trim_refs.py) and links variant checkpoints to their
# bases (share_weights.py). Deterministic: a second run writes byte-identical files.
#
#   tools/regen_fixtures.sh           # rewrite fixtures/
#   tools/regen_fixtures.sh --check   # then fail unless git sees no change under fixtures/
set -euo pipefail
cd "$(dirname "$0")"
PY="${PY:-$HOME/.cache/osprey/venv/bin/python}"
for g in gen_fixtures gen_vision_fixtures gen_nvfp4_fixtures gen_mtp_fixtures gen_qwen4_fixtures \
         gen_template_fixtures trim_refs share_weights; do
  echo "== $g.py"
  "$PY" "$g.py"
done
if [ "${1:-}" = "--check" ]; then
  changed=$(git status --porcelain -- ../fixtures)
  if [ -n "$changed" ]; then
    echo "fixtures differ from the committed ones:" >&2
    echo "$changed" >&2
    exit 1
  fi
  echo "fixtures byte-identical to the committed ones"
fi
