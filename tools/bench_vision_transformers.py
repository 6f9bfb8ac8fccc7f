"""The transformers side of `osprey bench vision`: same checkpoint, same synthetic image, same threads.

Times the image processor (resize, normalise, patchify) and the vision tower (`get_image_features`) in f32.
"""

import argparse
import json
import statistics
import time

import numpy as np
import torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor


def bench_image(w, h):
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([x * 255 // w, y * 255 // h, (x + y) * 7 % 256], -1).astype(np.uint8)
    return Image.fromarray(img, "RGB")


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--sizes", default="448x448,1024x768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = AutoModelForImageTextToText.from_pretrained(args.model, dtype=torch.float32)
    proc = AutoProcessor.from_pretrained(args.model)
    for size in args.sizes.split(","):
        w, h = map(int, size.split("x"))
        img = bench_image(w, h)
        pre, enc = [], []
        for rep in range(args.repeats + 1):
            t0 = time.perf_counter()
            out = proc.image_processor(images=[img], return_tensors="pt")
            t1 = time.perf_counter()
            model.model.get_image_features(out["pixel_values"], out["image_grid_thw"])
            t2 = time.perf_counter()
            if rep > 0:
                pre.append(t1 - t0)
                enc.append(t2 - t1)
        print(json.dumps({"engine": "transformers float32", "width": w, "height": h,
                          "grid": out["image_grid_thw"][0].tolist(), "preprocess_s": statistics.median(pre),
                          "encode_s": statistics.median(enc)}, indent=2))


if __name__ == "__main__":
    main()
