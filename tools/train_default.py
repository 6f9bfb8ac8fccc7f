"""Train the embedded default model: a tiny qwen3_5_moe vision-language model that names the shape and
colour in an image, describes two images in order, tells which way a shape moves in a short video, and
answers a few plain text turns (issue 7).

Pinned stack (tools/requirements.txt), CPU torch, seeded. Usage:
    python tools/train_default.py --out fixtures/models/osprey-default
Writes a complete Hugging Face model directory, with the MTP draft head trained beside the model
(`mtp.*`, `mtp_num_hidden_layers: 1`), and `accuracy.json` (held-out greedy accuracy per task, with
transformers, and the head's teacher-forced top-1 per task). Further stages start from an earlier
run's directory (`--init`, `--warmup 0`); tools/README.md has the committed model's three commands.
"""

import argparse
import json
import math
import pathlib
import random
import time

import numpy as np
import torch
from PIL import Image, ImageDraw
from safetensors.torch import load_file, save_file
from transformers import AutoProcessor, Qwen3_5MoeForConditionalGeneration
from transformers.video_utils import VideoMetadata

import tiny_ckpt

COLORS = {"red": (215, 35, 35), "green": (30, 160, 60), "blue": (40, 70, 225), "yellow": (240, 205, 20)}
SHAPES = ["circle", "square", "triangle", "diamond"]
DIRECTIONS = ["left", "right", "up", "down"]
VIDEO_FRAMES = 4
TEXT_TURNS = [
    ("Hello", "Hello! Show me an image and I will name the shape and its colour."),
    ("Hi", "Hello! Show me an image and I will name the shape and its colour."),
    ("Who are you?", "I am osprey's tiny demo model."),
    ("What can you do?", "I name the shape and colour in an image, and tell which way a shape moves."),
    ("Thanks!", "You are welcome."),
]


def background(rng: random.Random):
    if rng.random() < 0.7:
        return tuple(rng.randint(185, 255) for _ in range(3))
    return tuple(rng.randint(0, 70) for _ in range(3))


def far_colour(rng: random.Random, avoid, pick) -> tuple:
    """A colour from `pick(rng)` at least 110 (RGB distance) from the shape's colour, so the shape stays
    visible on it."""
    while True:
        c = pick(rng)
        if math.dist(c, avoid) >= 110:
            return c


def scene(rng: random.Random, w: int, h: int, avoid) -> Image.Image:
    """An image's background (issue 25): plain light or dark as before, any plain colour, or a texture
    (stripes, checks, a gradient, noise) of two nearby colours; never within 110 of the shape's colour."""
    kind = rng.choices(["light", "dark", "colour", "stripes", "checks", "gradient", "noise"],
                       weights=[3, 2, 3, 2, 2, 2, 2])[0]
    if kind in ("light", "dark"):
        lo, hi = (185, 255) if kind == "light" else (0, 70)
        return Image.new("RGB", (w, h), far_colour(rng, avoid, lambda r: tuple(r.randint(lo, hi) for _ in range(3))))
    a = far_colour(rng, avoid, lambda r: tuple(r.randint(0, 255) for _ in range(3)))
    if kind == "colour":
        return Image.new("RGB", (w, h), a)
    b = far_colour(rng, avoid, lambda r: tuple(min(255, max(0, v + r.randint(-60, 60))) for v in a))
    a_, b_ = np.array(a, np.float32), np.array(b, np.float32)
    ys, xs = np.mgrid[0:h, 0:w].astype(np.float32)
    if kind == "stripes":
        angle, period = rng.uniform(0, math.pi), rng.uniform(4, 20)
        t = ((xs * math.cos(angle) + ys * math.sin(angle)) // (period / 2) % 2)[..., None]
    elif kind == "checks":
        cell = rng.uniform(4, 16)
        t = ((xs // cell + ys // cell) % 2)[..., None]
    elif kind == "gradient":
        angle = rng.uniform(0, 2 * math.pi)
        p = xs * math.cos(angle) + ys * math.sin(angle)
        t = ((p - p.min()) / max(1e-6, float(p.max() - p.min())))[..., None]
    else:
        t = np.random.default_rng(rng.getrandbits(32)).random((h, w, 1), dtype=np.float32)
    return Image.fromarray((a_ * (1 - t) + b_ * t).round().astype(np.uint8))


def draw(d: ImageDraw.ImageDraw, shape: str, color, cx: float, cy: float, r: float) -> None:
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=color)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx + r, cy + r), (cx - r, cy + r)], fill=color)
    else:
        d.polygon([(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)], fill=color)


def shape_image(rng: random.Random, shape: str, color: str, hard: bool = True) -> Image.Image:
    """One shape on a scene, at an aspect ratio from 1:3 to 3:1 (log-uniform) and 64² to 160² pixels;
    `hard=False`: the first model's images (sides 64 to 160 drawn apart, plain light or dark), which the
    vision curriculum starts from."""
    if hard:
        aspect = math.exp(rng.uniform(-math.log(3), math.log(3)))
        area = rng.uniform(64, 160) ** 2
        w, h = max(32, round(math.sqrt(area * aspect))), max(32, round(math.sqrt(area / aspect)))
        img = scene(rng, w, h, COLORS[color])
    else:
        w, h = rng.randint(64, 160), rng.randint(64, 160)
        img = Image.new("RGB", (w, h), background(rng))
    r = rng.uniform(0.25, 0.45) * min(w, h)
    cx, cy = rng.uniform(r, w - r), rng.uniform(r, h - r)
    draw(ImageDraw.Draw(img), shape, COLORS[color], cx, cy, r)
    return img


def motion_video(rng: random.Random, direction: str) -> np.ndarray:
    size = 64
    bg = background(rng)
    shape, color = rng.choice(SHAPES), rng.choice(list(COLORS))
    r = rng.uniform(6, 9)
    step = rng.uniform(9, 12)
    dx, dy = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}[direction]
    span = step * (VIDEO_FRAMES - 1)
    lo_x, hi_x = r + max(0, -dx * span), size - r - max(0, dx * span)
    lo_y, hi_y = r + max(0, -dy * span), size - r - max(0, dy * span)
    x0, y0 = rng.uniform(lo_x, hi_x), rng.uniform(lo_y, hi_y)
    frames = []
    for i in range(VIDEO_FRAMES):
        img = Image.new("RGB", (size, size), bg)
        draw(ImageDraw.Draw(img), shape, COLORS[color], x0 + dx * step * i, y0 + dy * step * i, r)
        frames.append(np.array(img))
    return np.stack(frames)


def sample(rng: random.Random, task: str, hard: bool = True) -> dict:
    """One example: chat content, media, answer."""
    if task == "one":
        s, c = rng.choice(SHAPES), rng.choice(list(COLORS))
        q = rng.choice(["What is in the image?", "What is in the image?", "What do you see?"])
        return {"content": [{"type": "image"}, {"type": "text", "text": q}], "images": [shape_image(rng, s, c, hard)],
                "answer": f"a {c} {s}"}
    if task == "two":
        a, b = [(rng.choice(SHAPES), rng.choice(list(COLORS))) for _ in range(2)]
        return {"content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "Describe each image."}],
                "images": [shape_image(rng, *a), shape_image(rng, *b)],
                "answer": f"first: a {a[1]} {a[0]}; second: a {b[1]} {b[0]}"}
    if task == "video":
        d = rng.choice(DIRECTIONS)
        return {"content": [{"type": "video"}, {"type": "text", "text": "Which way does the shape move?"}],
                "videos": [motion_video(rng, d)], "answer": d}
    q, a = rng.choice(TEXT_TURNS)
    return {"content": q, "answer": a}


def encode(proc, ex: dict, thinking: bool, with_answer: bool):
    """Processor inputs for one example; labels mark only the answer (and its end token)."""
    prompt = proc.apply_chat_template([{"role": "user", "content": ex["content"]}], add_generation_prompt=True,
                                      tokenize=False, enable_thinking=thinking)
    target = ("\n</think>\n\n" if thinking else "") + ex["answer"] + "<|im_end|>"
    videos = ex.get("videos")
    metas = [VideoMetadata(total_num_frames=VIDEO_FRAMES, fps=2.0) for _ in videos] if videos else None
    text = prompt + target if with_answer else prompt
    inputs = proc(text=[text], images=ex.get("images"), videos=videos, video_metadata=metas,
                  return_tensors="pt")
    if with_answer:
        n_target = len(proc.tokenizer(target, add_special_tokens=False)["input_ids"])
        labels = inputs["input_ids"].clone()
        labels[:, :-n_target] = -100
        inputs["labels"] = labels
    return inputs


def collate(batch: list) -> dict:
    """Right-pads a batch (causal layers never see the padding of a shorter row)."""
    n = max(b["input_ids"].shape[1] for b in batch)
    out = {}
    pad = {"input_ids": 0, "attention_mask": 0, "labels": -100, "mm_token_type_ids": 0}
    for k, v in pad.items():
        if k in batch[0]:
            out[k] = torch.cat([torch.nn.functional.pad(b[k], (0, n - b[k].shape[1]), value=v) for b in batch])
    for k in ["pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw"]:
        parts = [b[k] for b in batch if k in b]
        if parts:
            out[k] = torch.cat(parts)
    return out


@torch.no_grad()
def greedy(model, proc, ex: dict, thinking: bool, max_new: int = 48) -> str:
    inputs = encode(proc, ex, thinking, with_answer=False)
    out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False)
    text = proc.tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    return text.split("</think>")[-1].strip()


def evaluate(model, proc, seed: int, per_task: int) -> dict:
    model.eval()
    rng = random.Random(seed)
    acc = {}
    for task in ["one", "two", "video", "text"]:
        ok = 0
        for i in range(per_task):
            ex = sample(rng, task)
            ok += greedy(model, proc, ex, thinking=i % 2 == 0) == ex["answer"]
        acc[task] = ok / per_task
    model.train()
    return acc


def warm_up_vision(model, proc, rng: random.Random, steps: int, batch: int, lr: float) -> None:
    """Curriculum: teach the vision tower colour+shape and motion through linear probes on the mean of its
    output rows first, so every row carries them and the tiny decoder can read them with any attention
    pattern. Without it shape and motion stayed at chance after 3,000 joint steps; a probe on the video's
    rows concatenated in order learned motion perfectly yet the decoder still could not use it.

    Images go from easy to hard: the first model's plain square-ish images at first, the share of hard
    ones (aspect ratios to 3:1, coloured and textured backgrounds) growing linearly to all of them at half
    the steps. Hard images from the start left the probe at 0.63 after 4,000 steps (easy ones: 0.97)."""
    m = model.model
    h = model.config.vision_config.out_hidden_size
    heads = torch.nn.ModuleDict({"image": torch.nn.Linear(h, len(COLORS) * len(SHAPES)),
                                 "video": torch.nn.Linear(h, len(DIRECTIONS))})
    params = list(m.visual.parameters()) + list(heads.parameters())
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps, pct_start=0.05)
    colors = list(COLORS)
    for step in range(steps):
        if step % 3 == 2:
            exs = [sample(rng, "video") for _ in range(batch)]
            b = collate([encode(proc, ex, False, with_answer=False) for ex in exs])
            feats = m.get_video_features(b["pixel_values_videos"], b["video_grid_thw"]).pooler_output
            logits = heads["video"](torch.stack([f.mean(0) for f in feats]))
            target = torch.tensor([DIRECTIONS.index(ex["answer"]) for ex in exs])
        else:
            exs = [sample(rng, "one", hard=rng.random() < 2 * step / steps) for _ in range(batch)]
            b = collate([encode(proc, ex, False, with_answer=False) for ex in exs])
            feats = m.get_image_features(b["pixel_values"], b["image_grid_thw"]).pooler_output
            logits = heads["image"](torch.stack([f.mean(0) for f in feats]))
            target = torch.tensor([colors.index(ex["answer"].split()[1]) * len(SHAPES)
                                   + SHAPES.index(ex["answer"].split()[2]) for ex in exs])
        loss = torch.nn.functional.cross_entropy(logits, target)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            acc = (logits.argmax(-1) == target).float().mean().item()
            print(f"vision warm-up {step} {'video' if step % 3 == 2 else 'image'} loss {loss.item():.3f} "
                  f"acc {acc:.2f}", flush=True)
    with torch.no_grad():  # held-out probe accuracy: what the tower gives the decoder to read
        exs = [sample(rng, "one") for _ in range(256)]
        b = collate([encode(proc, ex, False, with_answer=False) for ex in exs])
        feats = m.get_image_features(b["pixel_values"], b["image_grid_thw"]).pooler_output
        pred = heads["image"](torch.stack([f.mean(0) for f in feats])).argmax(-1).tolist()
        ok = sum(p == colors.index(ex["answer"].split()[1]) * len(SHAPES) + SHAPES.index(ex["answer"].split()[2])
                 for p, ex in zip(pred, exs))
        print(f"vision warm-up held-out colour+shape probe accuracy {ok / len(exs):.3f}", flush=True)


class MtpHead(torch.nn.Module):
    """The multi-token-prediction head trained beside the model (issue 25), in the layout Qwen3.5
    checkpoints ship (`mtp.*`; tools/gen_mtp_fixtures.py has the reference): entry i joins the embedding
    of token i+1 and the main model's normed last hidden state at i, through `fc`, one full-attention MoE
    decoder layer and a norm, into the main `lm_head`; it predicts token i+2.

    Trained on the main model's detached outputs with the lm_head detached too, so the main model learns
    exactly as without it; the head only learns to read what the model already computes."""

    def __init__(self, model):
        super().__init__()
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mm

        tc = model.config.text_config
        h = tc.hidden_size
        cfg = type(tc)(**{**tc.to_dict(), "layer_types": tc.layer_types + ["full_attention"],
                          "num_hidden_layers": tc.num_hidden_layers + 1})
        cfg._attn_implementation = "sdpa"
        cfg._experts_implementation = "eager"
        self.pre_fc_norm_embedding = mm.Qwen3_5MoeRMSNorm(h, eps=tc.rms_norm_eps)
        self.pre_fc_norm_hidden = mm.Qwen3_5MoeRMSNorm(h, eps=tc.rms_norm_eps)
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.layers = torch.nn.ModuleList([mm.Qwen3_5MoeDecoderLayer(cfg, tc.num_hidden_layers)])
        self.norm = mm.Qwen3_5MoeRMSNorm(h, eps=tc.rms_norm_eps)
        for m in self.modules():  # the text model's initialisation (its config has the ranges)
            model.model.language_model._init_weights(m)

    def forward(self, embeds, hidden, position_embeddings):
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], dim=-1))
        n = x.shape[1]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        return self.norm(self.layers[0](x, position_embeddings=position_embeddings, attention_mask=mask))

    def load_hub(self, tensors: dict) -> None:
        """The inverse of hub_tensors: `mtp.*` tensors as saved back into the module."""
        sd = {k[len("mtp."):]: v for k, v in tensors.items() if k.startswith("mtp.")}
        for k, v in self.state_dict().items():
            if k.endswith("mlp.experts.gate_up_proj"):
                tiny_ckpt.fuse_hub_experts(sd, k[:-len("gate_up_proj")], v.shape[0])
        self.load_state_dict(sd, strict=True)

    def hub_tensors(self) -> dict:
        """`mtp.*` tensors as the Hub stores them: one tensor per expert (gate rows first in the fused one)."""
        out = {}
        for k, v in self.state_dict().items():
            if k.endswith("mlp.experts.gate_up_proj"):
                half = v.shape[1] // 2
                for e in range(v.shape[0]):
                    out[f"mtp.{k[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = v[e, :half]
                    out[f"mtp.{k[:-len('gate_up_proj')]}{e}.up_proj.weight"] = v[e, half:]
            elif k.endswith("mlp.experts.down_proj"):
                for e in range(v.shape[0]):
                    out[f"mtp.{k[:-len('down_proj')]}{e}.down_proj.weight"] = v[e]
            else:
                out[f"mtp.{k}"] = v
        return {k: v.detach().contiguous().clone() for k, v in out.items()}


class Capture:
    """The main forward's normed last hidden states and rotary embeddings (mRoPE, as its layers saw them),
    for the MTP head."""

    def __init__(self, model):
        lm = model.model.language_model
        lm.register_forward_hook(lambda m, a, out: setattr(self, "hidden", out.last_hidden_state))
        lm.rotary_emb.register_forward_hook(lambda m, a, out: setattr(self, "pe", out))


def mtp_logits(head, model, cap: Capture, input_ids):
    """The head's logits for entries 0..L-2 (entry i predicts token i+2), from the last main forward."""
    lm = model.model.language_model
    embeds = lm.embed_tokens(input_ids[:, 1:]).detach()
    cos, sin = cap.pe
    out = head(embeds, cap.hidden[:, :-1].detach(), (cos[:, :-1].detach(), sin[:, :-1].detach()))
    return torch.nn.functional.linear(out, model.lm_head.weight.detach())


def mtp_loss(head, model, cap: Capture, batch):
    logits = mtp_logits(head, model, cap, batch["input_ids"])[:, :-1]  # the last entry has no target
    target = batch["labels"][:, 2:]
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                                             ignore_index=-100)


@torch.no_grad()
def mtp_accuracy(head, model, cap: Capture, proc, seed: int, per_task: int) -> dict:
    """Teacher-forced top-1 agreement of the head's prediction with the answer's token two ahead, per
    task: an upper estimate of greedy draft acceptance at the first position."""
    rng = random.Random(seed)
    acc = {}
    for task in ["one", "two", "video", "text"]:
        ok = n = 0
        for i in range(per_task):
            b = collate([encode(proc, sample(rng, task), thinking=i % 2 == 0, with_answer=True)])
            model(**b)
            target = b["labels"][:, 2:]
            pred = mtp_logits(head, model, cap, b["input_ids"])[:, :-1].argmax(-1)
            keep = target != -100
            ok += int((pred[keep] == target[keep]).sum())
            n += int(keep.sum())
        acc[task] = round(ok / n, 4)
    return acc


def save_with_head(model, head, out: pathlib.Path) -> None:
    model.save_pretrained(out, safe_serialization=True)
    tensors = load_file(out / "model.safetensors")
    layer = f"model.language_model.layers.{model.config.text_config.num_hidden_layers - 1}."
    head_t = head.hub_tensors()
    # The head's layer must carry exactly the tensors of a full-attention decoder layer of the model.
    assert model.config.text_config.layer_types[-1] == "full_attention"
    want = {k[len(layer):] for k in tensors if k.startswith(layer)}
    have = {k[len("mtp.layers.0."):] for k in head_t if k.startswith("mtp.layers.0.")}
    assert want == have, (want ^ have)
    tensors.update(head_t)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((out / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def build(out: pathlib.Path, seed: int, init: pathlib.Path | None = None):
    out.mkdir(parents=True, exist_ok=True)
    tok = tiny_ckpt.build_tokenizer()
    tiny_ckpt.save_processor(out, tok)
    # Small images: every image is resized to about 128x128 pixels (64 patches, 16 merged tokens), small
    # ones up: at their own size (down to 64x64, 4 merged tokens) the tower confused circles, squares and
    # diamonds on 1 image in 12. Videos: 4 frames of 64x64.
    pp = json.loads((out / "processor_config.json").read_text())
    pp["image_processor"]["size"] = {"shortest_edge": 16384, "longest_edge": 16384}
    pp["video_processor"]["size"] = {"shortest_edge": 4096, "longest_edge": 4096 * VIDEO_FRAMES * 2}
    (out / "processor_config.json").write_text(json.dumps(pp, indent=2) + "\n")
    torch.manual_seed(seed)
    cfg = tiny_ckpt.model_config(moe=True)
    # A deeper, wider vision tower than the parity fixtures': shape needs more than colour.
    v = cfg.vision_config
    v.depth, v.hidden_size, v.num_heads, v.intermediate_size = 4, 128, 4, 256
    if init is None:
        model = Qwen3_5MoeForConditionalGeneration(cfg)
    else:  # a further stage: start from an earlier run's weights
        model = Qwen3_5MoeForConditionalGeneration.from_pretrained(init, dtype=torch.float32)
    linear_patch_embed(model.model.visual.patch_embed)
    return model, AutoProcessor.from_pretrained(out)


def linear_patch_embed(pe) -> None:
    """Trains the patch embedding as the matmul it is: a Conv3d whose stride equals its kernel over
    rows that are already one patch each. The same weights and the same function (the saved model keeps
    the Conv3d layout), but oneDNN's Conv3d backward took 19% of a joint step on this 2-core machine."""
    w = pe.proj.weight

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        x = hidden_states.reshape(-1, w[0].numel()).to(w.dtype)
        return torch.nn.functional.linear(x, w.reshape(w.shape[0], -1), pe.proj.bias)

    pe.forward = forward


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=pathlib.Path, required=True)
    ap.add_argument("--steps", type=int, default=5000)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmup", type=int, default=10000, help="vision-only curriculum steps")
    ap.add_argument("--eval", type=int, default=50, help="held-out prompts per task")
    ap.add_argument("--init", type=pathlib.Path, help="start from this earlier run's model and MTP head")
    ap.add_argument("--tasks", default="one,two,two,video,text", help="the joint phase's task mix, per batch")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model, proc = build(args.out, args.seed, args.init)
    model.train()
    t0 = time.time()
    if args.warmup:
        warm_up_vision(model, proc, random.Random(args.seed + 2), args.warmup, args.batch, args.lr)
    torch.manual_seed(args.seed + 3)  # the head's own draws: the main model's are unchanged by it
    head = MtpHead(model)
    if args.init is not None:
        head.load_hub(load_file(args.init / "model.safetensors"))
    cap = Capture(model)
    opt = torch.optim.AdamW(list(model.parameters()) + list(head.parameters()), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.05)
    rng = random.Random(args.seed + 1)
    # Two images is the hardest task (0.82 held-out when it had a fifth of the batches): two fifths of the
    # batches by default.
    tasks = args.tasks.split(",")
    for step in range(args.steps):
        task = rng.choice(tasks)  # one task per batch: similar lengths, little padding
        batch = collate([encode(proc, sample(rng, task), thinking=rng.random() < 0.5, with_answer=True)
                         for _ in range(args.batch)])
        loss = model(**batch).loss
        head_loss = mtp_loss(head, model, cap, batch)
        opt.zero_grad()
        (loss + head_loss).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 25 == 0 or step == args.steps - 1:
            print(f"step {step} task {task} loss {loss.item():.4f} mtp {head_loss.item():.4f} "
                  f"{time.time() - t0:.0f}s", flush=True)
    save_with_head(model, head, args.out)
    acc = evaluate(model, proc, seed=10_000 + args.seed, per_task=args.eval)
    model.eval()
    acc["mtp_top1"] = mtp_accuracy(head, model, cap, proc, seed=10_000 + args.seed, per_task=args.eval)
    acc["steps"] = args.steps
    acc["train_seconds"] = round(time.time() - t0)
    (args.out / "accuracy.json").write_text(json.dumps(acc, indent=2) + "\n")
    print(json.dumps(acc))


if __name__ == "__main__":
    main()
