#!/usr/bin/env bash
# The embedded default model with its trained MTP head (issue 25): tokens per main-model forward and
# decode tok/s at K = 0…4 draft tokens per step (docs/benchmarks.md). One server per K and round, the same
# requests for each: `osprey bench serve` one request at a time on its text, conversation (an image,
# multi-turn) and video scenarios. Decode tok/s is the server's own: the count over the sum of
# `osprey_inter_token_latency_seconds` (the time between consecutive tokens of a request, as the server
# sends them) over the run, so HTTP chunking on the client side does not enter it; tokens per forward is
# the server's emitted / verifications (K = 0: 1 by definition). Rounds interleave the K values so a slow
# patch of the shared machine hits them all.
#   tools/bench_default_spec.sh [OSPREY_BIN] [OUT_DIR] [ROUNDS] [REQUESTS]
set -euo pipefail
BIN=$(realpath "${1:-${CARGO_TARGET_DIR:-$HOME/.cache/osprey/target}/release/osprey}")
OUT=${2:-/tmp/osprey-default-spec}
ROUNDS=${3:-3}
REQUESTS=${4:-48}
PORT=${PORT:-18282}
rm -rf "$OUT" && mkdir -p "$OUT"

scrape() { curl -s "http://127.0.0.1:$PORT/metrics" | grep -E '^osprey_(inter_token_latency_seconds_(sum|count)|spec_[a-z_]+_total) ' >"$1"; }

for round in $(seq "$ROUNDS"); do
  for k in 0 1 2 3 4; do
    "$BIN" serve --port "$PORT" --speculative-tokens "$k" >"$OUT/serve-k$k-r$round.log" 2>&1 &
    pid=$!
    for _ in $(seq 100); do curl -sf "http://127.0.0.1:$PORT/health" >/dev/null && break; sleep 0.2; done
    for sc in text conversation video; do
      scrape "$OUT/k$k-$sc-r$round.before"
      "$BIN" bench serve --url "http://127.0.0.1:$PORT" --scenario "$sc" --requests "$REQUESTS" --max-tokens 64 \
        --out "$OUT/k$k-$sc-r$round.json" >/dev/null 2>&1
      scrape "$OUT/k$k-$sc-r$round.after"
    done
    kill "$pid"; wait "$pid" 2>/dev/null || true
  done
done

python3 - "$OUT" "$ROUNDS" <<'PY'
import statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])

def read(path):
    return {line.split()[0]: float(line.split()[1]) for line in open(path)}

print("| K | scenario | decode tok/s (rounds) | median | vs K = 0 | tokens per forward | acceptance |")
print("| --- | --- | --- | --- | --- | --- | --- |")
base = {}
for k in range(5):
    for sc in ["text", "conversation", "video"]:
        rates, d = [], {}
        for r in range(1, rounds + 1):
            b, a = read(f"{out}/k{k}-{sc}-r{r}.before"), read(f"{out}/k{k}-{sc}-r{r}.after")
            delta = {n: a.get(n, 0.0) - b.get(n, 0.0) for n in a}
            rates.append(delta["osprey_inter_token_latency_seconds_count"] / delta["osprey_inter_token_latency_seconds_sum"])
            for n, v in delta.items():
                d[n] = d.get(n, 0.0) + v
        med = statistics.median(rates)
        base.setdefault(sc, med)
        per = d["osprey_spec_emitted_tokens_total"] / d["osprey_spec_verifications_total"] if k else 1.0
        acc = f"{d['osprey_spec_accepted_total'] / d['osprey_spec_drafted_total']:.1%}" if k else "—"
        print(f"| {k} | {sc} | {', '.join(f'{x:.0f}' for x in rates)} | {med:.0f} | {med / base[sc]:.2f}× | {per:.2f} | {acc} |")
PY
