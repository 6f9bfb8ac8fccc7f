"""numpy reference for NVFP4 quantisation (the ModelOpt recipe, round-to-nearest-even), used to generate
fixtures/ref/nvfp4.safetensors, which `osprey quantize`'s Rust code must reproduce byte for byte.

  global = amax(W) / (6 * 448)          (float32)
  s_b    = e4m3(amax(block_b) / 6 / global)   per 16 values, round-to-nearest-even, saturating at 448
  q      = e2m1(clamp(w / (e4m3(s_b) * global), -6, 6))   round-to-nearest-even on the e2m1 grid
  packed = q[2j] | q[2j+1] << 4

Run: cd tools && ~/.cache/osprey/venv/bin/python nvfp4_ref.py
"""

import pathlib

import numpy as np
import torch
from safetensors.numpy import save_file

E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=np.float32)


def e4m3_table():
    codes = np.arange(0x7F, dtype=np.uint8)
    return torch.from_numpy(codes.copy()).view(torch.float8_e4m3fn).float().numpy()


def to_e4m3(x):
    table = e4m3_table()
    a = np.minimum(np.abs(x), np.float32(448.0))
    d = np.abs(a[..., None] - table[None, :])
    best = np.argmin(d + (np.arange(0x7F) % 2) * 0.0, axis=-1)
    # ties to the even code
    dmin = d.min(axis=-1, keepdims=True)
    cand = (d == dmin)
    even = cand & (np.arange(0x7F) % 2 == 0)
    best = np.where(even.any(-1), np.argmax(even, -1), np.argmax(cand, -1)).astype(np.uint8)
    sign = np.where(np.signbit(x), 0x80, 0).astype(np.uint8)
    return sign | best


def to_e2m1(x):
    a = np.minimum(np.abs(x), np.float32(6.0))
    d = np.abs(a[..., None] - E2M1[None, :])
    dmin = d.min(-1, keepdims=True)
    cand = d == dmin
    even = cand & (np.arange(8) % 2 == 0)
    mag = np.where(even.any(-1), np.argmax(even, -1), np.argmax(cand, -1)).astype(np.uint8)
    sign = np.where((x < 0) & (mag > 0), 8, 0).astype(np.uint8)
    return sign | mag


def quantize(w):
    w = w.astype(np.float32)
    rows, cols = w.shape
    amax = np.float32(np.abs(w).max())
    glob = amax / np.float32(6.0 * 448.0) if amax > 0 else np.float32(1.0)
    blocks = w.reshape(rows, cols // 16, 16)
    bmax = np.abs(blocks).max(-1)
    scales = to_e4m3(bmax / np.float32(6.0) / glob)
    denom = e4m3_table()[scales & 0x7F] * np.where(scales & 0x80, -1, 1).astype(np.float32) * glob
    q = np.where(denom[..., None] > 0, to_e2m1(blocks / np.where(denom > 0, denom, 1)[..., None]), 0).astype(np.uint8)
    q = q.reshape(rows, cols)
    packed = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)
    return packed, scales.astype(np.uint8), np.float32(glob)


def dequantize(packed, scales, glob):
    lo, hi = packed & 0x0F, packed >> 4
    q = np.stack([lo, hi], -1).reshape(packed.shape[0], -1)
    vals = E2M1[q & 7] * np.where(q & 8, -1, 1).astype(np.float32)
    s = e4m3_table()[scales & 0x7F] * np.float32(glob)
    return (vals.reshape(q.shape[0], -1, 16) * s[..., None]).reshape(q.shape).astype(np.float32)


def main():
    # torch's own float8_e4m3fn cast agrees with our encoder on a sweep (round-to-nearest-even).
    sweep = np.linspace(-500, 500, 20001, dtype=np.float32)
    ours = to_e4m3(sweep)
    theirs = torch.from_numpy(np.clip(sweep, -448, 448)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    assert (ours == theirs).all(), "e4m3 encoder disagrees with torch"
    rng = np.random.default_rng(7)
    a = rng.standard_normal((64, 128)).astype(np.float32) * 0.05
    b = (rng.standard_normal((8, 64)) * np.array([0, 1e-3, 1, 50], dtype=np.float32).repeat(16)).astype(np.float32)
    out = {}
    for name, w in [("a", a), ("b", b)]:
        packed, scales, glob = quantize(w)
        out[f"{name}.w"] = w
        out[f"{name}.packed"] = packed
        out[f"{name}.scales"] = scales
        out[f"{name}.global"] = np.array([glob], dtype=np.float32)
        out[f"{name}.dequant"] = dequantize(packed, scales, glob)
    path = pathlib.Path(__file__).resolve().parent.parent / "fixtures" / "ref" / "nvfp4.safetensors"
    save_file(out, str(path))
    print("wrote", path)


if __name__ == "__main__":
    main()
