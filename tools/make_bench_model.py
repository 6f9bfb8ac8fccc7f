"""Build a random-weight qwen3_5_moe text checkpoint for speed measurements (never committed).

Presets:
  mid        hidden 1024, 8 layers (3:1 linear/full), 64 experts top-8, moe_intermediate 512 (~1.9 GB bf16)
  q35moe-L4  ../shared/BENCHMARKS.md's speed checkpoint: Qwen3.5-35B-A3B layer shapes, one 3:1 period (~7 GB)
  vision-mid a multimodal qwen3_5_moe with a mid-size vision tower (depth 8, hidden 512, 8 heads, MLP 2048,
             48x48 position table) and a small text model, with tokenizer and processor (for bench vision)

Run: tools/README.md. Weights are O(1)-scaled (N(0, 1/fan_in)) and made directly in bf16 so the 7 GB
preset fits in RAM.
"""

import argparse
import pathlib

import torch
from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

import tiny_ckpt

PRESETS = {
    "mid": dict(hidden_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=256,
                linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                num_experts=64, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                vocab_size=32768),
    "q35moe-L4": dict(hidden_size=2048, num_hidden_layers=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                      linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
                      linear_value_head_dim=128, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, vocab_size=32768),
}


def build_vision_mid(out, seed):
    from transformers import AutoModelForImageTextToText, Qwen3_5MoeConfig

    text = tiny_ckpt.text_config(moe=True)
    text.update(hidden_size=1024)
    vision = dict(depth=8, hidden_size=512, num_heads=8, intermediate_size=2048, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, num_position_embeddings=2304, out_hidden_size=1024)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=1004, video_token_id=1005,
                           vision_start_token_id=1001, vision_end_token_id=1002, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = AutoModelForImageTextToText.from_config(cfg, dtype=torch.float32)
    tiny_ckpt.randomize_(model, seed)
    model.save_pretrained(out)
    tiny_ckpt.save_processor(pathlib.Path(out), tiny_ckpt.build_tokenizer())
    print(f"vision-mid: vision tower {sum(p.numel() for p in model.model.visual.parameters()) / 1e6:.1f} M parameters")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS) + ["vision-mid"], default="mid")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if args.preset == "vision-mid":
        return build_vision_mid(args.out, args.seed)
    p = PRESETS[args.preset]
    n = p["num_hidden_layers"]
    cfg = Qwen3_5MoeTextConfig(
        **p, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768, eos_token_id=None,
        tie_word_embeddings=False,
    )
    torch.manual_seed(args.seed)
    model = Qwen3_5MoeForCausalLM(cfg).to(torch.bfloat16)
    tiny_ckpt.randomize_(model, args.seed)
    out = pathlib.Path(args.out)
    model.save_pretrained(out)
    # A tokenizer (the tiny test one) so llama.cpp's converter accepts the checkpoint
    # (tools/bench_peer.sh); only token ids are benchmarked.
    tiny_ckpt.save_processor(out, tiny_ckpt.build_tokenizer())
    total = sum(q.numel() for q in model.parameters())
    print(f"{args.preset}: {total / 1e9:.2f} B parameters written to {out}")


if __name__ == "__main__":
    main()
