"""Activation recomputation (model config ``recompute``): memory kept for backward vs time, side by
side in one run.

One process, one intra-op thread, CPU. A small Qwen2.5-VL (vision 4 layers x 128, LM 4 layers x
256, fp32, random init) trains on one row of ``--images`` images (16 x 16 patches each: 64 visual
tokens) interleaved with text, ``--tokens`` tokens in all. For each mode (none, selective, full)
from the same initial weights: the bytes of the distinct tensors autograd keeps for backward
(``saved_tensors_hooks``: activations plus the weights the linears keep, which every mode keeps)
and the CPU time of forward + backward (median of ``--repeats`` after one warm-up; the modes take
turns in each repeat). Reported as ratios to ``none``; the gradients are checked to be equal.

Usage: python bench/bench_recompute.py --out bench_out/recompute
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import click
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODES = ("none", "selective", "full")
SHAPES = ["vision.depth=4", "vision.hidden_size=128", "vision.intermediate_size=256",
          "vision.num_heads=4", "vision.out_hidden_size=256", "vision.fullatt_block_indexes=[1,3]",
          "lm.hidden_size=256", "lm.intermediate_size=704", "lm.num_layers=4", "lm.num_heads=4",
          "lm.num_kv_heads=2", "lm.head_dim=64", "lm.mrope_section=[8,12,12]"]


def make_row(cfg, images: int, tokens: int) -> dict:
    """One row: text, then ``images`` times (image span + text), ``tokens`` tokens in all."""
    from models.layers.mrope import mrope_positions

    g = torch.Generator().manual_seed(0)
    v, merge = cfg.vision, cfg.vision.spatial_merge_size
    grid = [1, 16, 16]
    span = 2 + grid[1] * grid[2] // merge ** 2
    text = (tokens - images * span) // (images + 1)
    if text < 1:
        raise click.UsageError(f"--tokens {tokens} is too short for {images} images")
    low = min(cfg.image_token_id, cfg.vision_start_token_id)
    parts = [torch.randint(0, low, (text,), generator=g)]
    for _ in range(images):
        parts += [torch.tensor([cfg.vision_start_token_id]),
                  torch.full((span - 2,), cfg.image_token_id),
                  torch.tensor([cfg.vision_end_token_id]),
                  torch.randint(0, low, (text,), generator=g)]
    ids = torch.cat(parts)
    grids = torch.tensor([grid] * images)
    dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return {"input_ids": ids[None], "pixel_values": torch.randn(images * 256, dim, generator=g),
            "image_grid_thw": grids,
            "position_ids": mrope_positions(ids, list(grids), {cfg.image_token_id}, merge)}


@click.command()
@click.option("--out", default="bench_out/recompute", type=click.Path(path_type=Path))
@click.option("--images", default=8, show_default=True)
@click.option("--tokens", default=2048, show_default=True)
@click.option("--repeats", default=5, show_default=True)
def main(out: Path, images: int, tokens: int, repeats: int) -> None:
    torch.set_num_threads(1)
    from models.families import build_model
    from models.families.qwen_vl.config import load_yaml
    from models.layers.recompute import backward_footprint
    from models.parallel import init_parallel

    init_parallel()
    models, row = {}, None
    for mode in MODES:
        cfg = load_yaml(REPO / "configs" / "qwen2_5_vl_tiny.yaml", [*SHAPES, f"recompute={mode}"])
        torch.manual_seed(0)
        models[mode] = build_model(cfg, use_te=False).train()
        row = row or make_row(cfg, images, tokens)
    kept, times, grads = {}, {m: [] for m in MODES}, {}
    for mode in MODES:  # warm-up; the kept bytes and gradients do not vary between repeats
        kept[mode], _, grads[mode] = backward_footprint(models[mode], row)
    for key, grad in grads["none"].items():
        for mode in MODES[1:]:
            torch.testing.assert_close(grads[mode][key], grad, rtol=0, atol=1e-6, msg=key)
    for _ in range(repeats):
        for mode in MODES:
            times[mode].append(backward_footprint(models[mode], row)[1])
    seconds = {m: statistics.median(t) for m, t in times.items()}
    result = {"images": images, "tokens": int(row["input_ids"].shape[1]),
              "patches": int(row["pixel_values"].shape[0]), "shapes": SHAPES,
              "kept_bytes": kept, "step_cpu_s": seconds,
              "kept_ratio": {m: kept[m] / kept["none"] for m in MODES},
              "time_ratio": {m: seconds[m] / seconds["none"] for m in MODES},
              "gradients_equal": True}
    out.mkdir(parents=True, exist_ok=True)
    (out / "recompute.json").write_text(json.dumps(result, indent=1))
    print("| mode | kept for backward | vs none | fwd+bwd CPU s | vs none |")
    print("|---|---|---|---|---|")
    for m in MODES:
        print(f"| {m} | {kept[m] / 2**20:.1f} MiB | {result['kept_ratio'][m]:.2f} | "
              f"{seconds[m]:.3f} | {result['time_ratio'][m]:.2f} |")


if __name__ == "__main__":
    main()
