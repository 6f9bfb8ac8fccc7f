#!/usr/bin/env python3
"""Summarises tools/bench_readahead.sh's JSON lines (issue 55): per budget and configuration, the median
decode tok/s over the repetitions, its ratio to read-ahead off (the median of the per-repetition ratios:
each repetition ran its configurations back to back), the guesses' counters, and each run's share of
max(read, compute): compute time from the all-resident run, read time at the rate the same repetition's
run without read-ahead read at. Markdown on stdout. Usage: tools/bench_readahead_summary.py runs.jsonl"""
import json
import statistics as st
import sys
from collections import defaultdict

runs = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
resident = next(r["r"]["decode_tok_s"] for r in runs if r.get("config") == "resident")
by = defaultdict(dict)  # (budget, config) -> rep -> record
for r in runs:
    if r.get("config") == "resident":
        continue
    by[(r["r"]["budget_fraction"], r["config"])][r["rep"]] = r
budgets = sorted({b for b, _ in by}, reverse=True)
configs = ["off", "default", "oracle"] + sorted({c for _, c in by} - {"off", "default", "oracle"})
med = lambda xs: st.median(xs) if xs else float("nan")
print(f"all experts resident: {resident:.1f} tok/s (compute only)\n")
print("| budget | read-ahead | decode tok/s (median) | vs off (median of per-rep ratios) | min ratio | residency "
      "| MB read / token | guesses read / token | used | cancelled / token | gated / token | of max(read, compute) | range |")
print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
for b in budgets:
    off = by.get((b, "off"), {})
    for c in configs:
        reps = by.get((b, c), {})
        if not reps:
            continue
        tok = [x["r"]["decode_tok_s"] for x in reps.values()]
        ratios = [reps[k]["r"]["decode_tok_s"] / off[k]["r"]["decode_tok_s"] for k in reps if k in off]
        p = lambda key: med([x["r"]["prefetch"].get(key, 0.0) for x in reps.values()])
        # max(read, compute) per token: the bytes this run read at the rate the same repetition's run
        # without read-ahead got from the disk (its reads are all demand reads, one batch per layer).
        ceil = []
        for k, x in reps.items():
            bw = off[k]["r"]["read_gb_s"] * 1e9 if k in off and off[k]["r"]["read_gb_s"] > 0 else 0.0
            read = x["r"]["bytes_read_per_token"] / bw if bw else 0.0
            ceil.append(x["r"]["decode_tok_s"] * max(read, 1.0 / resident))
        guess = c != "off"
        print(f"| {b:.0%} | {c} | {med(tok):.1f} | {med(ratios):.2f}× | {min(ratios):.2f}× "
              f"| {med([x['r']['residency'] for x in reps.values()]):.3f} "
              f"| {med([x['r']['bytes_read_per_token'] / 1e6 for x in reps.values()]):.1f} "
              f"| {p('issued_per_token'):.1f} | {p('used_fraction'):.2f} | {p('cancelled_per_token'):.1f} "
              f"| {p('gated_per_token'):.1f} | {med(ceil):.3f} | {min(tok):.1f}–{max(tok):.1f} |"
              if guess else
              f"| {b:.0%} | {c} | {med(tok):.1f} | 1.00× | | {med([x['r']['residency'] for x in reps.values()]):.3f} "
              f"| {med([x['r']['bytes_read_per_token'] / 1e6 for x in reps.values()]):.1f} | | | | | {med(ceil):.3f} "
              f"| {min(tok):.1f}–{max(tok):.1f} |")
disks = sorted({r["disk_gb_s"] for r in runs if r.get("disk_gb_s")})
if disks:
    print(f"\ndisk random-read bandwidth measured before each sweep: {min(disks):.2f}–{max(disks):.2f} GB/s "
          f"(median {med(disks):.2f})")
