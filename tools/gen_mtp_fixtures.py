"""Multi-token-prediction (MTP) head fixtures: tiny Qwen3.5 checkpoints that carry an `mtp.*` head, and a
PyTorch reference of that head (transformers 5.23.0 has none: it skips `mtp.*` on load).

The head, as vLLM's `qwen3_5_mtp.py` / `qwen3_next_mtp.py` describe it (read, not copied):
  e = pre_fc_norm_embedding(embed_tokens(token))       # the main model's embedding, shared
  h = pre_fc_norm_hidden(hidden)                       # the main model's last hidden state, after its norm
  x = fc(concat(e, h))                                 # [2H] -> [H], no bias
  x = decoder_layer(x)                                 # one full-attention layer of the family (MLP or MoE)
  out = norm(x); logits = lm_head(out)                 # zero-centred RMSNorms; the main lm_head, shared
Entry i of a sequence pairs token i+1 with the main model's hidden state at i, at position i, so the
head predicts token i+2. Drafting chains the head: step j+1 pairs its draft with step j's normed output.

Writes, under fixtures/:
  models/<name>-mtp/   the tiny checkpoint of <name> (same weights, same files) plus seeded `mtp.*`
                       tensors (bf16) and `mtp_num_hidden_layers: 1`
  ref/<name>-mtp/<case>.safetensors  per case: ids, the main model's normed hidden states, and for every
                       entry the head's fc output, layer output, normed output and logits; a greedy draft
                       chain of DRAFT steps from the end of the sequence

Run (tools/README.md): cd tools && ~/.cache/osprey/venv/bin/python gen_mtp_fixtures.py
Deterministic: a second run writes byte-identical files.
"""

import json
import pathlib
import shutil

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForImageTextToText

import tiny_ckpt

ROOT = pathlib.Path(__file__).resolve().parent.parent
DRAFT = 4
SEEDS = {"qwen3_5-tiny": 777, "qwen3_5_moe-tiny": 778}


def zc_norm(x, w, eps):
    """Zero-centred RMSNorm x̂·(1+w), as Qwen3_5(Moe)RMSNorm."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.float())


def head_tensors(name: str, moe: bool, tmp: pathlib.Path) -> dict:
    """Seeded `mtp.*` tensors: the decoder layer is built and saved by transformers itself (a one-layer
    full-attention model, Hub layout), then renamed; norms and fc are drawn like the rest."""
    seed = SEEDS[name]
    text = tiny_ckpt.text_config(moe)
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    if moe:
        from transformers import Qwen3_5MoeConfig as C
    else:
        from transformers import Qwen3_5Config as C
    cfg = C(text_config=text, vision_config=dict(tiny_ckpt.VISION_CONFIG), image_token_id=1004,
            video_token_id=1005, vision_start_token_id=1001, vision_end_token_id=1002, tie_word_embeddings=False)
    torch.manual_seed(seed)
    one = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32, attn_implementation="eager")
    tiny_ckpt.randomize_(one, seed)
    tiny_ckpt.round_params_to_bf16_(one)
    shutil.rmtree(tmp, ignore_errors=True)
    one.save_pretrained(tmp)
    saved = load_file(tmp / "model.safetensors")
    shutil.rmtree(tmp)
    pre = "model.language_model.layers.0."
    out = {"mtp.layers.0." + k[len(pre):]: v for k, v in saved.items() if k.startswith(pre)}
    g = torch.Generator().manual_seed(seed + 1)
    h = text["hidden_size"]
    for n in ["pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"]:
        out[f"mtp.{n}.weight"] = 0.1 * torch.randn(h, generator=g)
    out["mtp.fc.weight"] = torch.randn(h, 2 * h, generator=g) / (2 * h) ** 0.5
    return {k: v.to(torch.bfloat16) for k, v in sorted(out.items())}


def build_dir(name: str, moe: bool) -> pathlib.Path:
    src, dst = ROOT / "fixtures" / "models" / name, ROOT / "fixtures" / "models" / f"{name}-mtp"
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update(head_tensors(name, moe, ROOT / "fixtures" / f".tmp-{name}"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = 1
    (dst / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return dst


class Head(torch.nn.Module):
    """The MTP head over a loaded main model (f32), its layer built by transformers."""

    def __init__(self, model, d: pathlib.Path):
        super().__init__()
        from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as mm
        from transformers.models.qwen3_5 import modeling_qwen3_5 as md

        self.lm = model.model.language_model
        self.lm_head = model.lm_head
        tc = model.config.text_config
        layer_cfg = type(tc)(**{**tc.to_dict(), "layer_types": tc.layer_types + ["full_attention"],
                                "num_hidden_layers": tc.num_hidden_layers + 1})
        layer_cfg._attn_implementation = "eager"
        layer_cfg._experts_implementation = "eager"
        layer_cls = mm.Qwen3_5MoeDecoderLayer if "moe" in tc.model_type else md.Qwen3_5DecoderLayer
        self.layer = layer_cls(layer_cfg, tc.num_hidden_layers)
        w = {k: v.float() for k, v in load_file(d / "model.safetensors").items() if k.startswith("mtp.")}
        layer_sd = {k[len("mtp.layers.0."):]: v for k, v in w.items() if k.startswith("mtp.layers.0.")}
        # The Hub layout keeps one tensor per expert; the module fuses them (gate rows first).
        if "mlp.experts.0.gate_proj.weight" in layer_sd:
            tiny_ckpt.fuse_hub_experts(layer_sd, "mlp.experts.", tc.num_experts)
        missing, unexpected = self.layer.load_state_dict(layer_sd, strict=True), None
        assert not missing.missing_keys and not missing.unexpected_keys, missing
        self.w = w
        self.eps = tc.rms_norm_eps

    @torch.no_grad()
    def forward(self, tokens, hidden, pos3):
        """Entries (tokens[i], hidden[i]) at positions pos3[:, i]: every intermediate, causal over them."""
        n = tokens.shape[0]
        e = zc_norm(self.lm.embed_tokens(tokens), self.w["mtp.pre_fc_norm_embedding.weight"], self.eps)
        h = zc_norm(hidden, self.w["mtp.pre_fc_norm_hidden.weight"], self.eps)
        fc = torch.cat([e, h], dim=-1) @ self.w["mtp.fc.weight"].T
        x = fc[None]
        pe = self.lm.rotary_emb(x, pos3[:, None, :])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        y = self.layer(x, position_embeddings=pe, attention_mask=mask, position_ids=pos3[0][None])[0]
        out = zc_norm(y, self.w["mtp.norm.weight"], self.eps)
        return {"fc": fc, "layer": y, "out": out, "logits": self.lm_head(out)}


@torch.no_grad()
def reference(model, head, ids) -> dict:
    n = ids.shape[0]
    pos4 = torch.arange(n).view(1, 1, n).expand(4, 1, n)
    hid = model.model.language_model(input_ids=ids[None], position_ids=pos4).last_hidden_state[0]
    main_logits = model.lm_head(hid)
    # Entries 0..n-2 pair token i+1 with hidden i; the last entry pairs the main model's greedy next token.
    nxt = int(main_logits[-1].argmax())
    tokens = torch.cat([ids[1:], torch.tensor([nxt])])
    pos3 = torch.arange(n).view(1, n).expand(3, n)
    r = head(tokens, hid, pos3)
    t = {"input_ids": ids, "next_token": torch.tensor([nxt]), "main_hidden": hid, "main_logits": main_logits,
         "mtp_tokens": tokens, **{f"mtp.{k}": v.contiguous() for k, v in r.items()}}
    # Greedy draft chain from the end: step 0 is the last entry above; step j+1 pairs step j's draft with
    # step j's normed output, at the next position, attending to every earlier entry.
    toks, hs, drafts, chain_logits = tokens.clone(), hid.clone(), [], []
    out, logits = r["out"][-1], r["logits"][-1]
    for j in range(DRAFT):
        d = int(logits.argmax())
        drafts.append(d)
        chain_logits.append(logits)
        toks = torch.cat([toks, torch.tensor([d])])
        hs = torch.cat([hs, out[None]])
        m = toks.shape[0]
        rr = head(toks, hs, torch.arange(m).view(1, m).expand(3, m))
        out, logits = rr["out"][-1], rr["logits"][-1]
    t["draft_ids"] = torch.tensor(drafts, dtype=torch.int64)
    t["draft_logits"] = torch.stack(chain_logits).contiguous()
    return t


def main():
    torch.set_num_threads(2)
    for name, moe in [("qwen3_5-tiny", False), ("qwen3_5_moe-tiny", True)]:
        d = build_dir(name, moe)
        model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager",
                                                            experts_implementation="eager").eval()
        head = Head(model, d).eval()
        ref = ROOT / "fixtures" / "ref" / f"{name}-mtp"
        shutil.rmtree(ref, ignore_errors=True)
        ref.mkdir(parents=True)
        summary = {"transformers": __import__("transformers").__version__, "torch": torch.__version__, "cases": {}}
        for case in ["text", "long"]:
            base = load_file(ROOT / "fixtures" / "ref" / name / f"{case}.safetensors")
            ids = torch.cat([base["input_ids"], base["generated_ids"]])
            t = reference(model, head, ids)
            save_file(t, ref / f"{case}.safetensors")
            summary["cases"][case] = {"len": int(ids.shape[0]), "draft_ids": t["draft_ids"].tolist()}
            print(name, case, ids.shape[0], t["draft_ids"].tolist())
        (ref / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
