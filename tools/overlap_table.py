"""Markdown table from `osprey bench experts` JSON lines, with and without --wait-all (medians)."""
import json
import statistics as st
import sys

runs = [json.loads(line) for line in sys.stdin if line.startswith("{")]
print("| budget | overlap tok/s: median (runs) | wait-all tok/s: median (runs) | ratio | stall s overlap / wait-all |")
print("| --- | --- | --- | --- | --- |")
for b in sorted({r["budget_fraction"] for r in runs}, reverse=True):
    o = [r for r in runs if r["budget_fraction"] == b and not r["wait_all"]]
    w = [r for r in runs if r["budget_fraction"] == b and r["wait_all"]]
    tok = lambda rs: st.median(r["decode_tok_s"] for r in rs)
    stall = lambda rs: st.median(r["stall_s"] for r in rs)
    each = lambda rs: ", ".join(f"{r['decode_tok_s']:.1f}" for r in rs)
    print(f"| {b:.0%} | {tok(o):.1f} ({each(o)}) | {tok(w):.1f} ({each(w)}) | {tok(o) / tok(w):.2f} "
          f"| {stall(o):.2f} / {stall(w):.2f} |")
