"""Loader report: the exact image path next to its floor and the transformers reference, and the
loader's CPU time per sample and workers per GPU, for each dataset and family.

One process, numpy / torch at one thread, process CPU time. Per sample: one warm-up, then
ROUNDS rounds in which every compared path runs once in turn (interleaved against a drifting
machine load), and the best (least) CPU time of each path is kept, since other jobs on a shared
machine only ever add time; a path's figure is the sum of those over the samples. Ratios are
from this one run.

Families (the task encoder's defaults, ``task_encoder.image_decode: exact``): Qwen2.5-VL,
Qwen3-VL, Nemotron-Omni (dynamic). Datasets (generated, the sizes the hub's show;
the dataset cards' published sizes):

- Mantis-like multi-image: samples of 3 photo-like JPEGs (q90) of 400..900 px a side (Mantis
  rows hold 2.3 images on average, mostly COCO-sized photos);
- InfoVQA-like high-res: one text-heavy page JPEG (q90) per sample, 800..1400 x 1400..3200
  (the dataset's median is ~2 MP, tall), and a large set of 1500..2500 x 4000..6000 pages (its
  upper range, up to 58 MP);
- LLaVA-Video-like: one 30 s and one 60 s 640x360 H.264 clip (30 fps, keyframe every 2 s,
  B-frames), at the task encoder's default frame sampling (2 fps, at most 60 frames).

Paths, per image sample (every one gives the same ``pixel_values``, checked bit for bit each
run):

- reference: the transformers path of the family. Qwen: qwen-vl-utils' ``fetch_image`` steps
  (it does not import here: open, RGB, ``smart_resize``, PIL resize) then
  ``Qwen2VLImageProcessorPil`` configured as the family's processor. Nemotron-Omni: its image
  processor's steps (it needs torchvision, absent here): ``convert_to_rgb``, the float32 tensor,
  torchvision's resize on float32 = one ``F.interpolate(bicubic, antialias=True)`` call, the
  fused rescale + normalise of ``TorchvisionBackend`` and ``convert_image_to_patches``;
- floor: the work the exact path cannot skip, each step once: full decode (PIL ``load``), one
  resize with the project's exact kernels (Qwen: PIL's bicubic on uint8 as
  ``energon_tasks.resize.resize_rgb`` computes it, the native kernel where it is built; for
  Nemotron-Omni torch's float32 antialiased bicubic as ours computes it,
  ``energon_tasks.resize.resize_rgb_float``),
  one normalise expression, one patchify copy (Qwen: both temporal slots);
- ours (pixels): the task encoder's ``decode_media`` and its hooks' ``write_pixel_rows``;
- ours (encode): the whole ``encode_sample`` steps (tokens, labels, positions as well).

Video samples have no reference here (qwen-vl-utils' ``fetch_video`` needs torchvision); they
are timed through the encoder only.

Workers per GPU = CPU seconds the loader spends per step / step time, rounded up: a GPU step of
STEP_S seconds that consumes TOKENS_PER_STEP tokens (one packed row of 16,384 tokens) takes
TOKENS_PER_STEP / tokens per sample samples.

Usage: python bench/bench_loader_report.py --out bench_out/loader [--quick]
       [--video-only | --images-only]
Writes <out>/loader_report.json and prints the two markdown tables of
docs/benchmarks_task_encoder.md ("Loader report").
"""

from __future__ import annotations

import io
import json
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import click  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_task_encoder import (  # noqa: E402
    conversation_of,
    document_jpeg,
    make_video,
    ours_path,
)

from energon_tasks.resize import _torch_taps, float_kernel, kernel  # noqa: E402
from lookalikes.media import photo_jpeg  # noqa: E402

MODELS = ("qwen2_5_vl", "qwen3_vl", "nemotron_omni")
ROUNDS = 5
IMAGE_SETS = ("mantis", "infovqa", "infovqa_large")
SEQ_LENGTH = 16384
TOKENS_PER_STEP = 16384  #: tokens one GPU consumes per step (one packed row)
STEP_S = 2.0  #: stated GPU step time


# ---- data ------------------------------------------------------------------------------------


def image_sets(quick: bool) -> dict[str, list[list[bytes]]]:
    rng = np.random.default_rng(0)
    pages = [[document_jpeg(rng, int(rng.integers(800, 1401)), int(rng.integers(1400, 3201)))]
             for _ in range(2 if quick else 6)]
    mantis = [[photo_jpeg(rng, int(rng.integers(400, 901)), int(rng.integers(400, 901)))
               for _ in range(3)] for _ in range(2 if quick else 6)]
    large = [[document_jpeg(rng, int(rng.integers(1500, 2501)), int(rng.integers(4000, 6001)))]
             for _ in range(1 if quick else 3)]
    return {"mantis": mantis, "infovqa": pages, "infovqa_large": large}


def video_sample(data: bytes, seconds: int):
    """A canonical one-turn sample holding one mp4 (the converter's metadata)."""
    import av

    from energon_tasks.sample_format import CanonicalSample, Media, SourceRef, Turn

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        frames, fps = stream.frames, float(stream.average_rate)
        width, height = stream.width, stream.height
    media = Media(part="vid0.mp4", kind="video", format="mp4", width=width, height=height,
                  bytes=len(data), duration_s=float(seconds), frames=frames, fps=fps,
                  codec="h264")
    sample = CanonicalSample(
        dataset="bench", source=SourceRef(config="bench", split="train", ids=["v"], rows=[0]),
        conversation=[Turn(role="user", content="<image> What happens?"),
                      Turn(role="assistant", content="The scene pans slowly to the left.")],
        media=[media])
    return sample, {"vid0.mp4": data}


# ---- the image paths ---------------------------------------------------------------------------


def reference_path(geometry, processor, images: list[bytes], sizes: list[tuple[int, int]]):
    """The family's transformers path -> pixel_values (numpy float32)."""
    if geometry.image_resize == "torch":
        return np.concatenate([_nemotron_reference(data, size)
                               for data, size in zip(images, sizes, strict=True)])
    fetched = []
    for data, (height, width) in zip(images, sizes, strict=True):
        image = Image.open(io.BytesIO(data)).convert("RGB")  # fetch_image: RGB, then resize
        fetched.append(image.resize((width, height)))
    return processor(images=fetched, return_tensors="np")["pixel_values"]


def _nemotron_reference(data: bytes, size: tuple[int, int]) -> np.ndarray:
    from transformers.image_processing_backends import TorchvisionBackend
    from transformers.image_transforms import convert_to_rgb

    from contract.constants import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    rgb = convert_to_rgb(Image.open(io.BytesIO(data)), return_numpy=True)
    image = torch.from_numpy(np.array(rgb)).permute(2, 0, 1)[None].to(torch.float32)
    if tuple(image.shape[-2:]) != size:
        image = torch.nn.functional.interpolate(image, size=size, mode="bicubic",
                                                align_corners=False, antialias=True)
    mean, std, _ = TorchvisionBackend._fuse_mean_std_and_rescale_factor(
        object(), do_normalize=True, image_mean=tuple(OPENAI_CLIP_MEAN),
        image_std=tuple(OPENAI_CLIP_STD), do_rescale=True, rescale_factor=1 / 255)
    image = image.sub(mean[:, None, None]).div(std[:, None, None])
    _, channels, height, width = image.shape
    patches = image.reshape(1, channels, height // 16, 16, width // 16, 16)
    return patches.permute(0, 2, 4, 1, 3, 5).reshape(-1, channels * 256).numpy()


def make_processor(geometry):
    if geometry.image_resize == "torch":
        return None
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
        Qwen2VLImageProcessorPil,
    )

    return Qwen2VLImageProcessorPil(
        patch_size=geometry.patch_size, merge_size=geometry.merge_size,
        temporal_patch_size=geometry.temporal_patch_size, image_mean=list(geometry.image_mean),
        image_std=list(geometry.image_std), min_pixels=geometry.default_min_pixels // 4,
        max_pixels=10**9)  # the fetched image's size is kept (fetch_image did the resize)


def decoded_resized(geometry, data: bytes, size: tuple[int, int]) -> np.ndarray:
    """Full decode + the one resize: (H, W, 3) uint8 (Qwen) or float32 (Nemotron-Omni), the
    decoded rows read in place and resized as the exact path does (``decode._resized``)."""
    from energon_tasks.decode import _resized, pil_in_one_block

    height, width = size
    with pil_in_one_block():
        image = Image.open(io.BytesIO(data))
        image.load()
        if image.mode != "RGB":
            image = image.convert("RGB")
        return _resized(image, width, height, geometry.image_resize)


def floor_path(geometry, images: list[bytes], sizes: list[tuple[int, int]]) -> np.ndarray:
    """Full decode + one resize + one normalise (in place) + one patchify copy per image."""
    mean = np.asarray(geometry.image_mean, np.float32)
    std = np.asarray(geometry.image_std, np.float32)
    out = []
    for data, (height, width) in zip(images, sizes, strict=True):
        pixels = decoded_resized(geometry, data, (height, width))
        if geometry.image_resize == "torch":
            scale = np.float32(255)
            normal = np.subtract(pixels, mean * scale, dtype=np.float32)
            normal /= std * scale
            p = geometry.patch_size
            rows = normal.reshape(height // p, p, width // p, p, 3).transpose(0, 2, 4, 1, 3)
            out.append(rows.reshape(-1, 3 * p * p))
            continue
        normal = pixels.astype(np.float32)
        normal /= np.float32(255)
        normal -= mean
        normal /= std
        p, m, tp = geometry.patch_size, geometry.merge_size, geometry.temporal_patch_size
        bh, bw = height // (p * m), width // (p * m)
        rows = np.empty((bh * bw * m * m, 3 * tp * p * p), np.float32)
        target = rows.reshape(bh, bw, m, m, 3, tp, p, p)
        source = normal.reshape(bh, m, p, bw, m, p, 3).transpose(0, 3, 1, 4, 6, 2, 5)
        for slot in range(tp):
            target[:, :, :, :, :, slot] = source
        out.append(rows)
    return np.concatenate(out)


def ours_pixels(encoder, plan, sample, parts) -> np.ndarray:
    """``decode_media`` + ``write_pixel_rows`` of each image into one buffer (as ``assemble``)."""
    frames = encoder.decode_media(plan, sample, parts)
    hooks = encoder.hooks
    grids = [hooks.pixel_grid("image", f) for f in frames]
    out = np.empty((sum(map(math.prod, grids)), hooks.pixel_row_width("image")), np.float32)
    start = 0
    for grid, f in zip(grids, frames, strict=True):
        hooks.write_pixel_rows("image", f, out[start:start + math.prod(grid)])
        start += math.prod(grid)
    return out


def best_cpu(paths: dict, count: int, rounds: int) -> dict:
    """Seconds per path: summed over samples ``0..count-1`` of the least process CPU time of
    ``paths[name](i)`` over ``rounds`` interleaved rounds (after one warm-up per sample)."""
    total = dict.fromkeys(paths, 0.0)
    for i in range(count):
        best = dict.fromkeys(paths, math.inf)
        for round_ in range(rounds + 1):
            for name, fn in paths.items():
                start = time.process_time()
                fn(i)
                if round_:
                    best[name] = min(best[name], time.process_time() - start)
        for name in paths:
            total[name] += best[name]
    return total


# ---- sections ----------------------------------------------------------------------------------


def make_encoder(model: str, tokenizer):
    from energon_tasks import task_encoder_for
    from energon_tasks.config import TaskEncoderConfig

    config = TaskEncoderConfig(model=model, seq_length=SEQ_LENGTH, max_visual_tokens=SEQ_LENGTH)
    return task_encoder_for(config, tokenizer=tokenizer)


def fresh(path):
    """``path`` timed as on a new image size: torch's float32 taps that ``resize_rgb_float``
    reads off ``F.interpolate`` and caches per size pair are read again on every call (a
    dataset's images rarely share a size; the rounds here repeat the same images)."""
    def call(i):
        _torch_taps.cache_clear()
        return path(i)
    return call


def image_section(model: str, tokenizer, samples: list[list[bytes]], rounds: int) -> dict:
    encoder = make_encoder(model, tokenizer)
    geometry = encoder.geometry
    processor = make_processor(geometry)
    prepared = [conversation_of(images) for images in samples]
    plans = [ours_path(encoder, s, p)[1] for s, p in prepared]
    sizes = [[(m.grid.resized_height, m.grid.resized_width) for m in plan.media] for plan in plans]
    for images, size, plan, (s, p) in zip(samples, sizes, plans, prepared, strict=True):
        ours = ours_pixels(encoder, plan, s, p)
        encoded = ours_path(encoder, s, p)[0].pixel_values.numpy()
        for name, other in (("reference", reference_path(geometry, processor, images, size)),
                            ("floor", floor_path(geometry, images, size)),
                            ("encode", encoded)):
            if other.shape != ours.shape or not np.array_equal(other, ours):
                raise RuntimeError(f"{model}: {name} pixel_values differ from ours")
    tokens = [len(ours_path(encoder, s, p)[0].input_ids) for s, p in prepared]
    cpu = best_cpu({
        "reference": lambda i: reference_path(geometry, processor, samples[i], sizes[i]),
        "floor": fresh(lambda i: floor_path(geometry, samples[i], sizes[i])),
        "floor_decode_resize": fresh(lambda i: [decoded_resized(geometry, data, hw) for data, hw
                                                in zip(samples[i], sizes[i], strict=True)]),
        "ours_pixels": fresh(lambda i: ours_pixels(encoder, plans[i], *prepared[i])),
        "ours_encode": fresh(lambda i: ours_path(encoder, *prepared[i])),
    }, len(samples), rounds)
    n = len(samples)
    return {
        "samples": n, "images_per_sample": len(samples[0]),
        "source_mp_mean": float(np.mean([Image.open(io.BytesIO(d)).size[0]
                                         * Image.open(io.BytesIO(d)).size[1] / 1e6
                                         for images in samples for d in images])),
        "tokens_per_sample": float(np.mean(tokens)),
        "visual_tokens_per_sample": float(np.mean(
            [sum(m.grid.visual_tokens for m in plan.media) for plan in plans])),
        "pixel_values_identical": True,
        "cpu_ms_per_sample": {k: 1000 * v / n for k, v in cpu.items()},
        "ours_over_floor": cpu["ours_pixels"] / cpu["floor"],
        "reference_over_ours": cpu["reference"] / cpu["ours_pixels"],
        "encode_over_floor": cpu["ours_encode"] / cpu["floor"],
        # the most any exact path can gain on the reference: it must still decode and resize
        "reference_over_decode_resize": cpu["reference"] / cpu["floor_decode_resize"],
    }


def video_section(model: str, tokenizer, clips: list[tuple[int, bytes]], rounds: int) -> dict:
    encoder = make_encoder(model, tokenizer)
    prepared = [video_sample(data, seconds) for seconds, data in clips]
    encoded = [ours_path(encoder, s, p) for s, p in prepared]
    cpu = best_cpu({"ours_encode": lambda i: ours_path(encoder, *prepared[i])}, len(prepared),
                   rounds)
    n = len(prepared)
    return {
        "samples": n, "clips_s": [seconds for seconds, _ in clips],
        "frames_per_sample": float(np.mean([len(plan.media[0].frame_indices)
                                            for _, plan in encoded])),
        "tokens_per_sample": float(np.mean([len(e.input_ids) for e, _ in encoded])),
        "visual_tokens_per_sample": float(np.mean(
            [plan.media[0].grid.visual_tokens for _, plan in encoded])),
        "cpu_ms_per_sample": {k: 1000 * v / n for k, v in cpu.items()},
    }


def workers_per_gpu(row: dict) -> dict:
    samples = TOKENS_PER_STEP / row["tokens_per_sample"]
    cpu_s = samples * row["cpu_ms_per_sample"]["ours_encode"] / 1000
    return {"samples_per_step": samples, "loader_cpu_s_per_step": cpu_s,
            "workers": max(1, math.ceil(cpu_s / STEP_S))}


# ---- tables ------------------------------------------------------------------------------------


def tables(results: dict) -> str:
    lines = ["| family | dataset | reference | floor (of which decode + resize) | ours, pixels | "
             "ours, whole encode | ours / floor (target <= 1.10) | reference / ours (target "
             ">= 1.5) | reference / (decode + resize): the bound |",
             "|---|---|---|---|---|---|---|---|---|"]
    for model, sets in results.items():
        for name in (n for n in IMAGE_SETS if n in sets):
            r = sets[name]
            ms = r["cpu_ms_per_sample"]
            lines.append(f"| {model} | {name} | {ms['reference']:.1f} | {ms['floor']:.1f} "
                         f"({ms['floor_decode_resize']:.1f}) | "
                         f"{ms['ours_pixels']:.1f} | {ms['ours_encode']:.1f} | "
                         f"{r['ours_over_floor']:.2f}x | {r['reference_over_ours']:.2f}x | "
                         f"{r['reference_over_decode_resize']:.2f}x |")
    lines += ["", f"| family | dataset | tokens / sample (visual) | loader CPU-ms / sample | "
              f"samples per {TOKENS_PER_STEP}-token step | loader CPU-s per step | workers per "
              f"GPU at {STEP_S:g} s / step |", "|---|---|---|---|---|---|---|"]
    for model, sets in results.items():
        for name, r in sets.items():
            w = r["workers_per_gpu"]
            lines.append(f"| {model} | {name} | {r['tokens_per_sample']:.0f} "
                         f"({r['visual_tokens_per_sample']:.0f}) | "
                         f"{r['cpu_ms_per_sample']['ours_encode']:.1f} | "
                         f"{w['samples_per_step']:.1f} | {w['loader_cpu_s_per_step']:.2f} | "
                         f"{w['workers']} |")
    return "\n".join(lines)


@click.command()
@click.option("--out", default="bench_out/loader", type=click.Path(path_type=Path))
@click.option("--quick", is_flag=True, help="fewer samples, 2 rounds")
@click.option("--video-only", is_flag=True, help="the llava_video rows only")
@click.option("--images-only", is_flag=True, help="the image rows only")
def main(out: Path, quick: bool, video_only: bool, images_only: bool) -> None:
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    tokenizer_dir = Path(tempfile.mkdtemp()) / "tokenizer"
    build_test_tokenizer(tokenizer_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    sets = {} if video_only else image_sets(quick)
    clips = [(seconds, make_video(seconds, 30, 640, 360, 60))
             for seconds in ((30,) if quick else (30, 60))]
    rounds = 2 if quick else ROUNDS
    load_start = os.getloadavg()
    results = {}
    for model in MODELS:
        results[model] = {name: image_section(model, tokenizer, samples, rounds)
                          for name, samples in sets.items()}
        if not images_only:
            results[model]["llava_video"] = video_section(model, tokenizer, clips, rounds)
        for row in results[model].values():
            row["workers_per_gpu"] = workers_per_gpu(row)
        print(f"[bench] {model} done {time.perf_counter() - start:.0f} s", file=sys.stderr)
    record = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "resize": kernel(), "float_resize": float_kernel(),
                          "cpus": os.cpu_count(), "load_average_start": load_start,
                          "load_average_end": os.getloadavg()},
              "rounds": rounds, "seq_length": SEQ_LENGTH, "tokens_per_step": TOKENS_PER_STEP,
              "step_s": STEP_S, "results": results, "wall_s": time.perf_counter() - start}
    record["tables"] = tables(results)
    (out / "loader_report.json").write_text(json.dumps(record, indent=1))
    print(record["tables"])


if __name__ == "__main__":
    main()
