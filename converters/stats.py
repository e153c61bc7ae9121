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


def write_stats(out: Path, records: list[dict], conversion: dict, dataset: str = "") -> dict:
    """Write stats.json and the histogram PNG (titled with ``dataset``); returns the headline
    numbers for the summary."""
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
    _plot(out / "stats_histograms.png", series, dataset or out.name)
    return {name: d.get("mean") for name, d in stats["distributions"].items()}


#: series name -> (panel title, x axis label, counts (integer bins), log x)
PANELS = {
    "images_per_sample": ("images per sample", "images", True, False),
    "megapixels_per_image": ("image size", "megapixels per image (MP, log scale)", False,
                             True),
    "videos_per_sample": ("videos per sample", "videos", True, False),
    "video_duration_s": ("video duration", "seconds per video", False, False),
    "video_frames": ("video frames", "frames per video", True, False),
    "text_tokens_approx": ("text tokens (approx., 4 chars / token)", "tokens per sample", False,
                           False),
    **{f"visual_tokens_{model}": (f"visual tokens, {model} default budget",
                                  "tokens per sample", True, False) for model in MODELS},
}


def _bins(values: np.ndarray, counts: bool, log: bool):
    """Histogram bins: one per integer for small counts (wider integer steps above 60 values),
    log-spaced for ``log``, else up to 40 equal bins."""
    low, high = float(values.min()), float(values.max())
    if log and low > 0 and high > low:
        return np.geomspace(low, high, 30)
    if counts:
        step = max(1, int(np.ceil((high - low + 1) / 60)))
        return np.arange(np.floor(low), np.floor(high) + step + 1, step) - 0.5
    return min(40, max(5, len(set(values.tolist()))))


def _plot(path: Path, series: dict[str, list], dataset: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    shown = [(name, values) for name, values in series.items() if values and any(values)]
    cols = 3
    rows = max(1, -(-len(shown) // cols))
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.4 * rows), squeeze=False)
    for ax, (name, values) in zip(axes.flat, shown):
        title, xlabel, counts, log = PANELS.get(name, (name.replace("_", " "), name, False, False))
        data = np.asarray(values, dtype=np.float64)
        ax.hist(data, bins=_bins(data, counts, log), color="#4477aa")
        if log and data.min() > 0:
            ax.set_xscale("log")
        ax.set_title(f"{title}\nn = {data.size}, median {np.median(data):.3g}", fontsize=9)
        if counts and data.max() - data.min() <= 10:  # few values: a tick on each
            ax.set_xticks(range(int(data.min()), int(data.max()) + 1))
        elif counts:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("images" if name == "megapixels_per_image" else
                      "videos" if name.startswith("video_") else "samples", fontsize=8)
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(shown):]:
        ax.axis("off")
    fig.suptitle(f"{dataset}: {len(series['images_per_sample'])} samples", fontsize=10)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=80, metadata={"Software": None})
    plt.close(fig)
    write_atomic(path, buffer.getvalue())
