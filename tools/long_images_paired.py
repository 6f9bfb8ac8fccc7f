"""TTFT of each turn of a `bench serve --scenario long-images --cold-reference` run against its paired cold
request (the turn's message alone with fresh media, sent right after it), by context band and turn kind,
and against the cold request plus the new tokens' attention over the context (4·new·context·16·256 flops at
RATE GFLOP/s, the attention kernel's measured rate: `examples/attention_depth`). docs/benchmarks.md, issue 53.

  python3 tools/long_images_paired.py RUN.json [RATE_GFLOPS]
"""
import json, statistics, sys
d = json.load(open(sys.argv[1]))
S = d["report"]["samples"]
RATE = float(sys.argv[2]) * 1e9 if len(sys.argv) > 2 else 157e9
bands = [(0, 8000, "< 8k"), (8000, 16000, "8k–16k"), (16000, 32000, "16k–32k"), (32000, 48000, "32k–48k"), (48000, 70000, "48k–64k")]
rows = []
for i, s in enumerate(S):
    t = s.get("turn") or {}
    if s.get("error") or not t.get("cold_ttft_s"):
        continue
    kind = "two-image" if t["media_items"] == 2 else ("video" if i % 5 == 4 else "image")
    new = s["prompt_tokens"] - (s["cached_tokens"] or 0)
    att = 4 * new * (s["prompt_tokens"] - new) * 16 * 256 / RATE
    rows.append((s["prompt_tokens"], kind, s["ttft_s"] / t["cold_ttft_s"], s["ttft_s"], t["cold_ttft_s"], t.get("cold_cached_tokens"), new, s["ttft_s"] / (t["cold_ttft_s"] + att)))
print(f"turns with a paired reference: {len(rows)} of {len(S)}; cold references with cached tokens: {sum(1 for r in rows if r[5])}")
print("| context | turns | image turns | video turns | two-image turns | all turns | all turns: TTFT / (paired cold + attention) | TTFT median s (turn / cold) |")
print("| --- | --- | --- | --- | --- | --- | --- | --- |")
for lo, hi, name in bands:
    b = [r for r in rows if lo <= r[0] < hi]
    if not b:
        continue
    def cell(k):
        x = [r[2] for r in b if k is None or r[1] == k]
        return f"{statistics.median(x):.2f} ({max(x):.2f})" if x else ""
    print(f"| {name} | {len(b)} | {cell('image')} | {cell('video')} | {cell('two-image')} | {cell(None)} | {statistics.median(r[7] for r in b):.2f} ({max(r[7] for r in b):.2f}) | {statistics.median(r[3] for r in b):.2f} / {statistics.median(r[4] for r in b):.2f} |")
over = [r for r in rows if r[2] > 1.5]
print(f"turns above 1.5x: {len(over)}; max {max(r[2] for r in rows):.2f}; last prompt {rows[-1][0]}")
print("turns above 1.5x of cold + attention:", sum(1 for r in rows if r[7] > 1.5))
