#!/usr/bin/env bash
# Fails when the tracked tree is over LIMIT MiB (default 40): the GPU machine takes at most 64 MiB, the
# tree plus a run kit (tools/gpu/build.sh), and every clone carries it (issue 33, docs/fixtures.md).
# Symbolic links count as links (fixtures/models' variants link their base's weights).
set -euo pipefail
cd "$(dirname "$0")/.."
limit_mib="${1:-40}"
bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.2f", b / 1048576}')
if [ "$bytes" -gt $((limit_mib * 1024 * 1024)) ]; then
  echo "the tracked tree is $mib MiB, over $limit_mib MiB; the five largest files:" >&2
  git ls-files -z | xargs -0 du -b | sort -rn | head -5 >&2
  exit 1
fi
echo "tracked tree: $mib MiB of $limit_mib"
