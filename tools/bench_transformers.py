"""The transformers side of `osprey bench forward`: same checkpoint, same prompt ids, same thread count.

Prefill = one forward over the prompt with a DynamicCache; decode = greedy steps of one token each, the
engine-style loop (REFERENCE.md section 6). Prints JSON with the same field names as osprey's report.
"""

import argparse
import json
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, DynamicCache


def bench_prompt(n, vocab):
    span = max(vocab - 64, 1)
    return [(i * 7919 + 13) % span for i in range(n)]


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=getattr(torch, args.dtype))
    model.eval()
    ids = torch.tensor([bench_prompt(args.prompt_len, model.config.vocab_size)])
    prefill, decode = [], []
    for rep in range(args.repeats + 1):
        cache = DynamicCache(config=model.config)
        t0 = time.perf_counter()
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits[:, -1]
        t1 = time.perf_counter()
        for _ in range(args.decode_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            logits = model(input_ids=nxt, past_key_values=cache, use_cache=True).logits[:, -1]
        t2 = time.perf_counter()
        if rep > 0:
            prefill.append(t1 - t0)
            decode.append(t2 - t1)
    p, d = statistics.median(prefill), statistics.median(decode)
    print(json.dumps({"engine": f"transformers {args.dtype}", "prompt_len": args.prompt_len,
                      "decode_tokens": args.decode_tokens, "prefill_s": p, "prefill_tok_s": args.prompt_len / p,
                      "decode_tok_s": args.decode_tokens / d}, indent=2))


if __name__ == "__main__":
    main()
