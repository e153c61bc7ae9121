"""Dataset statistics written by a conversion: `stats.json` and `stats_histograms.png`.

Distributions of images per sample, megapixels per image, video duration and frames, text tokens
(approximate: 4 characters per token) and the estimated visual tokens per sample under Qwen2.5-VL
(factor 28) and Qwen3-VL (factor 32) at the loader's default budget (the defaults of
``energon_tasks.config.TaskEncoderConfig``, the one source of them: pixel limits, video fps, frame
cap), computed from the media metadata alone with the loader's own geometry, plus the conversion
speed.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np

from contract.families import QWEN2_5_VL, QWEN3_VL
from converters.writer import write_atomic

CHARS_PER_TOKEN = 4
MODELS = (QWEN2_5_VL, QWEN3_VL)


def default_budget(model: str) -> dict:
    """The loader's default budget of a model (``TaskEncoderConfig(model=model)``): image and
    video pixel limits (null knobs filled from the geometry), video fps, frame cap."""
    from energon_tasks.config import TaskEncoderConfig

    budget = TaskEncoderConfig(model=model).resolve()
    return {"min_pixels": budget.min_pixels, "max_pixels": budget.max_pixels,
            "video_min_pixels": budget.video_min_pixels,
            "video_max_pixels": budget.video_max_pixels, "video_fps": budget.video_fps,
            "max_num_frames": budget.max_num_frames}


def visual_tokens(model: str, record: dict, budget: dict | None = None) -> int | None:
    """Estimated visual tokens of one sample (images and videos) at ``budget`` (default: the
    loader's, ``default_budget``); None when the model's geometry cannot take one of its media
    (the loader would skip it)."""
    from energon_tasks.profiles import get_geometry

    geo = get_geometry(model)
    b = default_budget(model) if budget is None else budget
    total = 0
    try:
        for width, height in record["images"]:
            total += geo.image_grid(height, width, min_pixels=b["min_pixels"],
                                    max_pixels=b["max_pixels"]).visual_tokens
        for _duration, frames, width, height, fps in record["videos"]:
            chosen = geo.video_frame_indices(frames, fps, video_fps=b["video_fps"],
                                             max_num_frames=b["max_num_frames"])
            total += geo.video_grid(len(chosen), height, width, min_pixels=b["video_min_pixels"],
                                    max_pixels=b["video_max_pixels"]).visual_tokens
    except ValueError:
        return None
    return total


def _describe(values) -> dict:
    arr = np.asarray(list(values), dtype=np.float64)
    if arr.size == 0:
        return {"count": 0}
    q = np.percentile(arr, [50, 90, 99])
    return {"count": int(arr.size), "mean": round(float(arr.mean()), 3),
            "p50": round(float(q[0]), 3), "p90": round(float(q[1]), 3),
            "p99": round(float(q[2]), 3), "max": round(float(arr.max()), 3),
            "sum": round(float(arr.sum()), 3)}


def write_stats(out: Path, records: list[dict], conversion: dict) -> dict:
    """Write stats.json and the histogram PNG; returns the headline numbers for the summary."""
    series = {
        "images_per_sample": [len(r["images"]) for r in records],
        "megapixels_per_image": [w * h / 1e6 for r in records for w, h in r["images"]],
        "videos_per_sample": [len(r["videos"]) for r in records],
        "video_duration_s": [v[0] for r in records for v in r["videos"]],
        "video_frames": [v[1] for r in records for v in r["videos"]],
        "text_tokens_approx": [r["text_chars"] / CHARS_PER_TOKEN for r in records],
    }
    unusable = {}
    budgets = {model: default_budget(model) for model in MODELS}
    for model in MODELS:
        tokens = [visual_tokens(model, r, budgets[model]) for r in records]
        series[f"visual_tokens_{model}"] = [t for t in tokens if t is not None]
        unusable[model] = sum(t is None for t in tokens)
    stats = {
        "budget": {**budgets, "chars_per_token": CHARS_PER_TOKEN},
        "samples": len(records),
        "distributions": {name: _describe(values) for name, values in series.items()},
        "samples_the_geometry_cannot_take": unusable,
        "conversion": conversion,
    }
    write_atomic(out / "stats.json", json.dumps(stats, indent=1, sort_keys=True).encode())
    _plot(out / "stats_histograms.png", series)
    return {name: d.get("mean") for name, d in stats["distributions"].items()}


def _plot(path: Path, series: dict[str, list]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [(name, values) for name, values in series.items() if values and any(values)]
    cols = 3
    rows = max(1, -(-len(shown) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4 * cols, 3 * rows), squeeze=False)
    for ax, (name, values) in zip(axes.flat, shown):
        ax.hist(values, bins=min(40, max(5, len(set(values)))), color="#4477aa")
        ax.set_title(name.replace("_", " "), fontsize=9)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
