"""Generate osprey's Qwen3.8-Flash-Next (`qwen4_exp`) reference fixtures with transformers 5.23.0 (CPU, f32, eager).

Writes, under fixtures/:
  models/qwen4_exp-tiny/          complete HF directory (Hub layout, bf16 weights): hyper-connections with 4
                                  streams, PLE on two linear layers, QSA with a budget smaller than the prompts,
                                  the silu output gate
  models/qwen4_exp-tiny-sigmoid/  the same weights with the sigmoid output gate and norm_topk_prob off
  ref/<model>/<case>.safetensors  reference tensors per case: text (`reference_case`) and gen_vision_fixtures.py's
                                  image / two-image / video / image+video cases (`media_case`, its media files)

The prompts are gen_fixtures.py's, so the tokenizer and chat template are the Qwen3.5 fixtures' own. Run:
tools/README.md. Deterministic: a second run in a new process writes byte-identical files.
"""

import argparse
import json
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache, PreTrainedTokenizerFast

import gen_vision_fixtures as gv

import tiny_ckpt
from gen_fixtures import CASES, N_GEN, split_points

ROOT = pathlib.Path(__file__).resolve().parent.parent


def text_config(gate: str, norm_topk: bool) -> dict:
    cfg = tiny_ckpt.text_config(moe=True)
    cfg.update(
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        hc_count=4, hc_lowrank=16,
        # One-indexed: the first and third layers (both linear).
        ple_layer_ids=[1, 3], ple_embed_dim=64, ple_conv_kernel_size=3, ngram_size=3, heads_per_ngram=2,
        ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128, seed=1234,
        # Budget 8 tokens in blocks of 4: the prompts (61 and 220 tokens) select among many blocks. 8 heads make
        # an all-zero relu score (a tie torch.topk breaks by its unstable selection) rare; `no_ties` checks.
        indexer_n_heads=8, indexer_kv_heads=1, indexer_head_dim=32, indexer_budget=8, indexer_compress_ratio=4,
        output_gate_type=gate, norm_topk_prob=norm_topk,
    )
    return cfg


def model_config(gate: str, norm_topk: bool):
    from transformers import Qwen4ExpConfig
    return Qwen4ExpConfig(text_config=text_config(gate, norm_topk), vision_config=dict(tiny_ckpt.VISION_CONFIG),
                          image_token_id=1004, video_token_id=1005, vision_start_token_id=1001,
                          vision_end_token_id=1002, tie_word_embeddings=False)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """tiny_ckpt's randomisation, then the new norms: every grouped RMSNorm here computes x*(1+w) (zero-centred),
    and the PLE conv starts non-zero (transformers initialises it to zero, which would hide the conv)."""
    tiny_ckpt.randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in sorted(model.named_parameters()):
        mod = name.rsplit(".", 1)[0]
        if p.ndim == 1 and mod.endswith(("hc_norm", "norm_key", "norm_query", "norm_conv", "q_layernorm",
                                         "k_layernorm", "q_norm", "k_norm")):
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif mod.endswith("ple.conv1d"):
            p.copy_(0.3 * torch.randn(p.shape, generator=g))


class no_ties:
    """Fails if any top-k during the block (QSA block selection, routing) has a tie or a near tie (relative
    gap under 1e-5) at its cutoff: torch breaks ties by an unstable selection, and a near tie is decided by
    float noise (two implementations differ by ~1e-6), so a reference with one would not be a fixed target."""

    worst = 1.0

    def __enter__(self):
        self.orig = torch.Tensor.topk

        def checked(t, k, dim=-1, *args, **kwargs):
            vals = t.sort(dim=dim, descending=True).values
            if k < t.shape[dim]:
                a, b = vals.narrow(dim, k - 1, 1), vals.narrow(dim, k, 1)
                # Float noise between two implementations is ~1e-6 relative: a closer call is a coin toss.
                gap = (a - b) / a.abs().clamp_min(1.0)
                no_ties.worst = min(no_ties.worst, float(gap.min()))
                assert not (gap < 1e-5).any(), f"a tie at a top-k cutoff (gap {float(gap.min()):.2e})"
            return self.orig(t, k, dim, *args, **kwargs)
        torch.Tensor.topk = checked
        return self

    def __exit__(self, *exc):
        torch.Tensor.topk = self.orig


@torch.no_grad()
def language_forward(model, ids, pos4, cache):
    lm = model.model.language_model
    emb = lm.embed_tokens(ids)
    out = lm(inputs_embeds=emb, ple_input_ids=ids, position_ids=pos4, past_key_values=cache, use_cache=True)
    return model.lm_head(out.last_hidden_state)


@torch.no_grad()
def greedy_steps(model, logits, cache, n, delta=0):
    """The engine-style decode after a prefill of `n` tokens whose last logits are `logits`: N_GEN greedy
    tokens, one forward each (mRoPE positions n + step, plus `delta` on the spatial axes after media).
    Returns the logits of every step and the ids chosen."""
    steps, gen = [], []
    for step in range(N_GEN):
        steps.append(logits[0].clone())
        nxt = int(logits[0].argmax())
        gen.append(nxt)
        p = torch.full((4, 1, 1), n + step)
        p[1:] += delta
        logits = language_forward(model, torch.tensor([[nxt]]), p, cache)[:, -1]
    return torch.stack(steps), gen


@torch.no_grad()
def reference_case(model, tok, messages) -> tuple[dict, dict]:
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt)])
    n = ids.shape[1]
    pos = torch.arange(n).view(1, 1, n).expand(4, 1, n)
    lm = model.model.language_model
    # Layer-internal references of one-shot prefill: each PLE layer's n-gram row ids [n, heads] (what the
    # table lookup receives) and the first layer's attention hyper-connection (block input [n, H] and
    # injection weights [n, hc]).
    captured, hooks = {}, []
    for i, layer in enumerate(lm.layers):
        if layer.ple is not None:
            hooks.append(layer.ple.ple_embedding.ngram_embedding.register_forward_pre_hook(
                lambda m, a, i=i: captured.__setitem__(f"ple_ids.{i}", a[0][0].clone()) and None))
    def hc0(module, args, out):  # returns None: the output stays as it is
        captured["hc0.block_input"], captured["hc0.inject"] = out[0][0].clone(), out[2][0].clone()
    hooks.append(lm.layers[0].attn_hyper_connection.register_forward_hook(hc0))
    full = lm(input_ids=ids, position_ids=pos, output_hidden_states=True)
    for h in hooks:
        h.remove()
    t = {"input_ids": ids[0].to(torch.int64), "all_logits": model.lm_head(full.last_hidden_state)[0].contiguous()}
    t.update({k: v.contiguous() for k, v in captured.items()})
    # hidden_states.0 is the embedding repeated into the hc streams [n, hc*H], .i the streams after layer i, and
    # the last one (in place of the last layer's streams) the mixer's output [n, H], which lm_head reads: there
    # is no final norm.
    for i, h in enumerate(full.hidden_states):
        t[f"hidden_states.{i}"] = h[0].clone().contiguous()

    # Engine-style loop: prefill, then greedy decode one token at a time.
    cache = DynamicCache(config=model.config.text_config)
    logits = language_forward(model, ids, pos, cache)[:, -1]
    t["step_logits"], gen = greedy_steps(model, logits, cache, n)
    t["generated_ids"] = torch.tensor(gen, dtype=torch.int64)
    assert (t["step_logits"][0] - t["all_logits"][-1]).abs().max() < 1e-4

    # Chunked prefill: logits at the end of every chunk (splits cross QSA blocks and n-gram histories).
    splits = split_points(n)
    for name, ends in splits.items():
        cache = DynamicCache(config=model.config.text_config)
        start, rows = 0, []
        for end in ends:
            rows.append(language_forward(model, ids[:, start:end], pos[:, :, start:end], cache)[0, -1])
            start = end
        t[f"chunked.{name}"] = torch.stack(rows)
    meta = {"prompt": prompt, "len": n, "generated_ids": gen, "splits": splits}
    return t, meta


@torch.no_grad()
def media_case(model, proc, media, question) -> tuple[dict, dict]:
    """gen_vision_fixtures.model_case for qwen4_exp: the language model also gets the ids (PLE hashes them;
    at media positions it hashes the placeholder id, as transformers' multimodal forward does)."""
    from transformers.video_utils import VideoMetadata
    content = [{"type": kind} for kind, _ in media] + [{"type": "text", "text": question}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    images = [gv.load_image(n) for k, n in media if k == "image"] or None
    videos = [gv.load_video(n, gv.VIDEO_FRAMES[n]) for k, n in media if k == "video"] or None
    metas = [VideoMetadata(total_num_frames=gv.VIDEO_FRAMES[n], fps=2.0) for k, n in media if k == "video"] or None
    inputs = proc(text=[prompt], images=images, videos=videos, video_metadata=metas, return_tensors="pt")
    ids = inputs["input_ids"]
    n = ids.shape[1]
    cfg, m = model.config, model.model
    m.rope_deltas = None
    full = model(**inputs, output_hidden_states=True)
    pos3, delta = m.get_rope_index(ids, inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
                                   video_grid_thw=inputs.get("video_grid_thw"))
    t = {"input_ids": ids[0], "all_logits": full.logits[0], "position_ids": pos3[:, 0], "rope_delta": delta.reshape(1)}
    for i, hs in enumerate(full.hidden_states):
        t[f"hidden_states.{i}"] = hs[0].clone()
    emb = m.get_input_embeddings()(ids)
    if "pixel_values" in inputs:
        img = torch.cat(m.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        emb = emb.masked_scatter((ids == cfg.image_token_id).unsqueeze(-1), img)
    if "pixel_values_videos" in inputs:
        vid = torch.cat(m.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output)
        emb = emb.masked_scatter((ids == cfg.video_token_id).unsqueeze(-1), vid)
    pos4 = torch.cat([torch.arange(n).view(1, 1, n), pos3], 0)

    def lm(e, i, p, cache):
        out = m.language_model(inputs_embeds=e, ple_input_ids=i, position_ids=p, past_key_values=cache, use_cache=True)
        return model.lm_head(out.last_hidden_state)

    cache = DynamicCache(config=cfg.text_config)
    logits = lm(emb, ids, pos4, cache)[:, -1]
    assert (logits[0] - t["all_logits"][-1]).abs().max() < 1e-4
    steps, gen = greedy_steps(model, logits, cache, n, int(delta))
    t["step_logits"], t["generated_ids"] = steps, torch.tensor(gen)
    m.rope_deltas = None
    g = model.generate(**inputs, max_new_tokens=N_GEN, do_sample=False)
    assert g[0, n:].tolist() == gen, (g[0, n:].tolist(), gen)
    spans = gv.placeholder_spans(ids[0].tolist(), cfg.image_token_id, cfg.video_token_id)
    meta = {"prompt": prompt, "len": n, "generated_ids": gen, "splits": gv.split_points(n, spans), "spans": spans,
            "media": [list(x) for x in media], "question": question, "rope_delta": int(delta)}
    return {k: v.contiguous() for k, v in t.items()}, meta


def build(out, tok_obj, name, gate, norm_topk, seed):
    """One model and its references; raises AssertionError if a reference run has a (near) tie."""
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(model_config(gate, norm_topk), dtype=torch.float32,
                                                    attn_implementation="eager")
    randomize_(model, seed)
    tiny_ckpt.round_params_to_bf16_(model)
    d = out / "models" / name
    shutil.rmtree(d, ignore_errors=True)
    model.save_pretrained(d)
    tiny_ckpt.convert_dir_to_bf16(d)
    tiny_ckpt.save_processor(d, tok_obj)
    tok = PreTrainedTokenizerFast.from_pretrained(d)
    model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ref = out / "ref" / name
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    summary = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "seed": seed,
               "cases": {}}
    proc = AutoProcessor.from_pretrained(d)
    cases = [(c, lambda m=m: reference_case(model, tok, m)) for c, m in CASES.items()]
    cases += [(c, lambda mq=mq: media_case(model, proc, *mq)) for c, mq in gv.CASES.items()]
    for case, run in cases:
        with no_ties():
            tensors, meta = run()
        save_file(tensors, ref / f"{case}.safetensors", metadata={"prompt": meta["prompt"]})
        summary["cases"][case] = meta
        print(name, case, meta["len"], meta.get("rope_delta", 0), meta["generated_ids"])
    (ref / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "fixtures"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = pathlib.Path(args.out)
    tok_obj = tiny_ckpt.build_tokenizer()
    # Both models get the same weights (the same seed): they differ in their config alone, so
    # share_weights.py makes the sigmoid directory's weights a link to the silu one's. A seed whose reference
    # runs have a near tie at a QSA cutoff, in either model, is skipped for the next (deterministic: the same
    # seeds are tried in the same order every run); the seed used is in summary.json.
    for attempt in range(20):
        seed = 777 + 1000 * attempt
        try:
            build(out, tok_obj, "qwen4_exp-tiny", "silu", True, seed)
            build(out, tok_obj, "qwen4_exp-tiny-sigmoid", "sigmoid", False, seed)
            break
        except AssertionError as e:
            print("seed", seed, "skipped:", e)
    else:
        raise SystemExit("no seed without near ties")

if __name__ == "__main__":
    main()
