"""Soak a running osprey server: N concurrent clients for a given time, a mix of text, image and video
requests through chat completions, Responses and Messages, streamed and not, and clients that disconnect
mid-stream. Reports errors by code, latency
percentiles and the server's RSS trend (from /proc/PID/status). Standard library only.

Usage: python3 tools/soak.py --base http://127.0.0.1:8080 --pid $(pgrep -f 'osprey serve') \\
           [--clients 64] [--seconds 600] [--media fixtures/media/default]
"""

import argparse
import base64
import collections
import http.client
import json
import os
import random
import threading
import time
import urllib.parse


def rss_mib(pid):
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def data_url(path):
    with open(path, "rb") as f:
        return "data:image/png;base64," + base64.b64encode(f.read()).decode()


def body_for(kind, media, rng):
    """A chat completions request: (path, body)."""
    q = {"type": "text", "text": "What is in it?"}
    if kind == "image":
        content = [{"type": "image_url", "image_url": {"url": rng.choice(media["images"])}}, q]
    elif kind == "video":
        content = [{"type": "video", "video": media["video"], "fps": 2}, q]
    else:
        content = rng.choice(["Hello!", "Count to ten.", "Tell me about the sea."])
    return "/v1/chat/completions", {"messages": [{"role": "user", "content": content}],
                                    "max_tokens": rng.choice([4, 16, 48]), "temperature": rng.choice([0, 0.7])}


def as_api(api, path, body):
    """The same request through the Responses or the Messages API (videos stay on chat completions)."""
    msg = body["messages"][0]["content"]
    if api == "chat" or (isinstance(msg, list) and msg[0]["type"] == "video"):
        return path, body
    if api == "responses":
        if isinstance(msg, list):
            msg = [{"type": "input_image", "image_url": p["image_url"]["url"]} if p["type"] == "image_url"
                   else {"type": "input_text", "text": p["text"]} for p in msg]
            inp = [{"role": "user", "content": msg}]
        else:
            inp = msg
        return "/v1/responses", {"input": inp, "max_output_tokens": body["max_tokens"], "temperature": body["temperature"]}
    if isinstance(msg, list):
        msg = [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                             "data": p["image_url"]["url"].split(",", 1)[1]}}
               if p["type"] == "image_url" else p for p in msg]
    return "/v1/messages", {"messages": [{"role": "user", "content": msg}], "max_tokens": body["max_tokens"],
                            "temperature": body["temperature"]}


def failed(line):
    """An error in a stream: an OpenAI or Anthropic error object, or an `error` event (a Responses object's
    own `"error": null` is not one)."""
    return line.startswith(b"event: error") or b'"error":{' in line or b'"error": {' in line


def one(base, kind, api, stream, disconnect, media, rng):
    u = urllib.parse.urlparse(base)
    path, body = as_api(api, *body_for(kind, media, rng))
    body["stream"] = stream
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=120)
    t0 = time.perf_counter()
    conn.request("POST", path, json.dumps(body), {"content-type": "application/json"})
    r = conn.getresponse()
    if r.status != 200:
        err = json.loads(r.read() or b"{}").get("error", {})
        code = err.get("code") or err.get("type") or str(r.status)
        conn.close()
        return code, time.perf_counter() - t0
    if stream:
        events = 0
        for line in r:
            if failed(line):
                conn.close()
                return "stream_error", time.perf_counter() - t0
            if line.startswith(b"data: "):
                events += 1
                if disconnect and events >= 2:
                    conn.close()  # the client leaves mid-stream
                    return "disconnected", time.perf_counter() - t0
    else:
        r.read()
    conn.close()
    return "ok", time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--pid", type=int)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=600)
    ap.add_argument("--media", default=os.path.join(os.path.dirname(__file__), "../fixtures/media/default"))
    a = ap.parse_args()
    files = sorted(os.listdir(a.media))
    media = {"images": [data_url(os.path.join(a.media, f)) for f in files if "_img" in f and f.endswith(".png")][:8],
             "video": [data_url(os.path.join(a.media, f)) for f in files if f.startswith("moving_left_vid0_")][:4]}
    end = time.time() + a.seconds
    results = collections.Counter()
    latencies = []
    lock = threading.Lock()
    rss = [(0.0, rss_mib(a.pid) if a.pid else None)]
    t_start = time.time()

    def client(i):
        rng = random.Random(i)
        while time.time() < end:
            kind = rng.choice(["text", "text", "image", "video"])
            api = rng.choice(["chat", "chat", "responses", "messages"])
            stream = rng.random() < 0.5
            disconnect = stream and rng.random() < 0.2
            try:
                code, dt = one(a.base, kind, api, stream, disconnect, media, rng)
            except Exception as e:  # a transport error is a finding, not a crash of the tool
                code, dt = f"transport:{type(e).__name__}", 0.0
            with lock:
                results[code] += 1
                if code == "ok":
                    latencies.append(dt)

    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(a.clients)]
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(min(10.0, max(0.5, a.seconds / 20)))
        if a.pid:
            rss.append((round(time.time() - t_start, 1), rss_mib(a.pid)))
    latencies.sort()
    pct = lambda q: round(latencies[min(len(latencies) - 1, int(q * len(latencies)))], 3) if latencies else None
    print(json.dumps({"clients": a.clients, "seconds": a.seconds, "results": dict(results),
                      "latency_p50_s": pct(0.5), "latency_p99_s": pct(0.99),
                      "rss_mib_start": rss[0][1], "rss_mib_end": rss[-1][1], "rss_trend": rss}, indent=1))


if __name__ == "__main__":
    main()
