"""Keep in fixtures/ref what a test reads, and nothing more (issue 33: the tree must travel in 64 MiB).

The generators (gen_fixtures.py, gen_vision_fixtures.py, gen_nvfp4_fixtures.py, gen_mtp_fixtures.py,
gen_qwen4_fixtures.py) record every tensor of a reference run, and check their own runs against the full
tensors; this pass, run last by regen_fixtures.sh, rewrites each reference file by the table `RULES`:

- drop: tensors that no test reads (the comments in `RULES` say why each is not needed). The f32
  `all_logits` of the Qwen3.5 references: free-running prompt logits are compared with transformers in
  float64 (`all_logits_f64`, tools/README.md "Conditioning"); the MTP reference's `main_logits` (the
  head's test reads the main model's hidden states, not its logits). Which tensors the tests read is
  measured: `OSPREY_FIXTURE_READS=/tmp/reads tools/test_loop.sh -n 1` logs every reference tensor the
  shared test helpers read (crates/models/tests/common/mod.rs).
- rows: full-sequence tensors of free-running comparisons (each position computed from osprey's own
  earlier positions, so any subset of positions can be checked) keep the rows at `check_rows(n, ...)`, and
  `<name>.rows` (int64) says which. Teacher-forced inputs (`hidden_states.0..L-1` of Qwen3.5, the MTP
  head's `main_hidden`) stay whole: the next layer reads every position of them.

The rows: every 13th position from 0 (13 is coprime with the QSA block of 4 and the Gated DeltaNet chunk of
64, so over a prompt every offset within a block and a chunk is sampled), the last 4 positions (decode
continues from there), both sides of every 64-token chunk edge, and the first and last rows of every
media span with their neighbours. A bug that moves every position (a wrong norm, rope axis, gate) shows at
every row; one tied to a boundary (a chunk carry, a span edge, a block selection) shows at its edge rows.

Idempotent: a file that already has `.rows` tensors, or lacks what a rule drops, is left as it is, so the
pass can be rerun. Deterministic: it writes tensors in safetensors' own order, with the file's metadata.

    python trim_refs.py            # rewrite fixtures/ref in place
    python trim_refs.py --dry-run  # print the sizes before and after, write nothing
"""

import argparse
import json
import pathlib
import re

import torch
from safetensors import safe_open
from safetensors.torch import save_file

ROOT = pathlib.Path(__file__).resolve().parent.parent
QWEN35 = r"(?:qwen3_5-tiny|qwen3_5_moe-tiny|qwen3_5_moe-tiny-nvfp4)"
QWEN4 = r"(?:qwen4_exp-tiny|qwen4_exp-tiny-sigmoid)"
MTP = r"(?:qwen3_5-tiny-mtp|qwen3_5_moe-tiny-mtp)"

# (reference directory or directory/case, tensor name, action): full-match regular expressions; the first
# rule that matches decides.
RULES = [
    (QWEN35, r"all_logits", "drop"),
    (QWEN35, r"all_logits_f64", "rows"),
    (QWEN35, r"hidden_states\.4", "rows"),  # the last, normed output: compared, never fed to a layer
    (r"qwen3_5_moe-tiny-nvfp4", r"chunked\..*", "drop"),  # the NVFP4 test checks one-shot and decode
    (QWEN4, r"hc0\..*", "drop"),  # the first hyper-connection's parts: checked through the streams
    (r"qwen4_exp-tiny-sigmoid", r"ple_ids\.\d+", "drop"),  # n-gram ids: the config's, read on the silu model
    # image_video: the stream test covers image, two images and video; this case is read for its ids,
    # positions, decode logits and greedy ids (tests/osprey/multimodal.rs).
    (QWEN4 + r"/image_video", r"all_logits|hidden_states\.\d+", "drop"),
    (QWEN4, r"all_logits", "rows"),
    (QWEN4, r"hidden_states\.\d+", "rows"),  # compared free-running (crates/models/tests/models/qwen4_exp.rs)
    (MTP, r"main_logits", "drop"),
    (MTP, r"mtp\.(fc|layer|out|logits)", "rows"),
]

STRIDE, TAIL, CHUNK = 13, 4, 64


def check_rows(n: int, spans=()) -> list[int]:
    """The positions kept of an n-position tensor (see the module docstring)."""
    rows = set(range(0, n, STRIDE)) | set(range(max(0, n - TAIL), n))
    for edge in range(CHUNK, n, CHUNK):
        rows |= {edge - 1, edge}
    for start, end in spans:
        rows |= {start - 1, start, end - 1, end}
    return sorted(r for r in rows if 0 <= r < n)


def action(ref_dir: str, case: str, name: str):
    for d, t, what in RULES:
        if (re.fullmatch(d, ref_dir) or re.fullmatch(d, f"{ref_dir}/{case}")) and re.fullmatch(t, name):
            return what
    return None


def trim_file(path: pathlib.Path, meta: dict, write: bool) -> tuple[int, int]:
    """Rewrites one reference file by RULES; returns its (old, new) size in bytes."""
    old = path.stat().st_size
    with safe_open(path, "pt") as f:
        names = list(f.keys())
        if any(n.endswith(".rows") for n in names):
            return old, old
        metadata = f.metadata()
        tensors = {n: f.get_tensor(n) for n in names}
    spans = [tuple(s) for s in meta.get("spans", [])]
    out, changed = {}, False
    for name, t in tensors.items():
        what = action(path.parent.name, path.stem, name)
        if what == "drop":
            changed = True
        elif what == "rows":
            rows = check_rows(t.shape[0], spans)
            out[name] = t[rows].contiguous()
            out[name + ".rows"] = torch.tensor(rows, dtype=torch.int64)
            changed = True
        else:
            out[name] = t
    if not changed:
        return old, old
    tmp = path.with_suffix(".trim.tmp")
    save_file(out, tmp, metadata=metadata)
    new = tmp.stat().st_size
    if write:
        tmp.replace(path)
    else:
        tmp.unlink()
    return old, new


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--ref", default=str(ROOT / "fixtures" / "ref"))
    args = ap.parse_args()
    total_old = total_new = 0
    for d in sorted(p for p in pathlib.Path(args.ref).iterdir() if p.is_dir()):
        summary = json.loads((d / "summary.json").read_text())
        for f in sorted(d.glob("*.safetensors")):
            old, new = trim_file(f, summary["cases"].get(f.stem, {}), not args.dry_run)
            total_old, total_new = total_old + old, total_new + new
            if old != new:
                print(f"{d.name}/{f.name}: {old} -> {new}")
    print(f"per-model references: {total_old} -> {total_new} bytes")


if __name__ == "__main__":
    main()
