"""Builders for tiny seeded random-weight Qwen3.5 checkpoints (complete Hugging Face model directories).

Everything here is deterministic: the tokenizer is trained on a pinned corpus (transformers' own qwen
sources, which the pinned transformers version fixes) and every parameter is overwritten from a seeded
torch.Generator. See ../../shared/REFERENCE.md section 1 for the facts this follows.
"""

import json
import math
import pathlib

import torch
import transformers
from safetensors.torch import load_file, save_file
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

# Qwen specials in the real order; ids start at 992 (real id = tiny id + 247052).
SPECIALS = [
    ("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True),
    ("<|object_ref_start|>", True), ("<|object_ref_end|>", True), ("<|box_start|>", True), ("<|box_end|>", True),
    ("<|quad_start|>", True), ("<|quad_end|>", True), ("<|vision_start|>", True), ("<|vision_end|>", True),
    ("<|vision_pad|>", True), ("<|image_pad|>", True), ("<|video_pad|>", True),
    ("<tool_call>", False), ("</tool_call>", False), ("<|fim_prefix|>", False), ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False), ("<|fim_pad|>", False), ("<|repo_name|>", False), ("<|file_sep|>", False),
    ("<tool_response>", False), ("</tool_response>", False), ("<think>", False), ("</think>", False),
]
BPE_VOCAB = 992
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# A minimal chat template of our own with the official layout (no tools): see REFERENCE.md section 5.
CHAT_TEMPLATE = (pathlib.Path(__file__).parent / "chat_template.jinja").read_text()


def build_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    corpus_dir = pathlib.Path(transformers.__file__).parent / "models"
    files = sorted(str(p) for p in corpus_dir.glob("qwen*/*.py"))
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB, min_frequency=2, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train(files, trainer)
    assert tok.get_vocab_size() == BPE_VOCAB, tok.get_vocab_size()
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in SPECIALS])
    return tok


def text_config(moe: bool) -> dict:
    cfg = dict(
        vocab_size=1024, hidden_size=128, num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True},
        linear_num_key_heads=2, linear_key_head_dim=32, linear_num_value_heads=4, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=4096,
        eos_token_id=994, pad_token_id=992, bos_token_id=None,
    )
    if moe:
        cfg.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64)
    else:
        cfg.update(intermediate_size=256)
    return cfg


VISION_CONFIG = dict(depth=2, hidden_size=64, num_heads=2, intermediate_size=128, patch_size=16,
                     spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=64, out_hidden_size=128)


def model_config(moe: bool):
    if moe:
        from transformers import Qwen3_5MoeConfig as C
    else:
        from transformers import Qwen3_5Config as C
    return C(text_config=text_config(moe), vision_config=dict(VISION_CONFIG), image_token_id=1004,
             video_token_id=1005, vision_start_token_id=1001, vision_end_token_id=1002, tie_word_embeddings=False)


@torch.no_grad()
def randomize_(model: torch.nn.Module, seed: int) -> None:
    """Overwrite every parameter: HF's init leaves the (1+w) norms at identity, which would hide bugs."""
    g = torch.Generator().manual_seed(seed)
    for name, p in sorted(model.named_parameters()):
        leaf = name.rsplit(".", 1)[-1]
        mod = name.rsplit(".", 1)[0]
        if leaf == "A_log":
            p.copy_(torch.log(torch.rand(p.shape, generator=g) * 7.5 + 0.5))
        elif leaf == "dt_bias":
            p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
        elif "embed_tokens" in mod or "pos_embed" in mod:
            p.copy_(torch.randn(p.shape, generator=g))
        elif leaf == "bias":
            p.copy_(0.1 * torch.randn(p.shape, generator=g))
        elif p.ndim == 1:
            # Zero-centred RMSNorms compute x*(1+w); RMSNormGated / LayerNorm compute x*w.
            zero_centred = mod.endswith(("layernorm", "q_norm", "k_norm")) or mod.endswith("language_model.norm") \
                or mod == "model.norm"
            base = 0.0 if zero_centred else 1.0
            p.copy_(base + 0.1 * torch.randn(p.shape, generator=g))
        else:
            fan_in = math.prod(p.shape[1:]) if p.ndim > 1 else p.shape[0]
            if name.endswith("experts.gate_up_proj") or name.endswith("experts.down_proj"):
                fan_in = p.shape[-1]
            p.copy_(torch.randn(p.shape, generator=g) / math.sqrt(fan_in))


def fuse_hub_experts(sd: dict, prefix: str, n: int) -> None:
    """In place: the Hub layout's one tensor per expert (`{prefix}{e}.gate_proj.weight`, `.up_proj`,
    `.down_proj`) to transformers' fused `{prefix}gate_up_proj` (gate rows first) and `{prefix}down_proj`."""
    sd[prefix + "gate_up_proj"] = torch.stack([torch.cat([sd.pop(f"{prefix}{e}.gate_proj.weight"),
                                                          sd.pop(f"{prefix}{e}.up_proj.weight")]) for e in range(n)])
    sd[prefix + "down_proj"] = torch.stack([sd.pop(f"{prefix}{e}.down_proj.weight") for e in range(n)])


def round_params_to_bf16_(model: torch.nn.Module) -> None:
    """Make every weight exactly representable in bf16, so a bf16 file and the f32 model agree bit for bit."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(torch.float32))


def convert_dir_to_bf16(d: pathlib.Path) -> None:
    for f in sorted(d.glob("*.safetensors")):
        tensors = load_file(f)
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in tensors.items()}, f,
                  metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (d / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def save_processor(d: pathlib.Path, tok: Tokenizer) -> None:
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        extra_special_tokens={"image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
                              "vision_bos_token": "<|vision_start|>", "vision_eos_token": "<|vision_end|>"},
    )
    image = Qwen2VLImageProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 65536, "longest_edge": 16777216},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5],
    )
    video = Qwen3VLVideoProcessor(
        patch_size=16, merge_size=2, temporal_patch_size=2, size={"shortest_edge": 4096, "longest_edge": 25165824},
        image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5], fps=2, min_frames=4, max_frames=768,
        do_sample_frames=True, cap_pixels_per_frame=False,
    )
    proc = Qwen3VLProcessor(image_processor=image, tokenizer=fast, video_processor=video, chat_template=CHAT_TEMPLATE)
    proc.save_pretrained(d)
    # Keep the template also beside the tokenizer config, where servers look first.
    (d / "chat_template.jinja").write_text(CHAT_TEMPLATE)
