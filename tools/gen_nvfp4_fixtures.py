"""Reference logits for the NVFP4 tiny model: transformers 5.23 (f32) on qwen3_5_moe-tiny with every routed
expert replaced by dequantise(quantise(w)) from nvfp4_ref.py (byte-identical to `osprey quantize`).
Writes fixtures/ref/qwen3_5_moe-tiny-nvfp4/{text,long}.safetensors + summary.json.

Run after gen_fixtures.py: cd tools && ~/.cache/osprey/venv/bin/python gen_nvfp4_fixtures.py
"""

import json
import pathlib
import shutil

import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, PreTrainedTokenizerFast

import nvfp4_ref
from gen_fixtures import CASES, reference_case

ROOT = pathlib.Path(__file__).resolve().parent.parent


def qdq(w):
    packed, scales, glob = nvfp4_ref.quantize(w.numpy())
    return torch.from_numpy(nvfp4_ref.dequantize(packed, scales, glob))


@torch.no_grad()
def dequantised(model):
    for layer in model.model.language_model.layers:
        ex = layer.mlp.experts
        inter = ex.gate_up_proj.shape[1] // 2
        for e in range(ex.gate_up_proj.shape[0]):
            ex.gate_up_proj[e, :inter] = qdq(ex.gate_up_proj[e, :inter])
            ex.gate_up_proj[e, inter:] = qdq(ex.gate_up_proj[e, inter:])
            ex.down_proj[e] = qdq(ex.down_proj[e])
    return model


def main():
    torch.set_num_threads(2)
    d = ROOT / "fixtures" / "models" / "qwen3_5_moe-tiny"
    model = dequantised(AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager"))
    model.eval()
    model64 = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float64, attn_implementation="eager",
                                                          experts_implementation="eager").eval()
    model64.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    tok = PreTrainedTokenizerFast.from_pretrained(d)
    ref = ROOT / "fixtures" / "ref" / "qwen3_5_moe-tiny-nvfp4"
    shutil.rmtree(ref, ignore_errors=True)
    ref.mkdir(parents=True)
    summary = {"note": "routed experts NVFP4 (tools/nvfp4_ref.py), dequantised, f32 transformers", "cases": {}}
    for case in ["text", "long"]:
        tensors, meta = reference_case(model, tok, CASES[case], model64)
        save_file(tensors, ref / f"{case}.safetensors", metadata={"prompt": meta["prompt"]})
        summary["cases"][case] = meta
        print(case, meta["len"], meta["generated_ids"])
    (ref / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
