"""Generate osprey's reference fixtures with transformers 5.23.0 (CPU, f32, eager attention).

Writes, under fixtures/:
  models/qwen3_5-tiny/          complete HF directory, Hub layout, bf16 weights
  models/qwen3_5_moe-tiny/      complete HF directory, Hub layout (one tensor per expert), bf16 weights
  models/qwen3_5_moe-tiny-fused/ the same MoE weights in the runtime (fused) layout, f32
  ref/<model>/<case>.safetensors reference tensors per case; ref/<model>/summary.json metadata

Run: tools/README.md. Deterministic: a second run in a new process writes byte-identical files.
"""

import argparse
import json
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, DynamicCache, PreTrainedTokenizerFast

import tiny_ckpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
N_GEN = 8

CASES = {
    "text": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "Describe the weather in Paris in one sentence."},
    ],
    # Long enough to cross the 64-token chunk boundary of the Gated DeltaNet chunked kernel twice.
    "long": [
        {"role": "system", "content": "You are a careful assistant that answers questions about source code."},
        {"role": "user", "content": "What does the function get_rope_index compute for a prompt with images?"},
        {"role": "assistant", "content": "<think>\nThe user asks about positions.\n</think>\n\nIt returns "
                                         "three position rows (temporal, height, width) and a delta per sequence."},
        {"role": "user", "content": "And how are the rotary frequencies split between the three axes when "
                                    "mrope_interleaved is set? Please explain the interleaving with an example "
                                    "of the first twelve frequencies, and say what happens to text tokens."},
    ],
}


def split_points(n: int) -> dict:
    """Chunk boundaries (exclusive ends) for the chunked-prefill references."""
    return {
        "halves": [n // 2, n],
        "one_k_one_rest": [1, 1 + n // 3, 2 + n // 3, n],
        "ragged": sorted({e for e in (7, 31, 64, 65, n - 1, n) if 0 < e <= n}),
    }


@torch.no_grad()
def language_forward(model, emb, pos4, cache):
    out = model.model.language_model(inputs_embeds=emb, position_ids=pos4, past_key_values=cache, use_cache=True)
    return model.lm_head(out.last_hidden_state)


@torch.no_grad()
def f64_logits(model64, emb, pos4):
    """All prompt logits of transformers in float64 on the same input embeddings: the rounding-free
    reference for free-running comparisons (REFERENCE.md section 6: f32 noise compounds through layers)."""
    out = model64.model.language_model(inputs_embeds=emb.double(), position_ids=pos4)
    return model64.lm_head(out.last_hidden_state)[0].float().contiguous()


def load_f64(d):
    return AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float64, attn_implementation="eager",
                                                       experts_implementation="eager").eval()


@torch.no_grad()
def reference_case(model, tok, messages, model64) -> tuple[dict, dict]:
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok.encode(prompt)])
    n = ids.shape[1]
    tt = torch.zeros_like(ids)
    model.model.rope_deltas = None
    full = model(input_ids=ids, mm_token_type_ids=tt, output_hidden_states=True)
    t = {"input_ids": ids[0].to(torch.int64), "all_logits": full.logits[0].contiguous()}
    for i, h in enumerate(full.hidden_states):
        t[f"hidden_states.{i}"] = h[0].contiguous()

    # Engine-style loop (REFERENCE.md section 6): prefill, then greedy decode one token at a time. The logits of
    # each step are what a teacher-forced Rust run must reproduce.
    emb = model.model.get_input_embeddings()(ids)
    pos = torch.arange(n).view(1, 1, n).expand(4, 1, n)
    cache = DynamicCache(config=model.config.text_config)
    logits = language_forward(model, emb, pos, cache)[:, -1]
    steps, gen = [], []
    for step in range(N_GEN):
        steps.append(logits[0].clone())
        nxt = int(logits[0].argmax())
        gen.append(nxt)
        p = torch.full((4, 1, 1), n + step)
        logits = language_forward(model, model.model.get_input_embeddings()(torch.tensor([[nxt]])), p, cache)[:, -1]
    t["all_logits_f64"] = f64_logits(model64, emb, pos)
    t["step_logits"] = torch.stack(steps)
    t["generated_ids"] = torch.tensor(gen, dtype=torch.int64)
    assert torch.equal(t["step_logits"][0], t["all_logits"][-1]) or \
        (t["step_logits"][0] - t["all_logits"][-1]).abs().max() < 1e-4

    # generate() must agree with the manual loop (same ids).
    model.model.rope_deltas = None
    g = model.generate(input_ids=ids, mm_token_type_ids=tt, max_new_tokens=N_GEN, do_sample=False,
                       attention_mask=torch.ones_like(ids))
    assert g[0, n:].tolist() == gen, (g[0, n:].tolist(), gen)

    # Chunked prefill: logits at the end of every chunk.
    splits = split_points(n)
    for name, ends in splits.items():
        cache = DynamicCache(config=model.config.text_config)
        start, rows = 0, []
        for end in ends:
            rows.append(language_forward(model, emb[:, start:end], pos[:, :, start:end], cache)[0, -1])
            start = end
        t[f"chunked.{name}"] = torch.stack(rows)
    meta = {"prompt": prompt, "len": n, "generated_ids": gen, "splits": splits}
    return t, meta


def build_models(out: pathlib.Path, tok) -> dict:
    dirs = {}
    for name, moe, seed in [("qwen3_5-tiny", False, 1234), ("qwen3_5_moe-tiny", True, 4321)]:
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(tiny_ckpt.model_config(moe), dtype=torch.float32,
                                                        attn_implementation="eager")
        tiny_ckpt.randomize_(model, seed)
        tiny_ckpt.round_params_to_bf16_(model)
        d = out / "models" / name
        shutil.rmtree(d, ignore_errors=True)
        model.save_pretrained(d)
        tiny_ckpt.convert_dir_to_bf16(d)
        tiny_ckpt.save_processor(d, tok)
        dirs[name] = d
        if moe:
            fused = out / "models" / (name + "-fused")
            shutil.rmtree(fused, ignore_errors=True)
            model.save_pretrained(fused, save_original_format=False)
            tiny_ckpt.save_processor(fused, tok)
            dirs[name + "-fused"] = fused
    return dirs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "fixtures"))
    args = ap.parse_args()
    torch.set_num_threads(2)
    out = pathlib.Path(args.out)
    tok_obj = tiny_ckpt.build_tokenizer()
    dirs = build_models(out, tok_obj)
    for name in ["qwen3_5-tiny", "qwen3_5_moe-tiny"]:
        d = dirs[name]
        tok = PreTrainedTokenizerFast.from_pretrained(d)
        model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        model64 = load_f64(d)
        ref = out / "ref" / name
        shutil.rmtree(ref, ignore_errors=True)
        ref.mkdir(parents=True)
        summary = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "cases": {}}
        for case, messages in CASES.items():
            tensors, meta = reference_case(model, tok, messages, model64)
            save_file(tensors, ref / f"{case}.safetensors", metadata={"prompt": meta["prompt"]})
            summary["cases"][case] = meta
            print(name, case, meta["len"], meta["generated_ids"])
        (ref / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if name + "-fused" in dirs:
            fused = AutoModelForImageTextToText.from_pretrained(dirs[name + "-fused"], dtype=torch.float32,
                                                                attn_implementation="eager")
            ids = torch.tensor([tok.encode("layout check")])
            a = model(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
            b = fused(input_ids=ids, mm_token_type_ids=torch.zeros_like(ids)).logits
            print("fused vs hub max |d| =", float((a - b).abs().max()))


if __name__ == "__main__":
    main()
