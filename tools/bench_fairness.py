"""Short requests while long streams run: TTFT of short chat requests (p50 / p99) against a running
server that is busy with N long streaming generations. Standard library only.

Usage: python3 tools/bench_fairness.py --base http://127.0.0.1:18767 [--long 8] [--long-tokens 3000] [--short 20]
"""

import argparse
import json
import threading
import time
import urllib.request


def stream(base, body, first, stop):
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req) as r:
        for line in r:
            if line.startswith(b"data: {") and not first.is_set():
                choices = json.loads(line[6:]).get("choices") or [{}]
                delta = choices[0].get("delta", {})
                if delta.get("content") or delta.get("reasoning_content"):
                    first.set()
                    ttft = time.perf_counter() - t0
                    if stop is None:
                        return ttft
            if stop is not None and stop.is_set():
                return None
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--long", type=int, default=8)
    ap.add_argument("--long-tokens", type=int, default=3000)
    ap.add_argument("--short", type=int, default=20)
    a = ap.parse_args()
    stop = threading.Event()
    firsts = [threading.Event() for _ in range(a.long)]
    longs = []
    for i in range(a.long):
        body = {"messages": [{"role": "user", "content": f"Tell me story number {i}."}], "max_tokens": a.long_tokens,
                "stream": True, "temperature": 0, "ignore_eos": True}
        t = threading.Thread(target=stream, args=(a.base, body, firsts[i], stop), daemon=True)
        t.start()
        longs.append(t)
    time.sleep(1.0)  # the long streams are queued or running
    ttfts = []
    for i in range(a.short):
        body = {"messages": [{"role": "user", "content": f"Short question {i}?"}], "max_tokens": 16,
                "stream": True, "temperature": 0}
        ttfts.append(stream(a.base, body, threading.Event(), None))
    stop.set()
    ttfts.sort()
    p = lambda q: ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))]
    print(json.dumps({"long_streams": a.long, "long_tokens": a.long_tokens, "short": a.short,
                      "long_started": sum(f.is_set() for f in firsts),
                      "ttft_p50_s": round(p(0.5), 3), "ttft_p99_s": round(p(0.99), 3), "ttft_max_s": round(ttfts[-1], 3)}))


if __name__ == "__main__":
    main()
