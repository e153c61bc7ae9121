"""Encoder tokens and encode throughput per vision path on the same InfoVQA-like images.

Paths compared (processor defaults of each model, as a user gets them without tuning):

- ``qwen2.5-vl``: smart_resize (patch 14, merge 2), 3136..12845056 pixels;
- ``qwen3-vl``: smart_resize (patch 16, merge 2), its published pixel limits;
- ``nemotron-omni`` dynamic: native aspect ratio, patch 16, 1024..13312 patches, 2x2 shuffle;
- ``nemotron-omni-tiled``: closest aspect-ratio grid of 512x512 tiles (<= 12) + thumbnail.

Reported per path over the same images: LLM visual tokens per image, encoder sequence length
per image (patches, plus RADIO's class/register tokens per segment), the estimated encoder
forward FLOPs with each tower's published shape (``TOWERS``) and, with ``--measure``,
the measured encode throughput of our own encoders (models/layers/qwen_vision.py,
models/families/nemotron_omni/radio.py) at equal width and depth on CPU (images/s and
patches/s, CPU time, forward only).

Run: python bench/bench_nemotron_paths.py [--images 200] [--measure] [--out bench_out]
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from energon_tasks.families.nemotron_omni.geometry import NEMOTRON_OMNI, NEMOTRON_OMNI_TILED  # noqa: E402
from energon_tasks.profiles import get_geometry  # noqa: E402

#: RADIO prepends class + register tokens to every segment (transformers RadioConfig defaults:
#: 3 class tokens + 7 registers).
RADIO_PREFIX_TOKENS = 10


#: Vision tower shapes for the FLOPs estimate: (layers, hidden, MLP FLOPs per token per layer
#: as multiples of hidden**2, full-attention layers, window length of the others or None).
#: Qwen2.5-VL: 32 layers, 1280, gated MLP 3420 (3 matrices), 4 full layers, 8x8 windows.
#: Qwen3-VL (8B): 27 layers, 1152, MLP 4304, full attention everywhere.
#: RADIO (transformers RadioConfig defaults = the Nemotron-Omni tower width 1280): 32 layers,
#: MLP ratio 4, full attention per segment everywhere.
TOWERS = {
    "qwen2.5-vl": (32, 1280, 3 * 3420 / 1280, 4, 64),
    "qwen3-vl": (27, 1152, 2 * 4304 / 1152, 27, None),
    "nemotron-omni": (32, 1280, 2 * 4.0, 32, None),
}


def encoder_flops(path: str, segs: list[int]) -> float:
    """Forward FLOPs of the tower on these segments: 2 * (QKV+proj + MLP) per token and layer,
    plus 4 * len * len * hidden for QK^T and AV in each attention (window or full) layer."""
    layers, hidden, mlp, full, window = TOWERS[path.removesuffix("-tiled")]
    tokens = sum(segs)
    linear = 2 * layers * tokens * hidden * hidden * (4 + mlp)
    attention = 4 * hidden * full * sum(s * s for s in segs)
    if window is not None:
        attention += 4 * hidden * (layers - full) * tokens * window
    return linear + attention


def infovqa_sizes(n: int, seed: int = 0) -> list[tuple[int, int]]:
    """(height, width) of InfoVQA-like infographics: 0.2-58.6 MP, median ~2 MP, mostly tall."""
    rng = random.Random(seed)
    sizes = []
    for _ in range(n):
        mp = min(max(math.exp(rng.gauss(math.log(2.0), 0.9)), 0.2), 58.6)
        aspect = math.exp(rng.uniform(math.log(0.6), math.log(4.0)))  # h / w
        w = int(math.sqrt(mp * 1e6 / aspect))
        sizes.append((int(w * aspect), w))
    return sizes


def segments(path: str, height: int, width: int) -> tuple[int, list[int]]:
    """(LLM visual tokens, encoder segment lengths) of one image on one path."""
    if path in ("qwen2.5-vl", "qwen3-vl"):
        grid = get_geometry(path).image_grid(height, width)
        _, gh, gw = grid.grid_thw
        return grid.visual_tokens, [gh * gw]
    geometry = NEMOTRON_OMNI if path == "nemotron-omni" else NEMOTRON_OMNI_TILED
    grid = geometry.image_grid(height, width)
    t, gh, gw = grid.grid_thw
    return grid.visual_tokens, [gh * gw + RADIO_PREFIX_TOKENS] * t


PATHS = ("qwen2.5-vl", "qwen3-vl", "nemotron-omni", "nemotron-omni-tiled")


def token_table(sizes: list[tuple[int, int]]) -> list[dict]:
    rows = []
    for path in PATHS:
        tokens, seq, flops = [], [], []
        for h, w in sizes:
            n, segs = segments(path, h, w)
            tokens.append(n)
            seq.append(sum(segs))
            flops.append(encoder_flops(path, segs))
        q = sorted(tokens)
        rows.append({"path": path, "tokens_mean": statistics.fmean(tokens),
                     "tokens_p50": q[len(q) // 2], "tokens_p95": q[int(0.95 * (len(q) - 1))],
                     "tokens_max": q[-1], "encoder_seq_mean": statistics.fmean(seq),
                     "encoder_tflops_mean": statistics.fmean(flops) / 1e12,
                     "encoder_tflops_max": max(flops) / 1e12})
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| path | visual tokens / image (mean, p50, p95, max) | encoder sequence / image "
           "(mean) | encoder forward TFLOPs / image (mean, max) |", "|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['path']} | {r['tokens_mean']:.0f}, {r['tokens_p50']}, "
                   f"{r['tokens_p95']}, {r['tokens_max']} | {r['encoder_seq_mean']:.0f} | "
                   f"{r['encoder_tflops_mean']:.2f}, {r['encoder_tflops_max']:.2f} |")
    return "\n".join(out)


#: Equal-width, equal-depth CPU encoders: only the input geometry (sequence lengths, attention
#: segments, window vs full attention) differs between the paths.
ENCODER_SHAPE = ["vision.depth=2", "vision.hidden_size=64", "vision.intermediate_size=256",
                 "vision.num_heads=2"]
MODEL_CONFIGS = {"qwen2.5-vl": ("configs/qwen2_5_vl_tiny.yaml",
                                 ["vision.fullatt_block_indexes=[1]"]),
                 "qwen3-vl": ("configs/qwen3_vl_tiny.yaml", ["vision.deepstack_visual_indexes=[]"]),
                 "nemotron-omni": ("configs/nemotron_omni_tiny.yaml", [])}


def _encoder(path: str):
    """(vision tower, pixel row width) of a path, random init, eval mode."""
    from models.families import config_module

    config, extra = MODEL_CONFIGS[path.removesuffix("-tiled")]
    module = "nemotron_omni" if path.startswith("nemotron") else "qwen2_5_vl"
    cfg = config_module(module).load_yaml(REPO / config, [*ENCODER_SHAPE, *extra])
    if path.startswith("nemotron"):
        from models.families.nemotron_omni.radio import RadioEncoder

        return RadioEncoder(cfg, use_te=False).eval(), 3 * cfg.vision.patch_size**2
    from models.layers.qwen_vision import QwenVisionEncoder

    v = cfg.vision
    return QwenVisionEncoder(cfg, use_te=False).eval(), 3 * v.temporal_patch_size * v.patch_size**2


def _grid(path: str, height: int, width: int) -> tuple[int, int, int]:
    if path.startswith("qwen"):
        return get_geometry(path).image_grid(height, width).grid_thw
    geometry = NEMOTRON_OMNI if path == "nemotron-omni" else NEMOTRON_OMNI_TILED
    return geometry.image_grid(height, width).grid_thw


def measure_paths(sizes: list[tuple[int, int]], repeats: int) -> list[dict]:
    """Forward CPU seconds of each path's encoder over the same images (one image per call)."""
    import torch

    from models.parallel import init_parallel

    init_parallel()
    rows = []
    for path in PATHS:
        encoder, width = _encoder(path)
        grids = [_grid(path, h, w) for h, w in sizes]
        inputs = [(torch.randn(t * gh * gw, width), torch.tensor([[t, gh, gw]])) for t, gh, gw
                  in grids]
        best = math.inf
        with torch.no_grad():
            encoder(*inputs[0])  # warm-up
            for _ in range(repeats):
                start = time.process_time()
                for pixels, grid in inputs:
                    encoder(pixels, grid)
                best = min(best, time.process_time() - start)
        patches = sum(t * gh * gw for t, gh, gw in grids)
        rows.append({"path": path, "images": len(sizes), "patches": patches,
                     "cpu_seconds": round(best, 3), "images_per_cpu_s": len(sizes) / best,
                     "patches_per_cpu_s": patches / best})
    base = rows[0]["images_per_cpu_s"]
    for row in rows:
        row["images_per_s_vs_qwen2_5"] = row["images_per_cpu_s"] / base
    return rows


def throughput_markdown(rows: list[dict]) -> str:
    out = ["| path | patches | CPU s | images / CPU s | patches / CPU s | images/s vs Qwen2.5-VL |",
           "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['path']} | {r['patches']} | {r['cpu_seconds']:.2f} | "
                   f"{r['images_per_cpu_s']:.2f} | {r['patches_per_cpu_s']:.0f} | "
                   f"{r['images_per_s_vs_qwen2_5']:.2f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--images", type=int, default=200)
    ap.add_argument("--measure", action="store_true", help="also time the encoders on CPU")
    ap.add_argument("--measure-images", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="bench_out")
    args = ap.parse_args()
    sizes = infovqa_sizes(args.images)
    rows = token_table(sizes)
    print(markdown(rows))
    report = {"images": args.images, "tokens": rows}
    if args.measure:
        report["throughput"] = measure_paths(sizes[: args.measure_images], args.repeats)
        print(throughput_markdown(report["throughput"]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "nemotron_paths.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    t0 = time.perf_counter()
    main()
    print(f"({time.perf_counter() - t0:.1f} s)")
