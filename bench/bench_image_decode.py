"""Exact vs fast image decoding (``task_encoder.image_decode``): pixels, model, speed.

For each model family (Qwen2.5-VL, Qwen3-VL, Nemotron-Omni dynamic; the task encoder's default
pixel limits) and each image set, every image goes through the task encoder's public steps
(``tokenize_turns`` -> ``plan_sample`` -> ``decode_media`` -> ``assemble``) twice, with
``image_decode=exact`` (the pixel values of the model's transformers processor) and ``=fast``
(JPEG decoded at a reduced DCT scale when the target is at most half the source per side):

1. pixel difference of ``pixel_values`` (normalised units, what the model reads): mean and max of
   |fast - exact| over the set;
2. model difference: the family's tiny model (configs/*_tiny.yaml, random init, built with
   ``models.families.build_model``) reads the same sample (text, the image, text) decoded both
   ways: max |logit difference| over all positions and over the text positions after the image
   (those that read it), next to the logits' std, and the share of those text positions whose
   greedy token changes.
   No real checkpoint can be downloaded here (no hub access), so no imported model is measured;
3. speed: process CPU time of ``decode_media`` and of the whole encode, per set, both modes run
   in turn in every round (one warm-up, median of rounds), one thread.

Sets: InfoVQA-like text-heavy pages (``document_jpeg`` of bench_task_encoder.py, JPEG q90)
2000x5000 and 1000x3000, and Mantis-like photos (``lookalikes.media.photo_jpeg``,
JPEG q90) about 500x400.

Usage: python bench/bench_image_decode.py --out bench_out/image_decode [--quick]
Writes <out>/image_decode.json and prints the markdown table of docs/benchmarks_task_encoder.md.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

import click  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench_task_encoder import (  # noqa: E402
    conversation_of,
    document_jpeg,
    ours_path,
    timed_together,
)

from lookalikes.media import photo_jpeg  # noqa: E402

#: task-encoder model -> (model family, tiny model config)
MODELS = {"qwen2.5-vl": ("qwen2_5_vl", "qwen2_5_vl_tiny.yaml"),
          "qwen3-vl": ("qwen3_vl", "qwen3_vl_tiny.yaml"),
          "nemotron-omni": ("nemotron_omni", "nemotron_omni_tiny.yaml")}


def image_sets(quick: bool) -> dict[str, list[bytes]]:
    rng = np.random.default_rng(0)
    pages = 1 if quick else 3
    return {
        "InfoVQA-like 2000x5000": [document_jpeg(rng, 2000, 5000) for _ in range(pages)],
        "InfoVQA-like 1000x3000": [document_jpeg(rng, 1000, 3000) for _ in range(pages)],
        "Mantis-like ~500x400": [photo_jpeg(rng, int(rng.integers(440, 560)),
                                            int(rng.integers(350, 450)))
                                 for _ in range(4 if quick else 12)],
    }


def make_encoder(model: str, tokenizer, image_decode: str):
    from energon_tasks import task_encoder_for
    from energon_tasks.config import TaskEncoderConfig

    return task_encoder_for(TaskEncoderConfig(model=model, image_decode=image_decode),
                            tokenizer=tokenizer)


def tiny_model(family: str, config: str):
    from models.families import build_model, config_module
    from models.parallel import init_parallel

    cfg = config_module(family).load_yaml(ROOT / "configs" / config)
    init_parallel()
    torch.manual_seed(0)
    return cfg, build_model(cfg, use_te=False).eval()


def model_inputs(cfg, encoded) -> dict:
    """The tiny model's sample: 6 text tokens, the image span, 8 text tokens (its own ids)."""
    from models.layers.mrope import mrope_positions

    grid = encoded.image_grid_thw
    merge = cfg.merge_size if cfg.family == "nemotron_omni" else cfg.vision.spatial_merge_size
    low = min(t for t in (cfg.image_token_id, cfg.vision_start_token_id, cfg.lm.vocab_size)
              if t >= 0)
    g = torch.Generator().manual_seed(1)
    ids = torch.cat([torch.randint(0, low, (6,), generator=g),
                     torch.tensor([cfg.vision_start_token_id]),
                     torch.full((int(grid.prod(-1).sum()) // merge ** 2,), cfg.image_token_id),
                     torch.tensor([cfg.vision_end_token_id]),
                     torch.randint(0, low, (8,), generator=g)])
    if cfg.family == "nemotron_omni":
        positions = torch.arange(len(ids)).expand(3, 1, -1).clone()
    else:
        positions = mrope_positions(ids, list(grid), {cfg.image_token_id}, merge)
    return {"input_ids": ids[None], "position_ids": positions,
            "pixel_values": encoded.pixel_values, "image_grid_thw": grid}


def measure(model: str, images: list[bytes], tokenizer, tiny, rounds: int) -> dict:
    encoders = {mode: make_encoder(model, tokenizer, mode) for mode in ("exact", "fast")}
    prepared = [conversation_of([data]) for data in images]
    diffs, maxima, logit_max, text_max, logit_std = [], [], [], [], []
    changed = positions = 0
    cfg, net = tiny
    for sample, parts in prepared:
        out = {mode: ours_path(encoder, sample, parts)[0] for mode, encoder in encoders.items()}
        delta = (out["fast"].pixel_values - out["exact"].pixel_values).abs()
        diffs.append(float(delta.mean()))
        maxima.append(float(delta.max()))
        with torch.no_grad():
            logits = {mode: net(**model_inputs(cfg, enc))[0] for mode, enc in out.items()}
        logit_max.append(float((logits["fast"] - logits["exact"]).abs().max()))
        logit_std.append(float(logits["exact"].std()))
        after = slice(-9, None)  # </img> / <|vision_end|> and the 8 text tokens after the image
        text_max.append(float((logits["fast"][after] - logits["exact"][after]).abs().max()))
        greedy = {mode: values[after].argmax(-1) for mode, values in logits.items()}
        changed += int((greedy["fast"] != greedy["exact"]).sum())
        positions += 9
    plans = [ours_path(encoders["exact"], s, p)[1] for s, p in prepared]
    timing = {}
    for mode, encoder in encoders.items():
        timing[f"{mode}_decode"] = lambda e=encoder: [
            e.decode_media(plan, s, p) for plan, (s, p) in zip(plans, prepared, strict=True)]
        timing[f"{mode}_encode"] = lambda e=encoder: [ours_path(e, s, p) for s, p in prepared]
    _, seconds = timed_together(timing, rounds)  # (wall, process CPU) medians
    return {
        "images": len(images),
        "visual_tokens_per_image": statistics.mean(
            m.grid.visual_tokens for plan in plans for m in plan.media),
        "pixel_mean_abs_diff": statistics.mean(diffs), "pixel_max_abs_diff": max(maxima),
        "logit_max_abs_diff": max(logit_max), "logit_max_abs_diff_after_image": max(text_max),
        "logit_std": statistics.mean(logit_std),
        "greedy_token_changed": changed / positions,
        "cpu_ms_per_image": {k: 1000 * v / len(images) for k, v in seconds.items()},
        "exact_over_fast_decode": seconds["exact_decode"] / seconds["fast_decode"],
        "exact_over_fast_encode": seconds["exact_encode"] / seconds["fast_encode"],
    }


def table(results: dict) -> str:
    lines = ["| model | images | visual tokens / image | pixel_values \\|fast - exact\\| mean / "
             "max | tiny model max \\|logit diff\\| all / after the image (logit std); greedy "
             "tokens changed after the image | CPU ms per image decode exact / fast (ratio) | "
             "whole encode exact / fast (ratio) |",
             "|---|---|---|---|---|---|---|"]
    for model, sets in results.items():
        for name, r in sets.items():
            ms = r["cpu_ms_per_image"]
            lines.append(
                f"| {model} | {name} | {r['visual_tokens_per_image']:.0f} | "
                f"{r['pixel_mean_abs_diff']:.4f} / {r['pixel_max_abs_diff']:.2f} | "
                f"{r['logit_max_abs_diff']:.3f} / {r['logit_max_abs_diff_after_image']:.3f} "
                f"({r['logit_std']:.2f}); {100 * r['greedy_token_changed']:.1f} % | "
                f"{ms['exact_decode']:.0f} / {ms['fast_decode']:.0f} "
                f"({r['exact_over_fast_decode']:.2f}x) | {ms['exact_encode']:.0f} / "
                f"{ms['fast_encode']:.0f} ({r['exact_over_fast_encode']:.2f}x) |")
    return "\n".join(lines)


@click.command()
@click.option("--out", default="bench_out/image_decode", type=click.Path(path_type=Path))
@click.option("--quick", is_flag=True, help="fewer images and rounds")
def main(out: Path, quick: bool) -> None:
    from energon_tasks.tokenizer import build_test_tokenizer, load_tokenizer

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = Path(tempfile.mkdtemp()) / "tokenizer"
    build_test_tokenizer(tokenizer_dir)
    tokenizer = load_tokenizer(str(tokenizer_dir))
    sets = image_sets(quick)
    rounds = 2 if quick else 5
    results = {}
    for model, (family, config) in MODELS.items():
        tiny = tiny_model(family, config)
        results[model] = {name: measure(model, images, tokenizer, tiny, rounds)
                          for name, images in sets.items()}
        print(f"[bench] {model} done", flush=True)
    record = {"machine": {"python": platform.python_version(), "torch": torch.__version__,
                          "cpus": os.cpu_count(), "load_average": os.getloadavg()},
              "rounds": rounds, "results": results}
    (out / "image_decode.json").write_text(json.dumps(record, indent=2))
    print(table(results))


if __name__ == "__main__":
    main()
