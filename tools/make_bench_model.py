"""Build a random-weight qwen3_5_moe text checkpoint for speed measurements (never committed).

Presets:
  mid        hidden 1024, 8 layers (3:1 linear/full), 64 experts top-8, moe_intermediate 512 (~1.9 GB bf16)
  q35moe-L4  ../shared/BENCHMARKS.md's speed checkpoint: Qwen3.5-35B-A3B layer shapes, one 3:1 period (~7 GB)
  q4exp-L2   Qwen3.8-Flash-Next (qwen4_exp) layer shapes, one Gated DeltaNet + one QSA layer (~11 GB; see Q4EXP_L2)
  vision-mid a multimodal qwen3_5_moe with a mid-size vision tower (depth 8, hidden 512, 8 heads, MLP 2048,
             48x48 position table) and a small text model, with tokenizer and processor (for bench vision)
  q35moe-L4-vision  q35moe-L4's text model with a full-size vision tower (Qwen3-VL-30B-A3B's geometry: depth
             27, hidden 1152, 16 heads, MLP 4304, 48x48 position table, out 2048), with tokenizer and processor:
             the image + text TTFT of issue 38 (~7.8 GB)

Run: tools/README.md. Weights are O(1)-scaled (N(0, 1/fan_in)) and made directly in bf16 so the 7 GB
preset fits in RAM.
"""

import argparse
import math
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


# Qwen3.8-Flash-Next (qwen4_exp) layer shapes (issue 15: hidden 2560, 512 experts top-10 of width 640, a gated
# shared expert, 4 hyper-connection streams with rank 320, PLE with 3-grams in 8 heads per order), one
# Gated DeltaNet and one QSA attention layer, PLE on the first. The PLE table is the one part not at real
# size: ngram_vocab_size_base 100,000 instead of 20 M (16 heads x ~100 k rows x 160 dims, 0.5 GB in bf16
# instead of ~100 GB), so the checkpoint fits this machine's disk; the row reads per token are the real ones.
Q4EXP_L2 = dict(hidden_size=2560, num_hidden_layers=2, layer_types=["linear_attention", "full_attention"],
                num_attention_heads=20, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, num_experts=512,
                num_experts_per_tok=10, moe_intermediate_size=640, shared_expert_intermediate_size=640,
                vocab_size=32768, hc_count=4, hc_lowrank=320, ple_layer_ids=[1], ple_embed_dim=2560,
                ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=8, ngram_vocab_size_base=100_000,
                indexer_n_heads=16, indexer_kv_heads=1, indexer_head_dim=128, indexer_budget=2048,
                indexer_compress_ratio=64, output_gate_type="silu", norm_topk_prob=True)


def build_q4exp(out, seed):
    from transformers import Qwen4ExpForCausalLM, Qwen4ExpTextConfig

    cfg = Qwen4ExpTextConfig(
        **Q4EXP_L2, rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768, eos_token_id=994,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    # Built in bf16 (f32 would not fit in RAM), then every parameter overwritten as tiny_ckpt.randomize_
    # does, a row at a time for the big ones (one f32 copy of the experts would not fit either).
    torch.set_default_dtype(torch.bfloat16)
    model = Qwen4ExpForCausalLM(cfg)
    torch.set_default_dtype(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            leaf, mod = name.rsplit(".", 1)[-1], name.rsplit(".", 1)[0]
            if leaf == "A_log":
                p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7.5 + 0.5))
            elif leaf == "dt_bias":
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif "embed_tokens" in mod or "ngram_embedding" in mod:
                for row in p:
                    row.copy_(torch.randn(row.shape, generator=g))
            elif p.ndim == 1:
                # Every RMSNorm here is zero-centred (1 + w) but the Gated DeltaNet's output norm (x * w).
                base = 1.0 if mod.endswith("linear_attn.norm") else 0.0
                p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
            else:
                fan_in = p.shape[-1] if "experts" in name else math.prod(p.shape[1:])
                for row in p:
                    row.copy_(torch.randn(row.shape, generator=g) / math.sqrt(fan_in))
    model.save_pretrained(out)
    tiny_ckpt.save_processor(pathlib.Path(out), tiny_ckpt.build_tokenizer())
    total = sum(q.numel() for q in model.parameters())
    print(f"q4exp-L2: {total / 1e9:.2f} B parameters written to {out}")


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


def build_vision_l4(out, seed):
    from transformers import AutoModelForImageTextToText, Qwen3_5MoeConfig

    p = PRESETS["q35moe-L4"]
    n = p["num_hidden_layers"]
    text = dict(**p, layer_types=["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(n)],
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [11, 11, 10], "mrope_interleaved": True},
                linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=32768, eos_token_id=994,
                pad_token_id=992)
    vision = dict(depth=27, hidden_size=1152, num_heads=16, intermediate_size=4304, patch_size=16,
                  spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304, out_hidden_size=2048)
    cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vision, image_token_id=1004, video_token_id=1005,
                           vision_start_token_id=1001, vision_end_token_id=1002, tie_word_embeddings=False)
    torch.manual_seed(seed)
    # Made directly in bf16 (an f32 copy of the experts would not fit in RAM beside the bf16 one).
    torch.set_default_dtype(torch.bfloat16)
    model = AutoModelForImageTextToText.from_config(cfg)
    torch.set_default_dtype(torch.float32)
    tiny_ckpt.randomize_(model, seed)
    model.save_pretrained(out)
    tiny_ckpt.save_processor(pathlib.Path(out), tiny_ckpt.build_tokenizer())
    print(f"q35moe-L4-vision: vision tower {sum(p.numel() for p in model.model.visual.parameters()) / 1e6:.1f} M, "
          f"total {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", choices=sorted(PRESETS) + ["vision-mid", "q4exp-L2", "q35moe-L4-vision"], default="mid")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    if args.preset == "vision-mid":
        return build_vision_mid(args.out, args.seed)
    if args.preset == "q4exp-L2":
        return build_q4exp(args.out, args.seed)
    if args.preset == "q35moe-L4-vision":
        return build_vision_l4(args.out, args.seed)
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
