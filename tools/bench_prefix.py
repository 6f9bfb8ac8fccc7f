"""Multi-turn image conversation against a running osprey server: TTFT and cached tokens per turn.

Turn 1 sends an image and a question; every turn appends ~450 tokens of text and the previous answer, so
the history grows to several thousand tokens. TTFT = time from sending the request to the first streamed
token. Prints one JSON object per turn. Standard library only.
"""

import argparse
import base64
import io
import json
import time
import urllib.request

import numpy as np
from PIL import Image


def image_url(w, h, seed=0):
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // w, y * 255 // h, (x + y + seed) * 7 % 256], -1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img, "RGB").save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


FILLER = ("The engineers measured the cache again and wrote down every number they saw, carefully, "
          "so that the next turn of the conversation would find the same history waiting for it. ")


def turn(base, messages):
    body = json.dumps({"messages": messages, "max_tokens": 8, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"content-type": "application/json"})
    t0 = time.perf_counter()
    ttft, text, usage = None, "", None
    with urllib.request.urlopen(req) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for ch in chunk.get("choices", []):
                d = ch.get("delta", {})
                piece = (d.get("reasoning_content") or "") + (d.get("content") or "")
                # The first token: its text, or (a token that decodes to nothing, as random checkpoints
                # with the tiny tokenizer produce) the chunk that ends a one-token request.
                if (piece or ch.get("finish_reason")) and ttft is None:
                    ttft = time.perf_counter() - t0
                text += d.get("content") or ""
    return ttft, text, usage


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default="http://127.0.0.1:8080")
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--filler", type=int, default=12, help="filler sentences per turn (~37 tokens each)")
    ap.add_argument("--image-seed", type=int, default=0,
                    help="varies the image's pixels: another seed misses the server's media cache")
    args = ap.parse_args()
    messages = []
    for t in range(args.turns):
        content = [{"type": "text", "text": FILLER * args.filler + f"Question {t + 1}: what do you see?"}]
        if t == 0:
            content.insert(0, {"type": "image_url", "image_url": {"url": image_url(448, 448, args.image_seed)}})
        messages.append({"role": "user", "content": content})
        ttft, text, usage = turn(args.base, messages)
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        print(json.dumps({"turn": t + 1, "prompt_tokens": usage["prompt_tokens"], "cached_tokens": cached,
                          "cached_fraction": round(cached / usage["prompt_tokens"], 3), "ttft_s": round(ttft, 4)}))
        messages.append({"role": "assistant", "content": text})


if __name__ == "__main__":
    main()
