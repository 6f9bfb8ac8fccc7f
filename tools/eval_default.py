"""Held-out evaluation of the embedded default model (issue 7): transformers' greedy answers, then
osprey's through its HTTP API, compared prompt by prompt.

    python tools/eval_default.py heldout  --model fixtures/models/osprey-default --out /tmp/heldout
        writes the held-out prompts (media as PNG files, exactly what both engines see) and
        transformers' greedy answer for each to /tmp/heldout/prompts.json
    python tools/eval_default.py ask --set /tmp/heldout --url http://127.0.0.1:8080 [--tag NAME] [--same-as TAG]
        asks a running `osprey serve` each prompt (temperature 0) and prints agreement with transformers
        and accuracy per task (and, with --same-as, how many answers equal an earlier run's); writes
        /tmp/heldout/osprey-NAME.json
    python tools/eval_default.py fixtures --model fixtures/models/osprey-default --out fixtures/media/default
        writes the fixed test media of the end-to-end tests (tests/osprey/default_model.rs) and cases.json with
        the expected answers; refuses to write a case transformers answers wrongly

Pinned stack (tools/requirements.txt), CPU torch. The held-out seed (20,000) differs from the trainer's
(0, 1, 2) and from its built-in evaluation (10,000).
"""

import argparse
import base64
import collections
import json
import pathlib
import random
import sys
import time
import urllib.request

import numpy as np
import torch
from PIL import Image
from transformers import AutoProcessor, Qwen3_5MoeForConditionalGeneration

import train_default as td

MAX_NEW = 48


def load(model_dir: pathlib.Path):
    torch.set_num_threads(2)
    model = Qwen3_5MoeForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(model_dir)


def save_media(ex: dict, out: pathlib.Path, stem: str) -> list:
    """Writes the example's media as PNG files; returns their names per medium (a video: one per frame)."""
    files = []
    for i, img in enumerate(ex.get("images", [])):
        name = f"{stem}_img{i}.png"
        img.save(out / name)
        files.append([name])
    for i, vid in enumerate(ex.get("videos", [])):
        names = []
        for f, frame in enumerate(vid):
            name = f"{stem}_vid{i}_{f}.png"
            Image.fromarray(frame).save(out / name)
            names.append(name)
        files.append(names)
    return files


def reload(case: dict, root: pathlib.Path) -> dict:
    """The example as transformers sees it, read back from the PNG files osprey is sent."""
    ex = {"content": case["content"], "answer": case["answer"]}
    if case["kind"] == "video":
        ex["videos"] = [np.stack([np.array(Image.open(root / f).convert("RGB")) for f in case["media"][0]])]
    elif case["media"]:
        ex["images"] = [Image.open(root / m[0]).convert("RGB") for m in case["media"]]
    return ex


@torch.no_grad()
def transformers_answer(model, proc, ex: dict, thinking: bool) -> dict:
    """Greedy generation; `reasoning` is what precedes `</think>` (the server's `reasoning_content`)."""
    inputs = td.encode(proc, ex, thinking, with_answer=False)
    out = model.generate(**inputs, max_new_tokens=MAX_NEW, do_sample=False)
    ids = out[0, inputs["input_ids"].shape[1]:].tolist()
    text = proc.tokenizer.decode(ids, skip_special_tokens=True)
    reasoning, _, content = text.rpartition("</think>") if "</think>" in text else ("", "", text)
    return {"reasoning": reasoning.strip(), "content": content.strip(), "tokens": len(ids)}


def heldout_cases(per_task: int, seed: int):
    rng = random.Random(seed)
    for task in ["one", "two", "video"]:
        for i in range(per_task):
            yield task, td.sample(rng, task), i % 2 == 0
    # The text turns are a fixed list: each question once with and once without thinking.
    for q, a in td.TEXT_TURNS:
        for thinking in (True, False):
            yield "text", {"content": q, "answer": a}, thinking


def write_set(model_dir: pathlib.Path, out: pathlib.Path, cases) -> list:
    model, proc = load(model_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t0 = time.time()
    for n, (name, task, ex, thinking) in enumerate(cases):
        case = {"name": name, "kind": task, "content": ex["content"], "thinking": thinking,
                "answer": ex["answer"], "media": save_media(ex, out, name)}
        case["transformers"] = transformers_answer(model, proc, reload(case, out), thinking)
        rows.append(case)
        if n % 50 == 0:
            print(f"{n} prompts, {time.time() - t0:.0f}s", flush=True)
    return rows


def cmd_heldout(args):
    cases = ((f"{task}{i:03d}", task, ex, th) for i, (task, ex, th) in enumerate(heldout_cases(args.per_task, args.seed)))
    rows = write_set(args.model, args.out, cases)
    (args.out / "prompts.json").write_text(json.dumps(rows, indent=1) + "\n")
    report("transformers", rows, [r["transformers"] for r in rows])


def fixture_cases():
    """Fixed, hand-chosen cases: every colour and every shape once, all four directions, a text turn."""
    rng = random.Random(7)
    picks = [("red", "circle"), ("green", "square"), ("blue", "triangle"), ("yellow", "diamond")]
    for c, s in picks:
        img = td.shape_image(rng, s, c)
        yield f"{c}_{s}", "one", {"content": [{"type": "image"}, {"type": "text", "text": "What is in the image?"}],
                                  "images": [img], "answer": f"a {c} {s}"}, False
    for d in td.DIRECTIONS:
        yield f"moving_{d}", "video", {"content": [{"type": "video"}, {"type": "text",
                                                                      "text": "Which way does the shape move?"}],
                                       "videos": [td.motion_video(rng, d)], "answer": d}, False
    yield "hello", "text", {"content": "Hello", "answer": td.TEXT_TURNS[0][1]}, False


def cmd_fixtures(args):
    rows = write_set(args.model, args.out, fixture_cases())
    # Two images reuse the one-image files, so the test can send them in either order.
    model, proc = load(args.model)
    singles = {r["name"]: r for r in rows if r["kind"] == "one"}
    for a, b in [("red_circle", "blue_triangle"), ("blue_triangle", "red_circle")]:
        ex = {"content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Describe each image."}],
              "images": [Image.open(args.out / singles[x]["media"][0][0]).convert("RGB") for x in (a, b)],
              "answer": f"first: {singles[a]['answer']}; second: {singles[b]['answer']}"}
        rows.append({"name": f"{a}+{b}", "kind": "two", "content": ex["content"], "thinking": False,
                     "answer": ex["answer"], "media": [singles[a]["media"][0], singles[b]["media"][0]],
                     "transformers": transformers_answer(model, proc, ex, False)})
    wrong = [r["name"] for r in rows if r["transformers"]["content"] != r["answer"]]
    if wrong:
        sys.exit(f"transformers answers these fixed cases wrongly: {wrong}")
    for r in rows:  # the test needs only what to send and what must come back
        r["expected"] = r.pop("answer")
        del r["transformers"]
    (args.out / "cases.json").write_text(json.dumps(rows, indent=1) + "\n")
    print(f"{len(rows)} cases, all answered correctly by transformers")


def request_body(case: dict, root: pathlib.Path) -> dict:
    def url(name):
        return "data:image/png;base64," + base64.b64encode((root / name).read_bytes()).decode()

    content = case["content"]
    if isinstance(content, list):
        media = iter(case["media"])
        parts = []
        for p in content:
            if p["type"] == "image":
                parts.append({"type": "image_url", "image_url": {"url": url(next(media)[0])}})
            elif p["type"] == "video":
                parts.append({"type": "video", "video": [url(f) for f in next(media)], "fps": 2.0})
            else:
                parts.append(p)
        content = parts
    return {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW, "temperature": 0,
            "chat_template_kwargs": {"enable_thinking": case["thinking"]}}


def ask_osprey(url: str, body: dict) -> dict:
    req = urllib.request.Request(url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        v = json.load(r)
    m = v["choices"][0]["message"]
    return {"reasoning": (m.get("reasoning_content") or "").strip(), "content": (m.get("content") or "").strip(),
            "tokens": v["usage"]["completion_tokens"]}


def spec_counters(url: str) -> dict:
    """The server's speculative-decoding counters (`osprey_spec_*` in /metrics; absent: none) and its
    inter-token latency sum and count (decode tok/s over a run)."""
    with urllib.request.urlopen(url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("osprey_spec_", "osprey_inter_token_latency_seconds_sum",
                            "osprey_inter_token_latency_seconds_count")) and " " in line:
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def spec_report(before: dict, after: dict) -> dict:
    """Decode tok/s as the server measured it (inter-token latencies: count over sum) and, when the
    server speculates, drafted and accepted tokens, the acceptance rate, tokens per main-model forward."""
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    itl_n, itl_s = d.get("osprey_inter_token_latency_seconds_count", 0.0), d.get("osprey_inter_token_latency_seconds_sum", 0.0)
    decode = {"decode_tok_s": round(itl_n / itl_s, 1) if itl_s > 0 else None}
    print(f"decode {decode['decode_tok_s']} tok/s (server inter-token latencies)")
    drafted = d.get("osprey_spec_drafted_total", 0.0)
    if drafted == 0:
        return decode
    verifications = d.get("osprey_spec_verifications_total", 0.0)
    rep = {"drafted": int(drafted), "accepted": int(d.get("osprey_spec_accepted_total", 0.0)),
           "acceptance": round(d.get("osprey_spec_accepted_total", 0.0) / drafted, 4),
           "verifications": int(verifications),
           "tokens_per_verification": round(d.get("osprey_spec_emitted_tokens_total", 0.0) / max(1.0, verifications), 3)}
    print(f"speculative: {rep['drafted']} drafted, {rep['accepted']} accepted ({rep['acceptance']:.1%}), "
          f"{rep['tokens_per_verification']:.2f} tokens per verification")
    return {**decode, **rep}


def report(who: str, rows: list, answers: list) -> dict:
    per = collections.defaultdict(lambda: [0, 0])
    for r, a in zip(rows, answers):
        per[r["kind"]][0] += a["content"] == r["answer"]
        per[r["kind"]][1] += 1
    acc = {k: {"correct": c, "of": n, "accuracy": round(c / n, 4)} for k, (c, n) in per.items()}
    print(f"{who} accuracy: " + ", ".join(f"{k} {v['correct']}/{v['of']} ({v['accuracy']:.1%})" for k, v in acc.items()))
    return acc


def cmd_ask(args):
    rows = json.loads((args.set / "prompts.json").read_text())
    answers = []
    before = spec_counters(args.url)
    t0 = time.time()
    for r in rows:
        answers.append(ask_osprey(args.url, request_body(r, args.set)))
    secs = time.time() - t0
    spec = spec_report(before, spec_counters(args.url))
    same = [a["content"] == r["transformers"]["content"] and a["reasoning"] == r["transformers"]["reasoning"]
            for r, a in zip(rows, answers)]
    differ = [(r["name"], r["transformers"], a) for r, a, s in zip(rows, answers, same) if not s]
    print(f"osprey ({args.tag}) vs transformers: {sum(same)}/{len(rows)} greedy answers equal "
          f"({sum(same) / len(rows):.1%}), {secs:.1f}s for {len(rows)} requests")
    for d in differ:
        print("  differs:", d)
    acc = report(f"osprey ({args.tag})", rows, answers)
    summary = {"tag": args.tag, "prompts": len(rows), "equal_to_transformers": sum(same),
               "agreement": round(sum(same) / len(rows), 4), "accuracy": acc,
               "transformers_accuracy": report("transformers", rows, [r["transformers"] for r in rows]),
               "differs": differ, "seconds": round(secs, 1), "speculative": spec, "answers": answers}
    if args.same_as:
        other = json.loads((args.set / f"osprey-{args.same_as}.json").read_text())["answers"]
        equal = sum(a["content"] == b["content"] and a["reasoning"] == b["reasoning"] for a, b in zip(answers, other))
        print(f"osprey ({args.tag}) vs osprey ({args.same_as}): {equal}/{len(rows)} answers identical")
        summary["identical_to"] = {args.same_as: equal}
    (args.set / f"osprey-{args.tag}.json").write_text(json.dumps(summary, indent=1) + "\n")


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    h = sub.add_parser("heldout")
    h.add_argument("--model", type=pathlib.Path, required=True)
    h.add_argument("--out", type=pathlib.Path, required=True)
    h.add_argument("--per-task", type=int, default=64)
    h.add_argument("--seed", type=int, default=20_000)
    f = sub.add_parser("fixtures")
    f.add_argument("--model", type=pathlib.Path, required=True)
    f.add_argument("--out", type=pathlib.Path, required=True)
    a = sub.add_parser("ask")
    a.add_argument("--set", type=pathlib.Path, required=True)
    a.add_argument("--url", default="http://127.0.0.1:8080")
    a.add_argument("--tag", default="f32")
    a.add_argument("--same-as", help="also count answers identical to an earlier run's (its tag)")
    args = ap.parse_args()
    {"heldout": cmd_heldout, "fixtures": cmd_fixtures, "ask": cmd_ask}[args.cmd](args)


if __name__ == "__main__":
    main()
