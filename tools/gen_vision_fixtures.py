"""Vision reference fixtures with transformers 5.23.0 (run after gen_fixtures.py, which builds the models).

Writes, under fixtures/:
  media/*.png, *.jpg           synthetic test images and video frames (deterministic)
  ref/preprocess.safetensors   per media item: `<name>.codes` (pixel rows as uint8 codes, see below) and
                               `<name>.grid`; plus ref/preprocess.json (parameters, timestamps, prompts)
  ref/<model>/<case>.safetensors  multimodal cases: ids, mm types, mRoPE positions, vision embeds,
                               hidden states, logits, teacher-forced steps, chunked-prefill logits

Pixel rows are stored as uint8 codes u with value = (u - 127.5) / 127.5 in f32, which is exactly how the
processor computes them from uint8 pixels (mean = std = 0.5); the generator asserts the round trip.
"""

import json
import pathlib

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText, AutoProcessor, DynamicCache
from transformers.video_utils import VideoMetadata

from gen_fixtures import f64_logits, load_f64

ROOT = pathlib.Path(__file__).resolve().parent.parent
FIX = ROOT / "fixtures"
MEDIA = FIX / "media"
N_GEN = 8


def synth(w, h, seed, alpha=False):
    """A deterministic image with smooth gradients, hard edges and noise (so resampling is exercised)."""
    rng = np.random.RandomState(seed)
    y, x = np.mgrid[0:h, 0:w]
    img = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 7) % 256], -1).astype(np.int32)
    cx, cy, r = rng.randint(0, w), rng.randint(0, h), max(2, min(w, h) // 3)
    img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.randint(0, 256, 3)
    img = np.clip(img + rng.randint(-20, 21, img.shape), 0, 255).astype(np.uint8)
    if alpha:
        a = ((x * 255) // max(w - 1, 1)).astype(np.uint8)[..., None]
        return Image.fromarray(np.concatenate([img, a], -1), "RGBA")
    return Image.fromarray(img, "RGB")


def make_media():
    MEDIA.mkdir(parents=True, exist_ok=True)
    items = {
        "img_224x160": synth(224, 160, 1),      # upscaled (below min_pixels)
        "img_256x256": synth(256, 256, 2),      # no resize
        "img_640x480": synth(640, 480, 3),      # downscaled with the small processor
        "img_1000x20": synth(1000, 20, 4),      # extreme aspect ratio (50:1)
        "img_rgba_64x64": synth(64, 64, 5, alpha=True),  # alpha composited on white, upscaled
    }
    for name, im in items.items():
        im.save(MEDIA / f"{name}.png")
    videos = {"vid4_160x224": (4, 224, 160, 10), "vid5_96x128": (5, 128, 96, 20)}  # frames, W, H, seed
    for name, (n, w, h, seed) in videos.items():
        for i in range(n):
            synth(w, h, seed + i).save(MEDIA / f"{name}_{i}.png")
    # A JPEG whose EXIF orientation (6 = rotate 90 CW) must be applied: stored 64x32, shown 32x64.
    exif = Image.Exif()
    exif[0x0112] = 6
    synth(64, 32, 9).save(MEDIA / "exif_rot6.jpg", quality=95, exif=exif)


def load_image(name):
    return Image.open(MEDIA / f"{name}.png")


def load_video(name, n):
    return np.stack([np.array(Image.open(MEDIA / f"{name}_{i}.png").convert("RGB")) for i in range(n)])


def codes(pixels):
    u = torch.round(pixels * 127.5 + 127.5)
    assert torch.equal((u - 127.5) / 127.5, pixels), "pixel values are not uint8 codes"
    return u.to(torch.uint8).contiguous()


def one_frame(codes_rows, temporal=2):
    """An image's patch rows keep one frame: the processor tiles an image over the temporal patch, so each row
    is (channel, frame, 16x16) with every frame equal (checked). [n, C*T*P*P] -> [n, C, P*P]; the test
    rebuilds the rows (crates/models/tests/models/vision.rs, `hf_pixels`)."""
    n = codes_rows.shape[0]
    x = codes_rows.view(n, 3, temporal, -1)
    assert all(torch.equal(x[:, :, 0], x[:, :, f]) for f in range(1, temporal)), "image frames differ"
    return x[:, :, 0].contiguous()


def preprocess_refs(proc):
    small = AutoProcessor.from_pretrained(FIX / "models" / "qwen3_5_moe-tiny").image_processor
    small.size = {"shortest_edge": 4096, "longest_edge": 65536}
    t, meta = {}, {"small_image_processor": small.size, "items": {}}
    for name in ["img_224x160", "img_256x256", "img_1000x20", "img_rgba_64x64"]:
        out = proc.image_processor(images=[load_image(name)], return_tensors="pt")
        t[f"{name}.codes_one_frame"] = one_frame(codes(out["pixel_values"]))
        t[f"{name}.grid"] = out["image_grid_thw"][0]
        meta["items"][name] = {"processor": "default"}
    out = small(images=[load_image("img_640x480")], return_tensors="pt")
    t["img_640x480.codes_one_frame"] = one_frame(codes(out["pixel_values"]))
    t["img_640x480.grid"] = out["image_grid_thw"][0]
    meta["items"]["img_640x480"] = {"processor": "small"}
    for name, n in [("vid4_160x224", 4), ("vid5_96x128", 5)]:
        md = VideoMetadata(total_num_frames=n, fps=2.0)
        out = proc.video_processor(videos=[load_video(name, n)], video_metadata=[md], return_tensors="pt",
                                   return_metadata=True)
        t[f"{name}.codes"], t[f"{name}.grid"] = codes(out["pixel_values_videos"]), out["video_grid_thw"][0]
        m = out["video_metadata"][0]
        ts = proc._calculate_timestamps(m.frames_indices, m.fps, proc.video_processor.temporal_patch_size)
        meta["items"][name] = {"processor": "default", "frames": n, "fps": 2.0,
                               "indices": [int(i) for i in m.frames_indices], "timestamps": ts}
    exif = Image.open(MEDIA / "exif_rot6.jpg")
    from PIL import ImageOps
    meta["exif_rot6_size_after_transpose"] = list(ImageOps.exif_transpose(exif).size)
    save_file(t, FIX / "ref" / "preprocess.safetensors")
    (FIX / "ref" / "preprocess.json").write_text(json.dumps(meta, indent=2) + "\n")


CASES = {
    "image": ([("image", "img_224x160")], "What is in the image?"),
    "two_images": ([("image", "img_224x160"), ("image", "img_256x256")], "Compare the two pictures."),
    "video": ([("video", "vid4_160x224")], "Which way does it move?"),
    "image_video": ([("image", "img_256x256"), ("video", "vid5_96x128")], "Is the picture in the video?"),
}
VIDEO_FRAMES = {"vid4_160x224": 4, "vid5_96x128": 5}


def placeholder_spans(ids, image_id, video_id):
    spans, i = [], 0
    while i < len(ids):
        if ids[i] in (image_id, video_id):
            j = i
            while j < len(ids) and ids[j] == ids[i]:
                j += 1
            spans.append((i, j))
            i = j
        else:
            i += 1
    return spans


def split_points(n, spans):
    (s0, e0) = spans[0]
    out = {"mid_first_media": [(s0 + e0) // 2, n], "one_k_one_rest": [1, s0 + 3, s0 + 4, n],
           "every_media_middle": sorted({(s + e) // 2 for s, e in spans} | {n})}
    if len(spans) > 1:
        (s1, e1) = spans[-1]
        out["last_media_edges"] = sorted({s1, s1 + 1, e1 - 1, e1, n} - {0})
    return out


@torch.no_grad()
def model_case(model, proc, media, question, model64):
    content = [{"type": kind} for kind, _ in media] + [{"type": "text", "text": question}]
    prompt = proc.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                      tokenize=False)
    images = [load_image(n) for k, n in media if k == "image"] or None
    videos = [load_video(n, VIDEO_FRAMES[n]) for k, n in media if k == "video"] or None
    metas = [VideoMetadata(total_num_frames=VIDEO_FRAMES[n], fps=2.0) for k, n in media if k == "video"] or None
    inputs = proc(text=[prompt], images=images, videos=videos, video_metadata=metas, return_tensors="pt")
    ids = inputs["input_ids"]
    n = ids.shape[1]
    cfg = model.config
    m = model.model
    m.rope_deltas = None
    full = model(**inputs, output_hidden_states=True)
    t = {"input_ids": ids[0], "mm_token_type_ids": inputs["mm_token_type_ids"][0].to(torch.int64),
         "all_logits": full.logits[0].contiguous()}
    for i, h in enumerate(full.hidden_states):
        t[f"hidden_states.{i}"] = h[0].contiguous()
    pos3, delta = m.get_rope_index(ids, inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
                                   video_grid_thw=inputs.get("video_grid_thw"))
    t["position_ids"] = pos3[:, 0].contiguous()
    t["rope_delta"] = delta.reshape(1)
    # Engine-style inputs_embeds: token embeddings with vision rows scattered into the placeholders.
    emb = m.get_input_embeddings()(ids)
    if "pixel_values" in inputs:
        img = torch.cat(m.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"]).pooler_output)
        t["image_embeds"] = img.contiguous()
        emb = emb.masked_scatter((ids == cfg.image_token_id).unsqueeze(-1), img)
        t["image_grid_thw"] = inputs["image_grid_thw"]
    if "pixel_values_videos" in inputs:
        vid = torch.cat(m.get_video_features(inputs["pixel_values_videos"], inputs["video_grid_thw"]).pooler_output)
        t["video_embeds"] = vid.contiguous()
        emb = emb.masked_scatter((ids == cfg.video_token_id).unsqueeze(-1), vid)
        t["video_grid_thw"] = inputs["video_grid_thw"]
    pos4 = torch.cat([torch.arange(n).view(1, 1, n), pos3], 0)
    t["all_logits_f64"] = f64_logits(model64, emb, pos4)

    def lm(e, p, cache):
        out = m.language_model(inputs_embeds=e, position_ids=p, past_key_values=cache, use_cache=True)
        return model.lm_head(out.last_hidden_state)

    cache = DynamicCache(config=cfg.text_config)
    logits = lm(emb, pos4, cache)[:, -1]
    steps, gen = [], []
    for step in range(N_GEN):
        steps.append(logits[0].clone())
        nxt = int(logits[0].argmax())
        gen.append(nxt)
        p = torch.full((4, 1, 1), n + step)
        p[1:] += int(delta)
        logits = lm(m.get_input_embeddings()(torch.tensor([[nxt]])), p, cache)[:, -1]
    t["step_logits"], t["generated_ids"] = torch.stack(steps), torch.tensor(gen)
    m.rope_deltas = None
    g = model.generate(**inputs, max_new_tokens=N_GEN, do_sample=False)
    assert g[0, n:].tolist() == gen, (g[0, n:].tolist(), gen)
    spans = placeholder_spans(ids[0].tolist(), cfg.image_token_id, cfg.video_token_id)
    splits = split_points(n, spans)
    for name, ends in splits.items():
        cache, start, rows = DynamicCache(config=cfg.text_config), 0, []
        for end in ends:
            rows.append(lm(emb[:, start:end], pos4[:, :, start:end], cache)[0, -1])
            start = end
        t[f"chunked.{name}"] = torch.stack(rows)
    meta = {"prompt": prompt, "len": n, "generated_ids": gen, "splits": splits, "spans": spans,
            "media": [list(x) for x in media], "question": question, "rope_delta": int(delta)}
    return {k: v.contiguous() for k, v in t.items()}, meta


def main():
    torch.set_num_threads(2)
    make_media()
    proc = AutoProcessor.from_pretrained(FIX / "models" / "qwen3_5_moe-tiny")
    preprocess_refs(proc)
    for name in ["qwen3_5-tiny", "qwen3_5_moe-tiny"]:
        d = FIX / "models" / name
        model = AutoModelForImageTextToText.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        model.eval()
        model64 = load_f64(d)
        proc = AutoProcessor.from_pretrained(d)
        ref = FIX / "ref" / name
        summary = json.loads((ref / "summary.json").read_text())
        for case, (media, question) in CASES.items():
            tensors, meta = model_case(model, proc, media, question, model64)
            save_file(tensors, ref / f"{case}.safetensors", metadata={"prompt": meta["prompt"]})
            summary["cases"][case] = meta
            print(name, case, meta["len"], meta["rope_delta"], meta["generated_ids"])
        (ref / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
