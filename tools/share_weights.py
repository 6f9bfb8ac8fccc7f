"""No copy of the same weights twice under fixtures/models (issue 33: the tree must travel in 64 MiB).

A variant checkpoint (`-mtp`: the base plus an `mtp.*` head; `-fused`: the MoE base with its experts in
transformers' fused layout; `-sigmoid`: the `qwen4_exp` base under another config) repeats most of its
base's tensors. After the generators have written every directory whole (regen_fixtures.sh), this pass
rewrites each variant in the real Hugging Face sharded layout: `model.safetensors.index.json` and shards
`model-0000i-of-0000N.safetensors`, where a shard it shares with its base is a relative symbolic link to
the base's file (as the Hub cache links `snapshots/` to `blobs/`) and its own tensors are one shard of its
own. Files equal to the base's (tokenizer, template, processor config) become links too. A variant whose
every tensor is the base's is one link, `model.safetensors`.

A base shard is shared only when every tensor in it is in the variant with the same values: equal bytes,
or (the f32 fused directory) equal after a cast to the base's dtype that loses nothing, which this script
checks. So the MoE base is first split in two shards, the routed experts and the rest, and the fused
variant shares the rest. Loading a variant gives every tensor it had, value for value (the Rust tests
load each one against the same references as before).

    python share_weights.py   # after the generators; regen_fixtures.sh runs it
"""

import json
import os
import pathlib

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
MODELS = ROOT / "fixtures" / "models"

# The base checkpoints split before variants share them: name -> predicate of the second shard's tensors.
SPLIT = {"qwen3_5_moe-tiny": lambda name: ".mlp.experts." in name}
# variant -> base
VARIANTS = {
    "qwen3_5-tiny-mtp": "qwen3_5-tiny",
    "qwen3_5_moe-tiny-mtp": "qwen3_5_moe-tiny",
    "qwen3_5_moe-tiny-fused": "qwen3_5_moe-tiny",
    "qwen4_exp-tiny-sigmoid": "qwen4_exp-tiny",
}
SIDE_FILES = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json",
              "processor_config.json"]
INDEX = "model.safetensors.index.json"


def shard_name(i: int, n: int) -> str:
    return f"model-{i:05d}-of-{n:05d}.safetensors"


def read_dir(d: pathlib.Path) -> dict[str, dict[str, torch.Tensor]]:
    """Shard file name -> its tensors, for a single-file or sharded directory."""
    files = sorted({*json.loads((d / INDEX).read_text())["weight_map"].values()}) if (d / INDEX).exists() \
        else ["model.safetensors"]
    out = {}
    for f in files:
        with safe_open(d / f, "pt") as st:
            out[f] = {k: st.get_tensor(k) for k in st.keys()}
    return out


def write_index(d: pathlib.Path, shards: dict[str, dict[str, torch.Tensor]]) -> None:
    size = sum(t.numel() * t.element_size() for ts in shards.values() for t in ts.values())
    weight_map = {k: f for f, ts in shards.items() for k in ts}
    index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
    (d / INDEX).write_text(json.dumps(index, indent=2) + "\n")


def split_base(name: str, second) -> None:
    d = MODELS / name
    if (d / INDEX).exists():
        return
    with safe_open(d / "model.safetensors", "pt") as st:
        meta = st.metadata()
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    parts = [{k: t for k, t in tensors.items() if not second(k)}, {k: t for k, t in tensors.items() if second(k)}]
    shards = {shard_name(i + 1, 2): p for i, p in enumerate(parts)}
    for f, ts in shards.items():
        save_file(ts, d / f, metadata=meta)
    write_index(d, shards)
    (d / "model.safetensors").unlink()


def same(v: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether variant tensor v holds base tensor b's values (exactly, in b's dtype)."""
    if v.shape != b.shape:
        return False
    if v.dtype == b.dtype:
        return torch.equal(v, b)
    cast = v.to(b.dtype)
    return torch.equal(cast.to(v.dtype), v) and torch.equal(cast, b)


def link(target: pathlib.Path, at: pathlib.Path) -> None:
    at.unlink(missing_ok=True)
    os.symlink(os.path.relpath(target, at.parent), at)


def share(variant: str, base: str) -> None:
    d, bd = MODELS / variant, MODELS / base
    if (d / "model.safetensors").is_symlink() or (d / INDEX).exists():
        return
    with safe_open(d / "model.safetensors", "pt") as st:
        meta = st.metadata()
        own = {k: st.get_tensor(k) for k in st.keys()}
    base_shards = read_dir(bd)
    shared = [f for f, ts in base_shards.items() if all(k in own and same(own[k], t) for k, t in ts.items())]
    for f in shared:
        for k in base_shards[f]:
            del own[k]
    if not shared:
        raise SystemExit(f"{variant}: no shard of {base} to share")
    (d / "model.safetensors").unlink()
    if not own and len(shared) == len(base_shards) == 1 and not (bd / INDEX).exists():
        link(bd / "model.safetensors", d / "model.safetensors")
    else:
        n = len(shared) + (1 if own else 0)
        shards = {}
        for i, f in enumerate(shared):
            link(bd / f, d / shard_name(i + 1, n))
            shards[shard_name(i + 1, n)] = base_shards[f]
        if own:
            save_file(own, d / shard_name(n, n), metadata=meta)
            shards[shard_name(n, n)] = own
        write_index(d, shards)
    for f in SIDE_FILES:
        if (d / f).is_file() and (bd / f).is_file() and (d / f).read_bytes() == (bd / f).read_bytes():
            link(bd / f, d / f)


def main():
    for name, second in SPLIT.items():
        split_base(name, second)
    for variant, base in VARIANTS.items():
        share(variant, base)
        print(variant, "->", base, sorted(p.name for p in (MODELS / variant).iterdir()))


if __name__ == "__main__":
    main()
